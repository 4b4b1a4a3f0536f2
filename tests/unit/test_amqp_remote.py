"""Queues of another node (`protocols/amqp/remote.py`) without sockets: the link codec, and two
AMQP services, a queue's home and another node, joined by an in-memory `QueueDirectory` that
runs the home's `QueueHost` directly (the cluster's gRPC transport carries the same requests
and frames)."""

from __future__ import annotations

import asyncio
import datetime
import json
from decimal import Decimal
from typing import Any

from pamqp import commands
from shardgate.core.broker import Broker
from shardgate.core.edge import Edge
from shardgate.core.message import Message
from shardgate.protocols.amqp.properties import NATIVE_FORMAT, encoded_properties
from shardgate.protocols.amqp.queues import QueueEntry
from shardgate.protocols.amqp.remote import (
    HostedConsumer,
    QueueHost,
    decode_delivery,
    decode_table,
    encode_delivery,
    encode_table,
    pack_frames,
    unpack_frames,
)
from shardgate.protocols.amqp.settings import AmqpSettings

from tests.manual_clock import ManualClock
from tests.unit.test_amqp_connection import Client, Loopless


def test_a_delivery_keeps_its_topic_body_and_exact_properties() -> None:
    properties = commands.Basic.Properties(
        content_type="text/plain", delivery_mode=2, priority=3,
        headers={"n": 7, "when": datetime.datetime(2026, 1, 2, 3, 4, 5)},
    ).marshal()
    message = Message("$amqp/orders/eu.paris", b"\x00body\xff", native_properties={NATIVE_FORMAT: properties})
    delivery_id, redelivered, back = decode_delivery(encode_delivery(41, QueueEntry(message, None, True)))
    assert (delivery_id, redelivered, back.topic, back.payload) == (41, True, message.topic, message.payload)
    assert encoded_properties(back) == properties


def test_frames_and_field_tables_round_trip() -> None:
    frames = [b"A" + bytes(16), b"X", b"D" + b"x" * 70000]
    assert unpack_frames(pack_frames(frames)) == frames
    assert unpack_frames(pack_frames([])) == []
    table = {"x-match": "all", "n": 5, "price": Decimal("1.25"), "nested": {"ok": True}, "list": [1, "a"]}
    assert decode_table(encode_table(table)) == table
    assert encode_table(None) == "" and decode_table("") == {}
    assert decode_table(encode_table({"raw": b"\x00\xff"})) == {"raw": "\x00\xff"}


class InMemoryDirectory:
    """Another node's view of where queues live, reaching the home's `QueueHost` in memory:
    requests and frames cross as bytes, one event-loop turn later, as over a network."""

    def __init__(self, host: QueueHost) -> None:
        self.host = host
        self.homes: dict[str, str] = {}
        self.up = True
        self.links: list[Any] = []

    def home(self, vhost: str, queue: str) -> str | None:
        return self.homes.get(queue)

    def live(self, node: str) -> bool:
        return self.up

    def _later(self, value: Any) -> asyncio.Future[Any]:
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(future.set_result, value)
        return future

    def lookup(self, vhost: str, queue: str) -> asyncio.Future[str | None]:
        return self._later(self.homes.get(queue))

    def claim(self, vhost: str, queue: str, durable: bool) -> asyncio.Future[str | None]:
        return self._later(None)

    def replicated(self, vhost: str, queue: str) -> asyncio.Future[None] | None:
        return None

    def call(self, node: str, request: dict[str, Any]) -> asyncio.Future[dict[str, Any]]:
        reply = self.host.handle(json.loads(json.dumps({**request, "node": "away"})))
        return self._later(json.loads(json.dumps(reply)))

    def consume(self, node: str, request: dict[str, Any], receive: Any) -> Any:
        directory = self
        loop = asyncio.get_running_loop()

        class Link:
            def __init__(self) -> None:
                self.closed = False
                self.hosted: HostedConsumer | None = None
                hosted = directory.host.consume(json.loads(json.dumps(request)), self.deliver)
                self.hosted = hosted if isinstance(hosted, HostedConsumer) else None
                if self.hosted is None:
                    self.deliver(hosted)

            def deliver(self, frame: bytes) -> None:
                loop.call_soon(receive, bytes(frame))
                if frame[:1] == b"D":
                    loop.call_soon(lambda: self.hosted.written(1))

            def send(self, frame: bytes) -> None:
                if self.hosted is not None:
                    loop.call_soon(self.hosted.receive, bytes(frame))

            def close(self) -> None:
                self.closed = True
                if self.hosted is not None:
                    loop.call_soon(self.hosted.close)

        link = Link()
        self.links.append(link)
        return link


async def turns(count: int = 10) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def of(frames: list[tuple[int, Any]], kind: type) -> list[Any]:
    return [value for _, value in frames if isinstance(value, kind)]


