"""Messages come back exactly as they were sent, across a restart and from the archive.

(pika cannot encode floats; the float and double field types, and every integer width, are
covered byte for byte by tests/unit/test_message_records.py.)

One message from each producer (MQTT 5.0, MQTT 3.1.1, AMQP with typed headers and every basic
property, the gRPC SDK with repeated headers) goes to a reliable stream. Each consumer protocol
(MQTT 5.0, MQTT 3.1.1, AMQP, gRPC) has two durable subscriptions: `live` reads the messages
while the broker runs; `kept` reads them only after the broker restarted (SIGTERM or SIGKILL),
or after the journal dropped them and they come from the Parquet archive. What `kept` receives
equals what `live` received, field by field and type by type; and for a producer and consumer
of the same protocol, it equals what was published.
"""

from __future__ import annotations

import datetime
import decimal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pika
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from shardgate.client import SyncClient

from tests.conftest import ThreadedBroker, free_port, make_config, wait_for
from tests.mqtt_clients import V5, V311, Paho

STAMP = datetime.datetime(2026, 11, 23, 17, 4, 33, tzinfo=datetime.UTC)
AMQP_HEADERS: dict[str, Any] = {
    "eta": None, "void": None, "yes": True, "no": False, "small": 7, "negative": -300,
    "large": 2**40, "decimal": decimal.Decimal("3.14"), "timestamp": STAMP,
    "bytes": b"\x00\xff", "text": "ü" * 300,
    "table": {"nested": {"deep": [1, "a", None]}, "flag": True},
    "array": [1, "two", True, None, {"k": "v"}, [2, 3]],
    "timelimit": [None, None],
}
AMQP_PROPERTIES = {
    "content_type": "application/json", "content_encoding": "utf-8", "headers": AMQP_HEADERS,
    "delivery_mode": 2, "priority": 3, "correlation_id": "corr-amqp",
    "reply_to": "rt-replies", "expiration": "3600000", "message_id": "msg-1",
    "timestamp": 1795453473, "type": "task", "user_id": "guest", "app_id": "round-trip",
}
USER_PROPERTIES = [("k", "1"), ("a", "x"), ("k", "2"), ("k", "1")]
GRPC_HEADERS = [("trace", "t-1"), ("b", ""), ("trace", "t-2")]
CONSUMERS = ("mqtt5", "mqtt311", "amqp", "grpc")


