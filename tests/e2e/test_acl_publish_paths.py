"""Every way a client gets a message onto a topic goes through the publish ACL: a will (checked
at CONNECT, as mosquitto does), a delayed publish (`$delayed/<s>/<topic>` needs the right to
publish to `<topic>`), AMQP dead-lettering and alternate exchanges (issue 26, items 2 and 3).

Users and rules as the README sets them up: a users file and `acl.toml` in the data directory.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from shardgate.protocols.mqtt import packets as p

from shardgate.security.auth import User, hash_password, install_security, save_users
from tests.conftest import ThreadedBroker
from tests.mqtt_clients import V5, V311, Paho, RawClient

USERS = {"mallory": "mallory-pw", "carol": "carol-pw", "watcher": "watcher-pw"}
ACL = """
[[allow]]
user = "mallory"                     # may publish only under public/ and hold delayed messages
actions = ["publish", "subscribe"]
topics = ["public/#", "$delayed/#", "$amqp/#", "amq-topic-ok/#"]

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
    broker = broker_factory()
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
