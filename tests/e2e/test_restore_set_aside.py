"""No stored record stops `shardgate serve` from starting again: AMQP names of any characters
map onto topics losslessly (and survive a restart), and a record that cannot be restored is
logged with what it was and set aside while everything else starts (issue 26, item 1)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pika
import pytest
from shardgate.core.message import Message
from shardgate.core.records import encode_message
from shardgate.storage.metadata import SqliteMetadataStore
from shardgate.storage.metadata.records import RouteRecord, SessionRecord, SubscriptionRecord

from tests.conftest import BrokerProcess, free_port, wait_for
from tests.mqtt_clients import V5, Paho

# Names RabbitMQ accepts and the topic layer gives a meaning to (or refuses) as they are.
EXCHANGES = [("#x", "fanout"), ("dave-x/#", "topic"), ("a+b", "direct"), ("per%23cent", "headers")]
QUEUE = "bad name!"


def amqp(port: int) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", port, connection_attempts=1, socket_timeout=30, blocked_connection_timeout=30,
        stack_timeout=30))


def serve(broker_process, data_dir: Path | None = None) -> BrokerProcess:
    return broker_process(data_dir, extra_args=["--amqp-port", str(free_port())]).start()


def publish_through_every_exchange(channel, tag: str) -> None:
    channel.confirm_delivery()
    for exchange, kind in EXCHANGES:
        key = "k.#.+" if kind == "topic" else "k/+#"
        channel.basic_publish(exchange, key, f"{tag} {exchange}".encode(),
                              pika.BasicProperties(delivery_mode=2, headers={"h": "1"}),
                              mandatory=True)


def take(channel, queue: str, count: int) -> list[tuple[str, str, bytes]]:
    got: list[tuple[str, str, bytes]] = []

    def one() -> bool:
        method, _props, body = channel.basic_get(queue, auto_ack=True)
        if method is not None:
            got.append((method.exchange, method.routing_key, body))
        return len(got) >= count

    wait_for(one, timeout=30)
    return got


@pytest.mark.timeout(240)
def test_amqp_names_any_characters_route_and_survive_a_restart(broker_process) -> None:
    broker = serve(broker_process)
    port = broker.ports["amqp"]
    connection = amqp(port)
    channel = connection.channel()
    channel.queue_declare(QUEUE, durable=True)
    for exchange, kind in EXCHANGES:
        channel.exchange_declare(exchange, kind, durable=True)
        key = "k.#.+" if kind == "topic" else "k/+#"
        arguments = {"x-match": "all", "h": "1"} if kind == "headers" else None
        channel.queue_bind(QUEUE, exchange, key, arguments=arguments)
    publish_through_every_exchange(channel, "before")
    got = take(channel, QUEUE, len(EXCHANGES))
    # every delivery names its exchange and routing key exactly as published
    assert sorted(got) == sorted(
        (exchange, "k.#.+" if kind == "topic" else "k/+#", f"before {exchange}".encode())
        for exchange, kind in EXCHANGES)
    channel.basic_publish("", QUEUE, b"kept", pika.BasicProperties(delivery_mode=2))
    connection.close()

    assert broker.terminate() == 0
    broker.start()  # used to exit 1: TopicError in restore_subscriptions
    connection = amqp(broker.ports["amqp"])
    channel = connection.channel()
    assert take(channel, QUEUE, 1) == [("", QUEUE, b"kept")]
    publish_through_every_exchange(channel, "after")
    assert sorted(body for _e, _k, body in take(channel, QUEUE, len(EXCHANGES))) == sorted(
        f"after {exchange}".encode() for exchange, _kind in EXCHANGES)
    # consume (not only get) from the queue of the odd name
    channel.basic_publish("", QUEUE, b"consumed")
    for method, _props, body in channel.consume(QUEUE, auto_ack=True, inactivity_timeout=30):
        assert method is not None and body == b"consumed"
        break
    channel.cancel()
    connection.close()
    assert "Traceback" not in broker.log_path.read_text()


def plant(data_dir: Path) -> None:
    """Records a start cannot restore, next to good ones, straight into the metadata store."""
    store = SqliteMetadataStore(data_dir / "metadata.db")
    try:
        # a durable subscription with one filter the topic layer refuses (as an earlier version
        # saved for `queue.bind` to the exchange `#x`) and one good filter
        store.put_subscription(SubscriptionRecord(
            "grpc-keeps", "exclusive", ["$amqp/#x/#", "planted/good"], True, {}, 1))
        store.put_route(RouteRecord("a/#/b", "default", 0))
        store.put_retained("retained/+/bad", encode_message(Message("retained/+/bad", b"r")))
        store.put_retained("retained/good", encode_message(Message("retained/good", b"good")))
        store.put_delayed("d-garbage", 1, b"\x00not a record")
        store.put_session(SessionRecord("s-garbage", 3600, None, b"{not json"))
        store.put_session(SessionRecord("s-badfilter", 0xFFFFFFFF, None, json.dumps({
            "subscriptions": [["s/#/x", 1, False, False, 0, None], ["s/good", 1, False, False, 0, None]],
            "shared": [], "inflight": []}).encode()))
        # an AMQP queue bound to the exchange `#x` as an earlier version saved it (the filter
        # `$amqp/#x/#`, which the topic layer refuses), in a topology with two bad entries
        store.put_subscription(SubscriptionRecord(
            "amqp:/:legacy-q", "exclusive", ["$amqp/amq.default/legacy-q", "$amqp/#x/#"], True,
            {}, 1))
        topology = json.dumps({
            "exchanges": [{"name": "#x", "type": "fanout"}, "not an exchange"],
            "queues": [{"name": "legacy-q", "bindings": [["#x", "", []], ["no arguments"]]}],
            "exchange_bindings": [],
        }).encode()
        store.put_retained("$internal/amqp/topology/%2F",
                           encode_message(Message("$internal/amqp/topology/%2F", topology)))
        store.sync()
    finally:
        store.close()
    with sqlite3.connect(data_dir / "metadata.db") as db:
        db.execute("INSERT INTO subscriptions VALUES ('unreadable', 'exclusive', '{', 1, '{}', 1)")
        db.execute("INSERT INTO subscriptions VALUES ('amqp:/:odd', 'no-such-type', '[]', 1, '{}', 1)")
        db.execute("INSERT INTO streams VALUES ('odd', 'no-such-mode', 1, NULL, NULL, 'bytes', NULL, 1, NULL, NULL)")


@pytest.mark.timeout(240)
def test_broker_starts_past_records_it_cannot_restore(broker_process, tmp_path: Path) -> None:
    data_dir = tmp_path / "planted"
    broker = serve(broker_process, data_dir)
    assert broker.terminate() == 0
    plant(data_dir)
    broker.start()
    log = broker.log_path.read_text()
    for what in ("'$amqp/#x/#'", "route 'a/#/b'", "retained message of 'retained/+/bad'",
                 "delayed message d-garbage", "persistent session 's-garbage'", "'s/#/x'",
                 "exchange of vhost '/'", "binding of queue 'legacy-q'", "'unreadable'", "'amqp:/:odd'", "'odd', 'no-such-mode'"):
        assert any(what in line and "set aside" in line for line in log.splitlines()), what
    assert "Traceback" not in log
    # everything else came back and the broker serves
    subscriber = Paho(broker.mqtt_port, "s-badfilter", V5, clean=False, session_expiry=3600)
    retained = Paho(broker.mqtt_port, "reader", V5)
    retained.subscribe("retained/#", qos=1)
    assert retained.expect().payload == b"good"
    publisher = Paho(broker.mqtt_port, "writer", V5)
    publisher.publish("s/good", b"to the restored session", qos=1)
    assert subscriber.expect().payload == b"to the restored session"
    connection = amqp(broker.ports["amqp"])
    channel = connection.channel()
    channel.queue_declare("after-planting", durable=True)
    # the legacy queue's binding to `#x` came back, under the escaped filter
    channel.confirm_delivery()
    channel.basic_publish("#x", "", b"to the legacy queue", mandatory=True)
    assert take(channel, "legacy-q", 1) == [("#x", "", b"to the legacy queue")]
    connection.close()
    for client in (subscriber, retained, publisher):
        client.disconnect()
