"""Every way a client gets a message onto a topic goes through the publish ACL: a will (checked
at CONNECT, as mosquitto does), a delayed publish (`$delayed/<s>/<topic>` needs the right to
publish to `<topic>`), AMQP dead-lettering and alternate exchanges (issue 26, items 2 and 3).

Users and rules as the README sets them up: a users file and `acl.toml` in the data directory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions
import pytest
from shardgate.protocols.mqtt import packets as p

from shardgate.security.auth import User, hash_password, install_security, save_users
from tests.conftest import ThreadedBroker, free_port, wait_for
from tests.mqtt_clients import V5, V311, Paho, RawClient

USERS = {"mallory": "mallory-pw", "carol": "carol-pw", "watcher": "watcher-pw"}
ACL = """
[[allow]]
user = "mallory"                     # may publish only under public/ and hold delayed messages
actions = ["publish", "subscribe"]
topics = ["public/#", "$delayed/#", "$amqp/#", "amq-topic-ok/#"]

[[deny]]
user = "mallory"
actions = ["publish"]
topics = ["$amqp/locked/#"]

[[allow]]
user = "carol"                       # may also publish what she delays
actions = ["publish", "subscribe"]
topics = ["public/#", "$delayed/#", "secret/#"]

[[allow]]
user = "watcher"
actions = ["publish", "subscribe"]
topics = ["#", "$SYS/#"]
"""


@pytest.fixture
def secured(broker_factory: Callable[..., ThreadedBroker]) -> ThreadedBroker:
    broker = broker_factory(listeners={"amqp_port": free_port()})
    data_dir = broker.config.data_dir
    save_users(data_dir / "users.json", {
        name: User(name, hash_password(password)) for name, password in USERS.items()})
    (data_dir / "acl.toml").write_text(ACL)
    broker.call(lambda: install_security(broker.app))
    return broker


def watch(port: int, topic_filter: str) -> Paho:
    watcher = Paho(port, f"watcher-{topic_filter}", V5, username="watcher", password="watcher-pw")
    watcher.subscribe(topic_filter, qos=1)
    return watcher


def assert_only_marker_arrives(port: int, topic_filter: str, marker_topic: str) -> None:
    """Nothing reached (or is retained on) `topic_filter` before a marker published now: a
    new subscriber gets retained messages first, then the marker."""
    watcher = watch(port, topic_filter)
    try:
        watcher.publish(marker_topic, b"marker", qos=1)
        first = watcher.expect()
        assert (first.topic, first.payload) == (marker_topic, b"marker")
    finally:
        watcher.disconnect()


# ---------------------------------------------------------------------------- item 2: wills
@pytest.mark.parametrize("version", [V5, V311])
@pytest.mark.parametrize("will_topic", ["secret/will", "$SYS/broker/version"])
def test_will_on_a_topic_the_user_may_not_publish_is_refused_at_connect(
        secured: ThreadedBroker, version: int, will_topic: str) -> None:
    client = Paho(secured.mqtt_port, f"will-{version}", version, username="mallory",
                  password="mallory-pw", clean=True, connect=False,
                  will={"topic": will_topic, "payload": b"pwned", "qos": 1, "retain": True})
    _flags, rc, _props = client.connect()
    # MQTT 5: CONNACK 0x87 Not authorized; 3.1.1: return code 5 (paho reports it as 0x87 too)
    assert rc == 0x87 and rc.is_failure
    client.client.loop_stop()
    raw = RawClient(secured.mqtt_port, 4 if version == V311 else 5)
    try:
        raw.send(p.Connect("MQTT", 4 if version == V311 else 5, True, 60, "will-raw", p.Will(
            will_topic, b"pwned", 1, True), "mallory", b"mallory-pw"))
        connack = raw.receive()
        assert isinstance(connack, p.Connack)
        assert connack.reason_code == (5 if version == V311 else 0x87)
        assert raw.receive() is None  # and disconnected
    finally:
        raw.close()
    if will_topic.startswith("secret/"):
        assert_only_marker_arrives(secured.mqtt_port, "secret/#", "secret/marker")
    else:  # the broker's own retained value is there, not the will
        watcher = watch(secured.mqtt_port, will_topic)
        assert watcher.expect().payload.startswith(b"shardgate ")
        watcher.disconnect()


@pytest.mark.parametrize("version", [V5, V311])
def test_will_on_an_allowed_topic_is_still_published(secured: ThreadedBroker, version: int) -> None:
    watcher = watch(secured.mqtt_port, "public/will")
    client = Paho(secured.mqtt_port, f"good-will-{version}", version, username="mallory",
                  password="mallory-pw", will={"topic": "public/will", "payload": b"bye", "qos": 1})
    client.drop()
    message = watcher.expect()
    assert (message.topic, message.payload) == ("public/will", b"bye")
    watcher.disconnect()


# ---------------------------------------------------------------------------- item 3: $delayed
@pytest.mark.parametrize("version", [V5, V311])
def test_delayed_publish_needs_the_right_to_publish_its_release_topic(
        secured: ThreadedBroker, version: int) -> None:
    watcher = watch(secured.mqtt_port, "secret/#")
    mallory = Paho(secured.mqtt_port, f"delay-{version}", version, username="mallory",
                   password="mallory-pw")
    mallory.publish("$delayed/0/secret/x", b"smuggled", qos=1)  # acknowledged, not held
    raw = RawClient(secured.mqtt_port, 5)
    try:
        raw.send(p.Connect("MQTT", 5, True, 60, "delay-raw", None, "mallory", b"mallory-pw"))
        assert raw.receive().reason_code == 0
        raw.send(p.Publish("$delayed/0/secret/y", b"smuggled", qos=1, packet_id=7))
        puback = raw.receive()
        assert isinstance(puback, p.Puback) and puback.reason_code == 0x87
    finally:
        raw.close()
    # carol may publish to secret/#: her delayed message is released there
    carol = Paho(secured.mqtt_port, f"carol-{version}", version, username="carol",
                 password="carol-pw")
    carol.publish("$delayed/0/secret/ok", b"released", qos=1)
    message = watcher.expect()
    assert (message.topic, message.payload) == ("secret/ok", b"released")
    for client in (watcher, mallory, carol):
        client.disconnect()


# ---------------------------------------------------------------------------- item 3: AMQP
def amqp_channel(broker: ThreadedBroker, user: str = "mallory") -> tuple[pika.BlockingConnection, Any]:
    connection = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", broker.app.port("amqp"), credentials=pika.PlainCredentials(user, USERS[user]),
        connection_attempts=1, socket_timeout=30, stack_timeout=30))
    return connection, connection.channel()


@pytest.mark.parametrize(("arguments", "what"), [
    ({"x-dead-letter-exchange": "amq.topic", "x-dead-letter-routing-key": "secret.dlx"}, "queue"),
    ({"x-dead-letter-exchange": "locked"}, "queue"),
    ({"alternate-exchange": "locked"}, "exchange"),
])
def test_declaring_a_dead_letter_or_alternate_exchange_needs_write_access(
        secured: ThreadedBroker, arguments: dict[str, Any], what: str) -> None:
    connection, channel = amqp_channel(secured)
    channel.exchange_declare("locked", "fanout")  # declaring is not writing
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        if what == "queue":
            channel.queue_declare("dl-refused", arguments=arguments)
        else:
            channel.exchange_declare("ae-refused", "direct", arguments=arguments)
    assert refused.value.reply_code == 403
    assert "ACCESS_REFUSED" in refused.value.reply_text
    channel = connection.channel()
    if what == "queue":
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as missing:
            channel.queue_declare("dl-refused", passive=True)
    else:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as missing:
            channel.exchange_declare("ae-refused", passive=True)
    assert missing.value.reply_code == 404  # nothing was declared
    connection.close()


@pytest.mark.parametrize("how", ["ttl", "reject"])
def test_dead_lettering_publishes_only_where_the_declaring_user_may(
        secured: ThreadedBroker, how: str) -> None:
    watcher = watch(secured.mqtt_port, "secret/#")
    allowed = watch(secured.mqtt_port, "amq-topic-ok/#")
    connection, channel = amqp_channel(secured)
    ttl = {"x-message-ttl": 0} if how == "ttl" else {}
    # no dead-letter routing key: the message's own key (the queue's name) decides, so the
    # dead-letter topic is known only when a message dies, and it is checked then
    for queue in ("secret.dl", "amq-topic-ok.dl"):
        channel.queue_declare(queue, arguments={"x-dead-letter-exchange": "amq.topic", **ttl})
        channel.basic_publish("", queue, f"died in {queue}".encode())
        if how == "reject":
            def got(name: str = queue) -> Any:
                return channel.basic_get(name)[0]
            method = wait_for(got, timeout=30)
            channel.basic_reject(method.delivery_tag, requeue=False)
    # allowed: amq-topic-ok/dl receives its dead letter ...
    message = allowed.expect()
    assert (message.topic, message.payload) == ("amq-topic-ok/dl", b"died in amq-topic-ok.dl")
    # ... and nothing reached secret/ before a marker published after both died
    watcher.publish("secret/marker", b"marker", qos=1)
    first = watcher.expect()
    assert (first.topic, first.payload) == ("secret/marker", b"marker")
    connection.close()
    watcher.disconnect()
    allowed.disconnect()


def test_alternate_exchange_routes_only_where_the_publisher_may(secured: ThreadedBroker) -> None:
    watcher = watch(secured.mqtt_port, "secret/#")
    allowed = watch(secured.mqtt_port, "amq-topic-ok/#")
    connection, channel = amqp_channel(secured)
    channel.exchange_declare("with-ae", "direct", arguments={"alternate-exchange": "amq.topic"})
    channel.confirm_delivery()
    channel.basic_publish("with-ae", "secret.ae", b"smuggled")
    channel.basic_publish("with-ae", "amq-topic-ok.ae", b"through the alternate")
    message = allowed.expect()
    assert (message.topic, message.payload) == ("amq-topic-ok/ae", b"through the alternate")
    watcher.publish("secret/marker", b"marker", qos=1)
    first = watcher.expect()
    assert (first.topic, first.payload) == ("secret/marker", b"marker")
    connection.close()
    watcher.disconnect()
    allowed.disconnect()
