"""AMQP bridges keep typed headers and basic properties both ways: a remote queue consumed in
and a topic forwarded out reach AMQP consumers exactly as the AMQP publisher sent them."""

from __future__ import annotations

import datetime
import decimal
import time
from collections.abc import Callable
from pathlib import Path

import pika

from shardgate.bridges.amqp_bridge import AmqpBridgeSettings
from tests.conftest import BrokerProcess, ThreadedBroker, free_port

HEADERS = {
    "eta": None, "yes": True, "count": 7, "large": 2**40, "decimal": decimal.Decimal("1.5"),
    "when": datetime.datetime(2026, 11, 23, 17, 0, tzinfo=datetime.UTC), "bytes": b"\x00\xff",
    "table": {"nested": [1, "a", None]},
}
PROPERTIES = {"content_type": "application/json", "content_encoding": "utf-8", "priority": 4,
              "correlation_id": "c-1", "reply_to": "answers", "message_id": "m-1",
              "timestamp": 1795453473, "type": "task", "app_id": "bridge-test"}


def channel_on(port: int) -> tuple[pika.BlockingConnection, object]:
    connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, heartbeat=0))
    channel = connection.channel()
    channel.confirm_delivery()
    return connection, channel


def get_one(port: int, queue: str, timeout: float = 30) -> tuple[object, bytes]:
    connection, channel = channel_on(port)
    with connection:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            if method is not None:
                return properties, body
            time.sleep(0.05)
    raise AssertionError(f"nothing arrived on {queue}")


def check(properties: object) -> None:
    headers = {k: int(v) if isinstance(v, int) and not isinstance(v, bool) else v
               for k, v in properties.headers.items()}  # pika's `long` is an int
    assert headers == HEADERS
    assert {k: type(v) for k, v in headers.items()} == {k: type(v) for k, v in HEADERS.items()}
    for name, value in PROPERTIES.items():
        assert getattr(properties, name) == value, name


def test_bridges_keep_typed_headers_both_ways(
    broker_factory: Callable[..., ThreadedBroker], broker_process: Callable[..., BrokerProcess],
    tmp_path: Path,
) -> None:
    remote_port = free_port()
    broker_process(tmp_path / "remote", extra_args=["--amqp-port", str(remote_port)]).start()
    connection, channel = channel_on(remote_port)
    with connection:
        channel.queue_declare("to-edge", durable=True)
        channel.queue_declare("from-edge", durable=True)
        channel.queue_bind("from-edge", "amq.topic", "up.#")
    edge = broker_factory(listeners={"amqp_port": free_port()}, amqp_bridges=[
        AmqpBridgeSettings(name="down", remote=f"amqp://guest:guest@127.0.0.1:{remote_port}/",
                           queue="to-edge", topic="down/commands", reconnect_max_s=0.5),
        AmqpBridgeSettings(name="up", remote=f"amqp://guest:guest@127.0.0.1:{remote_port}/",
                           out=["up/#"], reconnect_max_s=0.5),
    ])
    edge_port = edge.app.port("amqp")
    connection, channel = channel_on(edge_port)
    with connection:
        channel.queue_declare("commands", durable=True)
        channel.queue_bind("commands", "amq.topic", "down.commands")
        channel.basic_publish("amq.topic", "up.readings", b"up", pika.BasicProperties(
            headers=HEADERS, delivery_mode=2, **PROPERTIES))
    properties, body = get_one(remote_port, "from-edge")
    assert body == b"up"
    check(properties)

    connection, channel = channel_on(remote_port)
    with connection:
        channel.basic_publish("", "to-edge", b"down", pika.BasicProperties(
            headers=HEADERS, delivery_mode=2, **PROPERTIES))
    properties, body = get_one(edge_port, "commands")
    assert body == b"down"
    check(properties)
