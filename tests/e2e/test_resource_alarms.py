"""The memory and disk alarms (`shardgate/resources.py`), as RabbitMQ's: below the free-disk
limit reliable publishes are refused with each protocol's quota error, above the memory high
watermark publishers are held. The limits are set beyond what the machine has (a free-disk
limit of an exabyte, a watermark of 2 bytes) so that each alarm is raised from the start.
Before them a flood filled the disk and memory until the broker failed (issue 26, item 10)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import aio_pika
import grpc
import pika
import pytest
from aio_pika.exceptions import DeliveryError
from shardgate.client import Client, ResourceExhausted
from shardgate.proto import shardgate_pb2 as pb
from shardgate.proto import shardgate_pb2_grpc as pb_grpc
from shardgate.protocols.mqtt import packets as p

from tests.conftest import ThreadedBroker, free_port
from tests.mqtt_clients import V5, Paho, RawClient

STREAMS = [
    {"name": "fast", "mode": "non-reliable", "routes": ["fast/#"]},
]


def full_disk_broker(broker_factory: Callable[..., ThreadedBroker]) -> ThreadedBroker:
    from shardgate.config import StreamEntry

    return broker_factory(
        listeners={"grpc_port": free_port(), "amqp_port": free_port()},
        disk_free_limit=1 << 60, streams=[StreamEntry(**entry) for entry in STREAMS])


def test_below_the_free_disk_limit_reliable_publishes_get_each_protocols_quota_error(
    broker_factory: Callable[..., ThreadedBroker],
) -> None:
    broker = full_disk_broker(broker_factory)
    subscriber = Paho(broker.mqtt_port, "watch", V5)
    subscriber.subscribe("#", qos=1)
    # MQTT 5: PUBACK 0x97 quota exceeded, with a reason string
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("publisher")
    raw.send(p.Publish("safe/x", b"refused", qos=1, packet_id=1))
    puback = raw.receive()
    assert isinstance(puback, p.Puback) and puback.reason_code == 0x97, puback
    assert "disk_free_limit" in str(puback.properties.reason_string), puback
    # a non-reliable stream is not stored: it goes on
    raw.send(p.Publish("fast/x", b"memory only", qos=1, packet_id=2))
    puback = raw.receive()
    assert isinstance(puback, p.Puback) and puback.reason_code == 0, puback
    assert subscriber.expect().payload == b"memory only"
    raw.close()

    async def grpc_and_amqp() -> None:
        async with Client(f"127.0.0.1:{broker.app.port('grpc')}") as client:
            with pytest.raises(ResourceExhausted, match="disk_free_limit"):
                await client.producer().publish("safe/y", b"refused")
        url = f"amqp://guest:guest@127.0.0.1:{broker.app.port('amqp')}/"
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel()  # publisher confirms
            exchange = await channel.get_exchange("amq.topic")
            with pytest.raises(DeliveryError):
                await exchange.publish(aio_pika.Message(
                    b"refused", delivery_mode=aio_pika.DeliveryMode.PERSISTENT), "safe.z")

    asyncio.run(grpc_and_amqp())
    subscriber.expect_none()  # none of the refused ones was delivered
    subscriber.disconnect()


def test_above_the_memory_high_watermark_publishers_are_held(
    broker_factory: Callable[..., ThreadedBroker],
) -> None:
    broker = broker_factory(listeners={"grpc_port": free_port(), "amqp_port": free_port()},
                            memory_high_watermark=2.0)
    # AMQP: connection.blocked when the connection publishes, and its publish waits
    blocked: list[str] = []
    connection = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", broker.app.port("amqp"), blocked_connection_timeout=3))
    connection.add_on_connection_blocked_callback(
        lambda _conn, frame: blocked.append(frame.method.reason))
    channel = connection.channel()
    channel.basic_publish("amq.topic", "held.x", b"held")  # no confirms: returns at once
    deadline = time.monotonic() + 10
    while not blocked and time.monotonic() < deadline:
        connection.process_data_events(time_limit=0.1)
    assert blocked == ["low on memory"]
    # (a held connection is not read, its connection.close either: pika gives up after the
    # blocked timeout, as with RabbitMQ)
    with contextlib.suppress(pika.exceptions.AMQPError):
        connection.close()

    # gRPC: a producer waits (here until its deadline)
    async def grpc_publish() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{broker.app.port('grpc')}") as channel:
            try:
                await pb_grpc.ProducerStub(channel).Publish(
                    pb.PublishRequest(topic="held/y", payload=b"waits"), timeout=1.0)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    assert asyncio.run(grpc_publish()) is grpc.StatusCode.DEADLINE_EXCEEDED
    # MQTT: a publisher's socket is read about once a second: five QoS 1 round trips take
    # seconds, not milliseconds
    publisher = Paho(broker.mqtt_port, "flooder", V5)
    started = time.monotonic()
    for index in range(5):
        publisher.publish("held/z", f"m{index}".encode(), qos=1)
    assert time.monotonic() - started >= 3.5
    publisher.disconnect()
