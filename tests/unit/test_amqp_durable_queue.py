"""A durable queue on a reliable stream: a core durable subscription behind the AMQP queue, with
a bounded memory buffer refilled from the log, and acks that advance the core cursor."""

from __future__ import annotations

import asyncio

import pytest
from pamqp import body as pbody
from pamqp import commands
from shardgate.core.broker import Broker
from shardgate.core.durable import DurableSubscription
from shardgate.core.edge import Edge
from shardgate.core.streams import StreamConfig
from shardgate.protocols.amqp import queues
from shardgate.protocols.amqp.settings import AmqpSettings
from shardgate.storage.memory import MemoryStorage

from tests.manual_clock import ManualClock
from tests.unit.test_amqp_connection import Client, Loopless


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.fixture
def client() -> Client:
    broker = Broker(storage=MemoryStorage(100_000), default_stream=StreamConfig("default", mode="reliable"))
    service = Loopless(Edge(broker), AmqpSettings(), scheduler=ManualClock())
    c = Client(service)
    c.handshake()
    c.open_channel(1)
    return c


async def test_full_buffer_leaves_messages_in_the_log_and_refills(client: Client, monkeypatch) -> None:
    monkeypatch.setattr(queues, "READY_LIMIT", 4)
    client.send(1, commands.Queue.Declare(queue="dq", durable=True))
    queue = client.service.vhosts["/"].queues["dq"]
    assert isinstance(queue.subscription, DurableSubscription)
    for i in range(10):
        client.publish(1, "", "dq", b"%d" % i, delivery_mode=2)
    await settle()
    assert len(queue.messages) == 4
    bodies = []
    for _ in range(10):
        out = client.send(1, commands.Basic.Get(queue="dq"))
        get_ok = out[0][1]
        assert isinstance(get_ok, commands.Basic.GetOk), out
        bodies.append(out[-1][1].value)
        client.send(1, commands.Basic.Ack(delivery_tag=get_ok.delivery_tag))
        await settle()
    assert bodies == [b"%d" % i for i in range(10)]
    assert all(not cursor.unacked for cursor in queue.subscription.cursors.values())


async def test_unacked_messages_stay_unacked_in_the_core(client: Client) -> None:
    client.send(1, commands.Queue.Declare(queue="dq2", durable=True))
    client.publish(1, "", "dq2", b"a", delivery_mode=2)
    await settle()
    out = client.send(1, commands.Basic.Get(queue="dq2"))
    assert isinstance(out[-1][1], pbody.ContentBody)
    sub = client.service.vhosts["/"].queues["dq2"].subscription
    assert sum(len(c.unacked) for c in sub.cursors.values()) == 1
    client.send(1, commands.Basic.Ack(delivery_tag=out[0][1].delivery_tag))
    assert sum(len(c.unacked) for c in sub.cursors.values()) == 0


async def test_messages_the_core_restores_as_unacknowledged_come_back_redelivered(client: Client) -> None:
    """After a restart the core hands a durable queue its unacknowledged messages again: they
    may have been delivered, so basic.get-ok carries redelivered; a new message does not."""
    from shardgate.core.durable import encode_cursor_state

    client.send(1, commands.Queue.Declare(queue="dq3", durable=True))
    client.publish(1, "", "dq3", b"before", delivery_mode=2)
    await settle()
    queue = client.service.vhosts["/"].queues["dq3"]
    sub = queue.subscription
    assert isinstance(sub, DurableSubscription)
    [(stream, shard)] = [key for key, cursor in sub.cursors.items() if cursor.unacked]
    cursor = sub.cursors[(stream, shard)]
    state = encode_cursor_state(cursor.position, sorted(cursor.unacked))
    # what a restarted broker has: the saved cursor, and an empty queue
    queue.messages.clear()
    queue.ready_bytes = 0
    sub.restore_cursor(stream, shard, state)
    sub.wake()
    await settle()
    client.publish(1, "", "dq3", b"after", delivery_mode=2)
    await settle()
    got = []
    for _ in range(2):
        out = client.send(1, commands.Basic.Get(queue="dq3"))
        get_ok = out[0][1]
        assert isinstance(get_ok, commands.Basic.GetOk), out
        got.append((out[-1][1].value, get_ok.redelivered))
    assert got == [(b"before", True), (b"after", False)]
