"""A persistent MQTT session belongs to the user who made it (issue 26, item 4): another user's
CONNECT with its client id is refused (MQTT 5 CONNACK 0x87, 3.1.1 return code 5) and neither
gets the session's messages nor disconnects its owner; with
`mqtt.session_takeover_by_other_user = "new_session"` the newcomer gets a new, empty session.
The owner is part of the stored session: it holds across a restart of `shardgate serve`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from shardgate.protocols.mqtt import packets as p

from shardgate.security.auth import User, hash_password, install_security, save_users
from tests.conftest import ThreadedBroker
from tests.mqtt_clients import V5, V311, Paho, RawClient

USERS = {"alice": "alice-pw", "bob": "bob-pw", "sender": "sender-pw"}


def write_users(data_dir: Path) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    save_users(data_dir / "users.json", {
        name: User(name, hash_password(password)) for name, password in USERS.items()})


def secured(factory: Callable[..., ThreadedBroker], **mqtt: str) -> ThreadedBroker:
    broker = factory(mqtt=mqtt) if mqtt else factory()
    write_users(broker.config.data_dir)
    broker.call(lambda: install_security(broker.app))
    return broker


def login(port: int, user: str, client_id: str, version: int, *, connect: bool = True) -> Paho:
    return Paho(port, client_id, version, clean=False, session_expiry=3600, username=user,
                password=USERS[user], connect=connect)


def leave_a_queued_message(port: int, version: int) -> None:
    alice = login(port, "alice", "alice-phone", version)
    alice.subscribe("inbox/alice", qos=1)
    alice.disconnect()
    sender = Paho(port, "sender", V5, username="sender", password="sender-pw")
    sender.publish("inbox/alice", b"for alice only", qos=1)
    sender.disconnect()


def assert_refused(port: int, user: str, version: int) -> None:
    bob = login(port, user, "alice-phone", version, connect=False)
    flags, rc, _props = bob.connect()
    assert rc == 0x87 and not flags.session_present  # paho reports 3.1.1's 5 as 0x87
    bob.client.loop_stop()
    raw = RawClient(port, 4 if version == V311 else 5)  # the exact code on the wire
    try:
        raw.send(p.Connect("MQTT", 4 if version == V311 else 5, False, 60, "alice-phone", None,
                           user, USERS[user].encode()))
        connack = raw.receive()
        assert isinstance(connack, p.Connack)
        assert connack.reason_code == (5 if version == V311 else 0x87)
        assert not connack.session_present
    finally:
        raw.close()


@pytest.mark.parametrize("version", [V5, V311])
def test_another_users_connect_with_the_client_id_is_refused(
        broker_factory: Callable[..., ThreadedBroker], version: int) -> None:
    broker = secured(broker_factory)
    leave_a_queued_message(broker.mqtt_port, version)
    assert_refused(broker.mqtt_port, "bob", version)
    # the owner resumes her session, with what was queued for her
    alice = login(broker.mqtt_port, "alice", "alice-phone", version, connect=False)
    flags, rc, _props = alice.connect()
    assert rc == 0 and flags.session_present
    assert alice.expect().payload == b"for alice only"
    # while she is connected, bob neither gets in nor takes her connection away
    assert_refused(broker.mqtt_port, "bob", version)
    alice.publish("inbox/alice", b"still connected", qos=1)
    assert alice.expect().payload == b"still connected"
    alice.disconnect()


@pytest.mark.parametrize("version", [V5, V311])
def test_new_session_setting_gives_another_user_an_empty_session(
        broker_factory: Callable[..., ThreadedBroker], version: int) -> None:
    broker = secured(broker_factory, session_takeover_by_other_user="new_session")
    leave_a_queued_message(broker.mqtt_port, version)
    bob = login(broker.mqtt_port, "bob", "alice-phone", version, connect=False)
    flags, rc, _props = bob.connect()
    assert rc == 0 and not flags.session_present
    bob.subscribe("inbox/bob", qos=1)
    bob.publish("inbox/bob", b"marker", qos=1)
    assert bob.expect().payload == b"marker"  # and never alice's message before it
    bob.disconnect()
    # the session is bob's now: alice, the other user this time, gets a new one in turn
    alice = login(broker.mqtt_port, "alice", "alice-phone", version, connect=False)
    flags, rc, _props = alice.connect()
    assert rc == 0 and not flags.session_present
    alice.disconnect()


@pytest.mark.timeout(180)
def test_the_owner_is_kept_across_a_restart(broker_process, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    write_users(data_dir)
    broker = broker_process(data_dir).start()
    leave_a_queued_message(broker.mqtt_port, V5)
    assert broker.terminate() == 0
    broker.start()
    assert_refused(broker.mqtt_port, "bob", V5)
    alice = login(broker.mqtt_port, "alice", "alice-phone", V5, connect=False)
    flags, rc, _props = alice.connect()
    assert rc == 0 and flags.session_present
    assert alice.expect().payload == b"for alice only"
    alice.disconnect()
