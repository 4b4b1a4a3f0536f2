"""A persistent MQTT session belongs to the user who made it on every node of a cluster, as on
one node (`test_session_owner.py`): another user's CONNECT with its client id on another node,
clean start or not, is refused (MQTT 5 CONNACK 0x87, 3.1.1 return code 5), and neither ends the
owner's session nor disconnects the owner. The registry in etcd (`sessions/<client id>`)
carries the owner with the node; a session whose node is gone is judged by its last snapshot.
Real etcd, two `shardgate serve --cluster` processes, paho and raw clients."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from shardgate.protocols.mqtt import packets as p

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer
from tests.mqtt_clients import V5, V311, Paho, RawClient

Cluster = Callable[..., list[ClusterNodeProcess]]
USERS = {"alice": "alice-pw", "bob": "bob-pw", "sender": "sender-pw"}


def add_users(data_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    for name, password in USERS.items():
        done = subprocess.run(
            [sys.executable, "-m", "shardgate", "users", "add", name, "--password", password,
             "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr


def connack(port: int, user: str, client_id: str, version: int, *, clean: bool) -> p.Connack:
    """The CONNACK a raw client gets (the exact code on the wire), then the client closes."""
    level = 4 if version == V311 else 5
    raw = RawClient(port, level)
    try:
        properties = p.Properties(session_expiry_interval=3600) if level == 5 and not clean else None
        raw.send(p.Connect("MQTT", level, clean, 60, client_id, None, user, USERS[user].encode(),
                           properties=properties or p.Properties()))
        answer = raw.receive()
        assert isinstance(answer, p.Connack), answer
        return answer
    finally:
        raw.close()


def assert_refused(port: int, client_id: str, version: int) -> None:
    for clean in (True, False):
        answer = connack(port, "bob", client_id, version, clean=clean)
        assert answer.reason_code == (5 if version == V311 else 0x87), (clean, answer)
        assert not answer.session_present


def login(port: int, user: str, client_id: str, version: int) -> Paho:
    return Paho(port, client_id, version, clean=False, session_expiry=3600, username=user,
                password=USERS[user], connect=False)


def test_another_users_connect_on_another_node_neither_gets_nor_ends_the_session(
        cluster: Cluster) -> None:
    n1, n2 = cluster(2)
    add_users(n1.data_dir)
    for node in (n1, n2):  # the users reach both nodes through etcd
        wait_for(lambda node=node: connack(node.mqtt_port, "bob", "probe", V5, clean=True).reason_code == 0,
                 timeout=30, interval=0.1)
    for version in (V5, V311):
        client_id = f"alice-phone-{version}"
        topic = f"inbox/alice/{version}"
        alice = login(n1.mqtt_port, "alice", client_id, version)
        assert alice.connect()[1] == 0
        alice.subscribe(topic, qos=1)
        alice.disconnect()
        sender = Paho(n1.mqtt_port, f"sender-{version}", V5, username="sender", password="sender-pw")
        sender.publish(topic, b"for alice only", qos=1)
        # bob on the other node, clean start or not: refused, and alice's session stays on n1
        assert_refused(n2.mqtt_port, client_id, version)
        alice = login(n1.mqtt_port, "alice", client_id, version)
        flags, rc, _props = alice.connect()
        assert rc == 0 and flags.session_present
        assert alice.expect().payload == b"for alice only"
        # while she is connected on n1, bob on n2 neither gets in nor takes her connection
        assert_refused(n2.mqtt_port, client_id, version)
        sender.publish(topic, b"still connected", qos=1)
        assert alice.expect().payload == b"still connected"
        assert alice.disconnects.empty()
        # alice herself takes her session to n2: that works across nodes as before
        alice_on_n2 = login(n2.mqtt_port, "alice", client_id, version)
        flags, rc, _props = alice_on_n2.connect()
        assert rc == 0 and flags.session_present
        wait_for(lambda alice=alice: not alice.disconnects.empty(), timeout=10)
        sender.publish(topic, b"on n2", qos=1)
        assert alice_on_n2.expect().payload == b"on n2"
        # and bob is refused on n1 now, where the session was
        assert_refused(n1.mqtt_port, client_id, version)
        alice_on_n2.disconnect()
        sender.disconnect()


def test_a_session_whose_node_died_stays_its_owners(cluster: Cluster, etcd: EtcdServer) -> None:
    """The registry entry goes with its node's lease: the session's last snapshot in etcd
    says whose it is, and another user's clean start on a live node does not void it."""
    n1, n2 = cluster(2)
    add_users(n1.data_dir)
    for node in (n1, n2):
        wait_for(lambda node=node: connack(node.mqtt_port, "bob", "probe", V5, clean=True).reason_code == 0,
                 timeout=30, interval=0.1)
    alice = login(n2.mqtt_port, "alice", "alice-laptop", V5)
    assert alice.connect()[1] == 0
    alice.subscribe("inbox/laptop", qos=1)
    alice.disconnect()
    wait_for(lambda: etcd.keys(".state/sessions/alice-laptop"), timeout=30, interval=0.1)
    n2.kill()
    # its registry entry went with its lease; the snapshot stays
    wait_for(lambda: not [key for key in etcd.keys("/sessions/alice-laptop") if ".state/" not in key],
             timeout=30, interval=0.1)
    assert_refused(n1.mqtt_port, "alice-laptop", V5)
    alice = login(n1.mqtt_port, "alice", "alice-laptop", V5)
    flags, rc, _props = alice.connect()
    assert rc == 0 and flags.session_present
    alice.disconnect()
