"""Authentication and ACLs over MQTT 5.0 and 3.1.1 with real clients against a real broker.

Each test writes the users (and ACL) files into the broker's data directory, then installs the
security model on the broker's loop with `install_security(broker.app)`.
"""

from __future__ import annotations

import queue
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from shardgate.protocols.mqtt import packets as p

from shardgate.security.auth import Security, User, hash_password, install_security, save_users
from tests.conftest import ThreadedBroker
from tests.mqtt_clients import V5, V311, Paho, RawClient

ACL = """
[[allow]]
actions = ["publish", "subscribe"]
topics = ["devices/%u/#", "clients/%c/#"]

[[allow]]
client = "monitor"
actions = "subscribe"
topics = ["devices/#", "clients/#"]
"""


def secure(broker: ThreadedBroker, users: dict[str, str] | None = None, acl: str | None = None) -> Security:
    data_dir = broker.config.data_dir
    if users is not None:
        save_users(data_dir / "users.json", {
            name: User(name, hash_password(password)) for name, password in users.items()
        })
    if acl is not None:
        (data_dir / "acl.toml").write_text(acl)
    return broker.call(lambda: install_security(broker.app))


@pytest.fixture
def secured(broker_factory: Callable[..., ThreadedBroker]) -> ThreadedBroker:
    broker = broker_factory()
    secure(broker, {"alice": "alice-pw", "bob": "bob-pw"}, ACL)
    return broker


def raw_connect(port: int, version: int, username: str | None, password: bytes | None,
                client_id: str = "raw") -> p.Connack:
    raw = RawClient(port, version)
    try:
        raw.send(p.Connect("MQTT", version, True, 60, client_id, None, username, password))
        connack = raw.receive()
        assert isinstance(connack, p.Connack), connack
        if connack.reason_code:
            assert raw.receive() is None, "a refused client must be disconnected"
        return connack
    finally:
        raw.close()


# ---------------------------------------------------------------------------- authentication
def test_right_password_connects_on_both_versions(secured: ThreadedBroker) -> None:
    for version in (V5, V311):
        client = Paho(secured.mqtt_port, "alice-1", version, username="alice", password="alice-pw",
                      connect=False)
        _, rc, _ = client.connect()
        assert rc == 0
        client.disconnect()
    assert raw_connect(secured.mqtt_port, 5, "bob", b"bob-pw").reason_code == 0


def test_wrong_password_is_refused_with_bad_credentials(secured: ThreadedBroker) -> None:
    assert raw_connect(secured.mqtt_port, 5, "alice", b"nope").reason_code == \
        p.ReasonCode.BAD_USER_NAME_OR_PASSWORD == 0x86
    assert raw_connect(secured.mqtt_port, 4, "alice", b"nope").reason_code == \
        p.ConnackCode311.BAD_USERNAME_OR_PASSWORD == 4
    client = Paho(secured.mqtt_port, "alice-2", V5, username="alice", password="bob-pw",
                  connect=False)
    _, rc, _ = client.connect()
    assert rc.value == 0x86
    client.client.loop_stop()
    assert secured.app.security.denials[("mqtt", "connect")] == 3


def test_unknown_user_is_refused_with_bad_credentials(secured: ThreadedBroker) -> None:
    assert raw_connect(secured.mqtt_port, 5, "mallory", b"alice-pw").reason_code == 0x86
    assert raw_connect(secured.mqtt_port, 4, "mallory", b"alice-pw").reason_code == 4


def test_anonymous_refused_once_users_exist(secured: ThreadedBroker) -> None:
    assert raw_connect(secured.mqtt_port, 5, None, None).reason_code == p.ReasonCode.NOT_AUTHORIZED
    assert raw_connect(secured.mqtt_port, 4, None, None).reason_code == p.ConnackCode311.NOT_AUTHORIZED


def test_anonymous_allowed_in_loopback_default_without_users(broker: ThreadedBroker) -> None:
    security = secure(broker)
    assert security.allow_anonymous
    assert raw_connect(broker.mqtt_port, 5, None, None).reason_code == 0
    assert raw_connect(broker.mqtt_port, 4, None, None).reason_code == 0