def typed(value: Any) -> Any:
    """`value` with the type of every part spelled out, so that 7 and '7' or None and ''
    never compare equal."""
    if isinstance(value, dict):
        return ("dict", sorted((str(k), typed(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, [typed(v) for v in value])
    if isinstance(value, int) and not isinstance(value, bool):
        return ("int", int(value))  # pika decodes 64-bit integers as its `long` (an int)
    return (type(value).__name__, value)


# ------------------------------------------------------------------ one broker, its clients
class Node:
    """The ports of a running broker, however it was started."""

    def __init__(self, mqtt: int, amqp: int, grpc: int) -> None:
        self.mqtt, self.amqp, self.grpc = mqtt, amqp, grpc

    def amqp_channel(self) -> tuple[pika.BlockingConnection, Any]:
        conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", self.amqp, heartbeat=0))
        channel = conn.channel()
        return conn, channel

    def grpc_client(self) -> SyncClient:
        return SyncClient(f"127.0.0.1:{self.grpc}")


def mqtt_subscriber(node: Node, name: str, version: int) -> Paho:
    return Paho(node.mqtt, name, version, clean=False, session_expiry=3600)


def create_subscriptions(node: Node) -> None:
    """Both durable subscriptions of every consumer protocol; `kept` goes offline at once."""
    for role in ("live", "kept"):
        for version, tag in ((V5, "v5"), (V311, "v311")):
            client = mqtt_subscriber(node, f"rt-{role}-{tag}", version)
            client.subscribe("rt/#", 1)
            if role == "kept":
                client.disconnect()
            else:
                client.disconnect()  # reconnects to read, below
    conn, channel = node.amqp_channel()
    for role in ("live", "kept"):
        channel.queue_declare(f"rt-{role}", durable=True)
        channel.queue_bind(f"rt-{role}", "amq.topic", "rt.#")
    conn.close()
    with node.grpc_client() as client:
        for role in ("live", "kept"):
            consumer = client.consumer(f"rt-{role}", ["rt/#"], durable=True, reconnect=False)
            consumer.subscribe()
            consumer.close()


def publish_all(node: Node) -> int:
    """One message per producer protocol, each acknowledged by the broker; returns the offset
    of the last (gRPC's, published last)."""
    props = Properties(PacketTypes.PUBLISH)
    props.UserProperty = USER_PROPERTIES
    props.PayloadFormatIndicator = 1
    props.ContentType = "text/plain; charset=utf-8"
    props.CorrelationData = b"\x00corr\xff"
    props.ResponseTopic = "rt/replies"
    props.MessageExpiryInterval = 3600
    v5 = Paho(node.mqtt, "rt-pub-v5", V5)
    v5.publish("rt/mqtt5", "ünïcode", 1, properties=props)
    v5.disconnect()
    v311 = Paho(node.mqtt, "rt-pub-v311", V311)
    v311.publish("rt/mqtt311", b"\x00\x01binary", 1)
    v311.disconnect()
    conn, channel = node.amqp_channel()
    channel.confirm_delivery()
    channel.basic_publish("amq.topic", "rt.amqp", b'{"task": 1}',
                          pika.BasicProperties(**AMQP_PROPERTIES), mandatory=True)
    conn.close()
    with node.grpc_client() as client:
        receipt = client.producer("rt-grpc").send(
            "rt/grpc", b"grpc-payload", key=b"key-1", headers=GRPC_HEADERS,
            content_type="application/octet-stream", correlation_data=b"\x01\x02",
            reply_to="rt/grpc-replies", ttl_ms=3_600_000,
        )
    return receipt.offset


def _mqtt_view(message: Any) -> dict[str, Any]:
    view: dict[str, Any] = {"topic": message.topic, "payload": message.payload, "qos": message.qos}
    props = getattr(message, "properties", None)
    if props is not None:
        for name in ("UserProperty", "PayloadFormatIndicator", "ContentType", "CorrelationData",
                     "ResponseTopic"):
            if hasattr(props, name):
                view[name] = getattr(props, name)
        if hasattr(props, "MessageExpiryInterval"):
            view["MessageExpiryInterval"] = "set"  # counts down: checked below, not compared
            view["_expiry"] = props.MessageExpiryInterval
    return view


def _amqp_view(method: Any, properties: Any, body: bytes) -> dict[str, Any]:
    view: dict[str, Any] = {"routing_key": method.routing_key, "exchange": method.exchange, "body": body}
    for name in ("content_type", "content_encoding", "headers", "delivery_mode", "priority",
                 "correlation_id", "reply_to", "expiration", "message_id", "timestamp", "type",
                 "user_id", "app_id", "cluster_id"):
        view[name] = getattr(properties, name)
    return view


def _grpc_view(message: Any) -> dict[str, Any]:
    return {
        name: getattr(message, name)
        for name in ("topic", "payload", "key", "headers", "content_type", "correlation_data",
                     "reply_to", "publish_time_ms", "expires_at_ms", "producer_protocol",
                     "producer_id")
    }


def receive_all(node: Node, role: str) -> dict[str, dict[str, dict[str, Any]]]:
    """What each consumer protocol's `role` subscription receives: consumer → producer → view.
    Every message is acknowledged."""
    got: dict[str, dict[str, dict[str, Any]]] = {}
    for version, tag in ((V5, "mqtt5"), (V311, "mqtt311")):
        client = Paho(node.mqtt, f"rt-{role}-{'v5' if version == V5 else 'v311'}", version,
                      clean=False, session_expiry=3600)
        messages = client.expect_n(4, timeout=30)
        client.disconnect()
        got[tag] = {m.topic.split("/")[1]: _mqtt_view(m) for m in messages}
    conn, channel = node.amqp_channel()
    views = {}
    deadline = time.monotonic() + 30
    while len(views) < 4 and time.monotonic() < deadline:
        method, properties, body = channel.basic_get(f"rt-{role}")
        if method is None:
            time.sleep(0.05)
            continue
        channel.basic_ack(method.delivery_tag)
        views[method.routing_key.split(".")[1]] = _amqp_view(method, properties, body)
    conn.close()
    got["amqp"] = views
    with node.grpc_client() as client:
        consumer = client.consumer(f"rt-{role}", ["rt/#"], durable=True)
        views = {}
        while len(views) < 4:
            message = consumer.receive(timeout=30)
            message.ack()
            views[message.topic.split("/")[1]] = _grpc_view(message)
        consumer.close()
    got["grpc"] = views
    for consumer_protocol in CONSUMERS:
        assert sorted(got[consumer_protocol]) == sorted(CONSUMERS), (consumer_protocol, got)
    return got


def _without_countdown(views: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The views without what legitimately changes with time: the MQTT expiry interval left
    (checked to lie within the hour) and, for AMQP consumers of messages from other
    protocols, the expiration left in milliseconds."""
    out: dict[str, Any] = {}
    for consumer, by_producer in views.items():
        for producer, view in by_producer.items():
            view = dict(view)
            left = view.pop("_expiry", None)
            if left is not None:
                assert 0 < left <= 3600, (consumer, producer, left)
            if consumer == "amqp" and producer != "amqp" and view.get("expiration") is not None:
                assert 0 < int(view["expiration"]) <= 3_600_000, (producer, view["expiration"])
                view["expiration"] = "set"
            out[f"{producer}->{consumer}"] = view
    return out


def check_round_trip(live: dict, kept: dict) -> None:
    live_views, kept_views = _without_countdown(live), _without_countdown(kept)
    for pair in live_views:
        assert typed(kept_views[pair]) == typed(live_views[pair]), pair
    # same protocol in and out: exactly what was published
    mqtt5 = kept["mqtt5"]["mqtt5"]
    assert mqtt5["payload"] == "ünïcode".encode() and mqtt5["qos"] == 1
    assert mqtt5["UserProperty"] == USER_PROPERTIES
    assert mqtt5["PayloadFormatIndicator"] == 1
    assert mqtt5["ContentType"] == "text/plain; charset=utf-8"
    assert mqtt5["CorrelationData"] == b"\x00corr\xff"
    assert mqtt5["ResponseTopic"] == "rt/replies"
    assert 3000 < mqtt5["_expiry"] <= 3600
    assert kept["mqtt311"]["mqtt311"] == {"topic": "rt/mqtt311", "payload": b"\x00\x01binary", "qos": 1}
    amqp = kept["amqp"]["amqp"]
    assert (amqp["exchange"], amqp["routing_key"], amqp["body"]) == ("amq.topic", "rt.amqp", b'{"task": 1}')
    for name, value in AMQP_PROPERTIES.items():
        if name == "headers":
            assert sorted(amqp["headers"]) == sorted(AMQP_HEADERS)
            for key, sent in AMQP_HEADERS.items():
                assert typed(amqp["headers"][key]) == typed(sent), key
        else:
            assert typed(amqp[name]) == typed(value), name
    grpc = kept["grpc"]["grpc"]
    assert grpc["headers"] == GRPC_HEADERS
    assert (grpc["key"], grpc["content_type"], grpc["correlation_data"], grpc["reply_to"]) == (
        b"key-1", "application/octet-stream", b"\x01\x02", "rt/grpc-replies")
    assert grpc["expires_at_ms"] == grpc["publish_time_ms"] + 3_600_000
    assert (grpc["producer_protocol"], grpc["producer_id"]) == ("grpc", "rt-grpc")


# ------------------------------------------------------------------ through a restart
def _saved(data_dir: Path) -> bool:
    """The durable subscriptions are in the metadata store (saved every 0.2 s)."""
    with sqlite3.connect(f"file:{data_dir / 'metadata.db'}?mode=ro", uri=True) as db:
        names = {row[0] for row in db.execute("select name from subscriptions")}
    return {"amqp:/:rt-kept", "rt-kept"} <= names


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_properties_survive_a_restart(broker_process, tmp_path: Path, stop: str) -> None:
    amqp_port, grpc_port = free_port(), free_port()
    data_dir = tmp_path / "data"
    process = broker_process(data_dir, extra_args=[
        "--amqp-port", str(amqp_port), "--grpc-port", str(grpc_port)]).start()
    node = Node(process.mqtt_port, amqp_port, grpc_port)
    create_subscriptions(node)
    publish_all(node)
    live = receive_all(node, "live")
    wait_for(lambda: _saved(data_dir))
    if stop == "sigterm":
        assert process.terminate() == 0
    else:
        process.kill()
    process.start(mqtt_port=node.mqtt)
    kept = receive_all(node, "kept")
    check_round_trip(live, kept)


# ------------------------------------------------------------------ from the archive
@pytest.mark.timeout(240)
def test_properties_survive_archive_replay(tmp_path: Path) -> None:
    config = make_config(
        tmp_path / "data", listeners={"amqp_port": free_port(), "grpc_port": free_port()},
        journal={"segment_bytes": 4096, "retention_bytes": 8192},
    )
    broker = ThreadedBroker(config).start()
    try:
        node = Node(broker.mqtt_port, broker.app.port("amqp"), broker.app.port("grpc"))
        create_subscriptions(node)
        last = publish_all(node)
        live = receive_all(node, "live")
        filler = Paho(node.mqtt, "rt-filler", V5)  # rolls the journal past the messages above
        for index in range(300):
            filler.publish("filler/x", b"f" * 100, 1, wait=index % 50 == 49)
        filler.disconnect()

        def archive_and_cut() -> int:
            """Drop every journal segment the archive holds, though the `kept` cursors
            still point below (as if restored from a backup): they must read the archive."""
            from shardgate.core.durable import DurableSubscription

            app = broker.app
            saved = {}
            for sub in app.broker.subscriptions.values():
                if isinstance(sub, DurableSubscription):
                    saved[sub] = dict(sub.cursors)
                    sub.cursors.clear()
            app.persistence.apply_retention()
            for sub, cursors in saved.items():
                sub.cursors.update(cursors)
            return app.broker.stream("default").shards[0].log.low_watermark

        broker.call(broker.app.archiver.flush(timeout=30), timeout=40)
        assert broker.call(archive_and_cut) > last  # the four messages are only in the archive
    finally:
        broker.stop()
    # a new process's memory: nothing but the journal, the metadata and the archive
    broker = ThreadedBroker(config).start()
    try:
        low = broker.call(lambda: broker.app.broker.stream("default").shards[0].log.low_watermark)
        assert low > last
        kept = receive_all(Node(broker.mqtt_port, broker.app.port("amqp"), broker.app.port("grpc")),
                           "kept")
    finally:
        broker.stop()
    check_round_trip(live, kept)
