"""AMQP reads share each event-loop turn (`protocols/amqp/server.py` `ReadTurns`): once a
turn's reads have used their budget, a connection that has just read is paused until the next
turn, so that libuv does not read a flooding publisher again and again while the listener and
the other sockets wait; and a connection the memory alarm paused stays paused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from shardgate.core.broker import Broker
from shardgate.core.edge import Edge
from shardgate.protocols.amqp import server
from shardgate.protocols.amqp.server import AmqpProtocol, ReadTurns
from shardgate.protocols.amqp.service import AmqpService
from shardgate.protocols.amqp.settings import AmqpSettings


class Transport:
    """What the protocol uses of an asyncio transport; records whether reading is paused."""

    def __init__(self) -> None:
        self.reading = True
        self.written = bytearray()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 5672) if name == "peername" else default

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        pass


@pytest.fixture
async def service():
    amqp = AmqpService(Edge(Broker()), AmqpSettings(), scheduler=asyncio.get_running_loop())
    amqp.start()
    yield amqp
    amqp.stop()


def _connected(service: AmqpService, turns: ReadTurns) -> tuple[AmqpProtocol, Transport]:
    protocol, transport = AmqpProtocol(service, turns), Transport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport


async def test_reads_within_the_budget_keep_reading(service: AmqpService) -> None:
    turns = ReadTurns(asyncio.get_running_loop())
    protocol, transport = _connected(service, turns)
    protocol.data_received(b"AMQP\x00\x00\x09\x01")
    assert transport.reading
    await asyncio.sleep(0)
    assert b"PLAIN" in transport.written  # connection.start: the handshake began
    assert transport.reading


async def test_a_read_past_the_budget_pauses_until_the_next_turn(
        service: AmqpService, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "READ_BUDGET_S", -1.0)  # every read is past it
    turns = ReadTurns(asyncio.get_running_loop())
    first, first_transport = _connected(service, turns)
    second, second_transport = _connected(service, turns)
    first.data_received(b"AMQP\x00\x00\x09\x01")
    second.data_received(b"AMQP\x00\x00\x09\x01")
    assert not first_transport.reading and not second_transport.reading
    await asyncio.sleep(0)  # the next turn
    assert first_transport.reading and second_transport.reading


async def test_the_memory_alarm_keeps_its_pause_across_turns(
        service: AmqpService, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "READ_BUDGET_S", -1.0)
    turns = ReadTurns(asyncio.get_running_loop())
    protocol, transport = _connected(service, turns)
    protocol.data_received(b"AMQP\x00\x00\x09\x01")
    protocol.pause_reading()  # the connection holds its publisher (memory alarm)
    await asyncio.sleep(0)
    assert not transport.reading
    protocol.resume_reading()  # the alarm cleared
    assert transport.reading
    # and a connection resumed by the alarm while it waits for the next turn waits for it
    protocol.data_received(b"")
    protocol.pause_reading()
    protocol.resume_reading()
    assert not transport.reading
    await asyncio.sleep(0)
    assert transport.reading