def nodes() -> tuple[Client, Client, InMemoryDirectory]:
    home_service = Loopless(Edge(Broker()), AmqpSettings(), scheduler=ManualClock())
    away_service = Loopless(Edge(Broker()), AmqpSettings(), scheduler=ManualClock())
    directory = InMemoryDirectory(QueueHost(home_service))
    away_service.vhosts["/"].directory = directory
    home, away = Client(home_service), Client(away_service)
    for client in (home, away):
        client.handshake()
        client.open_channel(1)
    return home, away, directory


async def test_another_node_declares_gets_consumes_and_settles_the_homes_queue() -> None:
    home, away, directory = nodes()
    home.send(1, commands.Queue.Declare(queue="work", durable=True))
    directory.homes["work"] = "home"
    for body in (b"a", b"b", b"c"):
        home.publish(1, "", "work", body)

    away.send(1, commands.Queue.Declare(queue="work", passive=True))
    await turns()
    (declared,) = of(away.read(), commands.Queue.DeclareOk)
    assert (declared.queue, declared.message_count) == ("work", 3)

    # prefetch 1: one delivery at a time; a requeue comes back redelivered, an ack settles
    away.send(1, commands.Basic.Qos(prefetch_count=1))
    away.send(1, commands.Basic.Consume(queue="work", consumer_tag="t"))
    await turns()
    out = away.read()
    assert of(out, commands.Basic.ConsumeOk) and len(of(out, commands.Basic.Deliver)) == 1
    first = of(out, commands.Basic.Deliver)[0]
    assert (first.delivery_tag, first.redelivered) == (1, False)
    away.send(1, commands.Basic.Nack(delivery_tag=1, requeue=True))
    await turns()
    (again,) = of(away.read(), commands.Basic.Deliver)
    assert again.redelivered
    away.send(1, commands.Basic.Ack(delivery_tag=again.delivery_tag))
    await turns()
    assert len(of(away.read(), commands.Basic.Deliver)) == 1  # "b", the window moved
    assert len(home.service.vhosts["/"].queues["work"].messages) == 1  # "c" waits

    # the channel closes: what it held goes back to the home's queue
    away.send(1, commands.Channel.Close(200, "bye", 0, 0))
    await turns()
    assert len(home.service.vhosts["/"].queues["work"].messages) == 2
    assert all(link.hosted.closed for link in directory.links)


async def test_a_queue_deleted_on_its_home_cancels_the_consumers_elsewhere() -> None:
    home, away, directory = nodes()
    home.send(1, commands.Queue.Declare(queue="gone", durable=True))
    directory.homes["gone"] = "home"
    away.send(1, commands.Basic.Consume(queue="gone", consumer_tag="t"))
    await turns()
    assert of(away.read(), commands.Basic.ConsumeOk)
    home.send(1, commands.Queue.Delete(queue="gone"))
    await turns()
    (cancel,) = of(away.read(), commands.Basic.Cancel)
    assert cancel.consumer_tag == "t"


async def test_errors_of_the_home_and_a_home_that_is_down() -> None:
    home, away, directory = nodes()
    home.send(1, commands.Queue.Declare(queue="q", durable=True))
    directory.homes["q"] = "home"
    away.send(1, commands.Queue.Declare(queue="q", durable=True, arguments={"x-max-length": 1}))
    await turns()
    (close,) = of(away.read(), commands.Channel.Close)
    assert close.reply_code == 406 and "inequivalent arg 'x-max-length'" in close.reply_text
    away.open_channel(2)
    directory.up = False
    (close,) = of(away.send(2, commands.Queue.Declare(queue="q", passive=True)), commands.Channel.Close)
    assert close.reply_code == 404
    assert close.reply_text == ("NOT_FOUND - home node 'home' of durable queue 'q' in vhost '/' is down "
                                "or inaccessible")
    assert (close.class_id, close.method_id) == (50, 10)


async def test_a_no_ack_consumer_elsewhere_gets_more_only_as_its_client_takes_them() -> None:
    """A no-ack consumer has no prefetch: the home node sends at most MAX_IN_FLIGHT deliveries
    that the consumer's node has not yet handed to a client connection able to take more."""
    from shardgate.protocols.amqp.remote import MAX_IN_FLIGHT

    home, away, directory = nodes()
    home.send(1, commands.Queue.Declare(queue="fast", durable=True))
    directory.homes["fast"] = "home"
    total = MAX_IN_FLIGHT + 100
    for index in range(total):
        home.publish(1, "", "fast", b"%d" % index)
    away.send(1, commands.Basic.Consume(queue="fast", consumer_tag="t", no_ack=True))
    await turns()
    assert len(of(away.read(), commands.Basic.Deliver)) == MAX_IN_FLIGHT
    away.service.scheduler.run_soon()  # the away node reports what its client's connection took
    await turns()
    assert len(of(away.read(), commands.Basic.Deliver)) == 100
    assert not home.service.vhosts["/"].queues["fast"].messages