def test_mqtt_allow_anonymous_false_refuses_anonymous_mqtt_clients_of_an_open_broker(
    broker_factory: Callable[..., ThreadedBroker],
) -> None:
    broker = broker_factory(mqtt={"allow_anonymous": False})
    assert broker.app.security.allow_anonymous  # the policy of the other protocols: open
    assert raw_connect(broker.mqtt_port, 5, None, None).reason_code == p.ReasonCode.NOT_AUTHORIZED
    assert raw_connect(broker.mqtt_port, 4, None, None).reason_code == p.ConnackCode311.NOT_AUTHORIZED
    assert raw_connect(broker.mqtt_port, 5, "anyone", b"any").reason_code == 0


def test_anonymous_refused_on_a_non_loopback_listener(broker: ThreadedBroker) -> None:
    # The policy reads `listeners.host`; the socket itself stays on loopback for the test.
    broker.app.config.listeners.host = "0.0.0.0"
    security = secure(broker)
    assert not security.allow_anonymous
    assert raw_connect(broker.mqtt_port, 5, None, None).reason_code == p.ReasonCode.NOT_AUTHORIZED
    assert raw_connect(broker.mqtt_port, 4, None, None).reason_code == p.ConnackCode311.NOT_AUTHORIZED


def test_user_added_with_the_cli_can_connect_to_a_running_broker(secured: ThreadedBroker) -> None:
    assert raw_connect(secured.mqtt_port, 5, "carol", b"carol-pw").reason_code == 0x86
    result = subprocess.run(
        [sys.executable, "-m", "shardgate.security.users_cli", "users", "add", "carol",
         "--data-dir", str(secured.config.data_dir)],
        input="carol-pw\n", capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert "carol-pw" not in result.stdout
    client = Paho(secured.mqtt_port, "carol-1", V311, username="carol", password="carol-pw")
    client.publish("devices/carol/temp", b"21", qos=1)
    client.disconnect()
    result = subprocess.run(
        [sys.executable, "-m", "shardgate.security.users_cli", "users", "remove", "carol",
         "--data-dir", str(secured.config.data_dir)], capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert raw_connect(secured.mqtt_port, 5, "carol", b"carol-pw").reason_code == 0x86


# ---------------------------------------------------------------------------- authorization
def monitor(broker: ThreadedBroker) -> Paho:
    """A client allowed (by client id) to watch everything under devices/ and clients/."""
    client = Paho(broker.mqtt_port, "monitor", V5, username="alice", password="alice-pw")
    assert [code.value for code in client.subscribe("devices/#", qos=1)] == [1]
    assert [code.value for code in client.subscribe("clients/#", qos=1)] == [1]
    return client


def test_denied_publish_gets_puback_0x87_and_is_not_delivered_v5(secured: ThreadedBroker) -> None:
    watcher = monitor(secured)
    bob = Paho(secured.mqtt_port, "bob-1", V5, username="bob", password="bob-pw")
    acks: queue.Queue[tuple[int, int]] = queue.Queue()
    bob.client.on_publish = lambda c, u, mid, rc, props: acks.put((mid, rc.value))
    denied = bob.publish("devices/alice/temp", b"forged", qos=1)
    assert acks.get(timeout=5) == (denied.mid, 0x87)
    allowed = bob.publish("devices/bob/temp", b"mine", qos=1)
    assert acks.get(timeout=5) == (allowed.mid, 0)
    message = watcher.expect()
    assert (message.topic, message.payload) == ("devices/bob/temp", b"mine")
    watcher.expect_none()
    assert secured.app.security.denials[("mqtt", "publish")] == 1


def test_denied_publish_is_dropped_on_311(secured: ThreadedBroker) -> None:
    watcher = monitor(secured)
    bob = Paho(secured.mqtt_port, "bob-2", V311, username="bob", password="bob-pw")
    bob.publish("devices/alice/temp", b"forged", qos=1)  # acknowledged, then dropped
    bob.publish("devices/bob/temp", b"mine", qos=1)
    assert watcher.expect().payload == b"mine"
    watcher.expect_none()


def test_denied_subscribe_gets_0x87_on_v5_and_0x80_on_311(secured: ThreadedBroker) -> None:
    bob5 = Paho(secured.mqtt_port, "bob-5", V5, username="bob", password="bob-pw")
    codes = bob5.subscribe([("devices/alice/#", 1), ("devices/bob/#", 1)])
    assert [code.value for code in codes] == [0x87, 1]
    bob4 = Paho(secured.mqtt_port, "bob-4", V311, username="bob", password="bob-pw")
    codes = bob4.subscribe([("devices/#", 1), ("devices/bob/+", 1)])
    assert [getattr(code, "value", code) for code in codes] == [0x80, 1]
    assert secured.app.security.denials[("mqtt", "subscribe")] == 2


def test_user_and_client_id_substitution(secured: ThreadedBroker) -> None:
    watcher = monitor(secured)
    alice = Paho(secured.mqtt_port, "sensor-42", V5, username="alice", password="alice-pw")
    acks: queue.Queue[int] = queue.Queue()
    alice.client.on_publish = lambda c, u, mid, rc, props: acks.put(rc.value)
    alice.publish("clients/sensor-42/status", b"up", qos=1)       # %c
    alice.publish("devices/alice/temp", b"20", qos=1)             # %u
    alice.publish("clients/sensor-43/status", b"forged", qos=1)   # someone else's client id
    assert [acks.get(timeout=5) for _ in range(3)] == [0, 0, 0x87]
    received = [(m.topic, m.payload) for m in watcher.expect_n(2)]
    assert received == [("clients/sensor-42/status", b"up"), ("devices/alice/temp", b"20")]
    watcher.expect_none()
    codes = alice.subscribe([("clients/sensor-42/#", 1), ("clients/+/status", 1)])
    assert [code.value for code in codes] == [1, 0x87]


def test_anonymous_clients_get_no_user_substitution(broker: ThreadedBroker) -> None:
    broker.config.data_dir.mkdir(parents=True, exist_ok=True)
    secure(broker, None, ACL)
    anonymous = Paho(broker.mqtt_port, "anon-1", V5)
    codes: list[Any] = anonymous.subscribe([("devices/None/#", 1), ("clients/anon-1/#", 1)])
    assert [code.value for code in codes] == [0x87, 1]


# alice's grant on devices/alice/# is gone; a client "feeder" may publish under devices/
NARROWER_ACL = ACL.replace('"devices/%u/#", "clients/%c/#"', '"clients/%c/#"') + """
[[allow]]
client = "feeder"
actions = "publish"
topics = ["devices/#"]
"""


def test_security_installed_again_decides_for_clients_already_connected(secured: ThreadedBroker) -> None:
    """`install_security` on a running broker replaces the whole model at once: an MQTT client
    connected under the old one is decided by the new one at its next publish and subscribe,
    and a subscription the new rules no longer allow is removed."""
    watcher = monitor(secured)
    alice = Paho(secured.mqtt_port, "alice-1", V5, username="alice", password="alice-pw")
    acks: queue.Queue[int] = queue.Queue()
    alice.client.on_publish = lambda c, u, mid, rc, props: acks.put(rc.value)
    assert [code.value for code in alice.subscribe("devices/alice/#", qos=1)] == [1]
    alice.publish("devices/alice/temp", b"20", qos=1)
    assert acks.get(timeout=5) == 0
    assert alice.expect().payload == b"20" and watcher.expect().payload == b"20"
    previous = secured.app.security
    installed = secure(secured, None, NARROWER_ACL)
    assert installed is not previous and secured.app.edge.security.policy is installed
    alice.publish("devices/alice/temp", b"21", qos=1)  # the topic allowed a moment ago
    assert acks.get(timeout=5) == 0x87
    assert [code.value for code in alice.subscribe("devices/alice/#", qos=1)] == [0x87]
    assert installed.denials[("mqtt", "publish")] == 1
    # the subscription alice made under the old rules is gone: the feeder's message there
    # reaches the monitor only
    feeder = Paho(secured.mqtt_port, "feeder", V5, username="bob", password="bob-pw")
    feeder.publish("devices/alice/temp", b"22", qos=1)
    assert watcher.expect().payload == b"22"
    alice.expect_none(1.0)
    for client in (feeder, alice, watcher):
        client.disconnect()
