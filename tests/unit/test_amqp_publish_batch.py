"""The basic.publishes of one socket read go to the core in one call (`Edge.publish_many`): on a
reliable stream that is one journal append per shard for the whole read, and the publisher
confirms go out once the commit covers them, merged into one basic.ack with multiple=true. A
refused publish is nacked alone; a method after publishes in the same read (here tx.commit and
basic.get) sees them stored first, as on RabbitMQ's channel."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pamqp import body as pbody
from pamqp import commands, frame, header
from shardgate.core.broker import Broker
from shardgate.core.edge import Edge
from shardgate.core.streams import StreamConfig
from shardgate.protocols.amqp.service import AmqpService
from shardgate.protocols.amqp.settings import AmqpSettings
from shardgate.storage.journal import JournalStorage

from tests.unit.test_amqp_connection import Client
from tests.unit.test_publish_batch import count_appends, until


def publish_frames(channel: int, exchange: str, key: str, body: bytes, **props: Any) -> bytes:
    return b"".join(frame.marshal(value, channel) for value in (
        commands.Basic.Publish(exchange=exchange, routing_key=key),
        header.ContentHeader(0, len(body), commands.Basic.Properties(**props)),
        pbody.ContentBody(body),
    ))


@pytest.fixture
async def node(journal: JournalStorage):
    broker = Broker(storage=journal, default_stream=StreamConfig("default", mode="reliable"))
    broker.create_stream(StreamConfig("json", mode="reliable", schema="json"), routes=["j/#"])
    service = AmqpService(Edge(broker), AmqpSettings(), scheduler=asyncio.get_running_loop())
    service.start()
    yield broker, service
    service.stop()


async def frames_until(client: Client, done: Any, timeout: float = 10.0) -> list[tuple[int, Any]]:
    got: list[tuple[int, Any]] = []
    await until(lambda: got.extend(client.read()) or done(got), timeout)
    return got


async def test_a_read_of_confirmed_publishes_is_one_append_and_one_multiple_ack(node) -> None:
    broker, service = node
    (log,) = count_appends(broker)
    client = Client(service)
    client.handshake()
    client.open_channel(1)
    client.send(1, commands.Confirm.Select(), commands.Queue.Declare(queue="orders", durable=True))
    read = b"".join(publish_frames(1, "", "orders", f"m{i}".encode(), delivery_mode=2)
                    for i in range(50))
    client.conn.data_received(read)
    acks = [value for _, value in await frames_until(
        client, lambda got: any(isinstance(v, commands.Basic.Ack) and v.delivery_tag == 50
                                for _, v in got))
            if isinstance(value, commands.Basic.Ack)]
    assert [(ack.delivery_tag, ack.multiple) for ack in acks] == [(50, True)]
    assert log.appends[-1:] == [50], "the read's 50 messages in one journal append"

    def count() -> int:
        out = client.send(1, commands.Queue.Declare(queue="orders", passive=True))
        return int(out[-1][1].message_count)

    await until(lambda: count() == 50)


async def test_a_refused_publish_in_a_read_is_nacked_alone(node) -> None:
    broker, service = node
    client = Client(service)
    client.handshake()
    client.open_channel(1)
    client.send(1, commands.Confirm.Select(),
                commands.Queue.Declare(queue="j", durable=True),
                commands.Queue.Bind(queue="j", exchange="amq.topic", routing_key="j.#"))
    client.conn.data_received(b"".join((
        publish_frames(1, "amq.topic", "j.a", b'{"ok": 1}'),
        publish_frames(1, "amq.topic", "j.b", b"not json"),
        publish_frames(1, "amq.topic", "j.c", b'{"ok": 3}'),
    )))
    got = await frames_until(client, lambda got: any(
        isinstance(v, commands.Basic.Ack) and v.delivery_tag == 3 for _, v in got))
    settled = [(type(v).__name__, v.delivery_tag, v.multiple) for _, v in got
               if isinstance(v, commands.Basic.Ack | commands.Basic.Nack)]
    # tag 1 is acked before or with tag 3; tag 2 alone is nacked
    assert ("Nack", 2, False) in settled
    assert settled[-1] == ("Ack", 3, True)
    assert all(tag != 2 for kind, tag, _ in settled if kind == "Ack")


async def test_a_method_after_publishes_in_the_same_read_sees_them(node) -> None:
    broker, service = node
    (log,) = count_appends(broker)
    client = Client(service)
    client.handshake()
    client.open_channel(1)
    client.open_channel(2)
    client.send(1, commands.Queue.Declare(queue="q"), commands.Tx.Select())
    client.conn.data_received(b"".join((
        publish_frames(1, "", "q", b"t1", delivery_mode=2),
        publish_frames(1, "", "q", b"t2", delivery_mode=2),
        publish_frames(2, "", "q", b"p3", delivery_mode=2),
        frame.marshal(commands.Tx.Commit(), 1),
        frame.marshal(commands.Basic.Get(queue="q", no_ack=True), 2),
    )))
    got = await frames_until(client, lambda got: any(isinstance(v, commands.Basic.GetOk | commands.Basic.GetEmpty) for _, v in got))
    kinds = [type(v).__name__ for _, v in got]
    assert kinds.index("CommitOk") < kinds.index("GetOk")
    bodies = [v.value for _, v in got if isinstance(v, pbody.ContentBody)]
    # p3 (channel 2) reached the core before tx.commit published t1 and t2
    assert bodies == [b"p3"]
    assert sum(log.appends) == 3
