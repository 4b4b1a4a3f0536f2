"""Users and ACL rules in a cluster: a user added with `shardgate users add` on one node's
data directory is allowed, with the right password only, on every node; a node that starts
while the cluster has users refuses wrong credentials on every protocol from its first
connection on (it reads them from etcd before it listens), as a single broker does."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from shardgate.protocols.mqtt import packets as p

from shardgate.cluster.control import ClusterNode
from shardgate.cluster.settings import ClusterSettings
from shardgate.cluster.shared_files import SharedFiles
from tests.conftest import BrokerProcess, free_port, wait_for
from tests.e2e.auth_probes import (
    ACCEPTED,
    REFUSED,
    Prober,
    amqp_attempt,
    grpc_attempt,
    mqtt_attempt,
)
from tests.e2e.cluster_fixtures import CLUSTER_SECRET, ClusterNodeProcess, EtcdServer
from tests.mqtt_clients import RawClient

# These tests knock with wrong passwords from 127.0.0.1 on every protocol while a node starts.
# They are about refusing wrong credentials, not about the login guard (test_login_flood.py):
# their nodes turn its delay off, which would otherwise slow each next check of 127.0.0.1 up
# to 5 s (the two tests took 107-171 s each in a parallel run).
NO_LOGIN_DELAY = "[auth]\nlogin_delay_s = 0\nlogin_max_delay_s = 0\n"

Cluster = Callable[..., list[ClusterNodeProcess]]


def connect(port: int, username: str | None, password: bytes | None) -> int:
    raw = RawClient(port, 5)
    try:
        raw.send(p.Connect("MQTT", 5, True, 60, "auth-probe", None, username, password))
        connack = raw.receive()
        assert isinstance(connack, p.Connack), connack
        return connack.reason_code
    finally:
        raw.close()


def test_a_user_added_on_node_2_is_allowed_and_checked_on_node_1(cluster: Cluster) -> None:
    n1, n2 = cluster(2)
    assert connect(n1.mqtt_port, None, None) == 0  # no user yet: anonymous on loopback
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    added = subprocess.run(
        [sys.executable, "-m", "shardgate", "users", "add", "alice", "--password", "s3cret",
         "--data-dir", str(n2.data_dir)], capture_output=True, text=True, timeout=60, env=env)
    assert added.returncode == 0, added.stderr
    # node 1 learns of alice through etcd: her password works there, a wrong one does not,
    # and anonymous access ends as it does on a single node once a user exists
    wait_for(lambda: connect(n1.mqtt_port, "alice", b"wrong") == p.ReasonCode.BAD_USER_NAME_OR_PASSWORD,
             timeout=20)
    assert connect(n1.mqtt_port, "alice", b"s3cret") == 0
    assert connect(n1.mqtt_port, None, None) == p.ReasonCode.NOT_AUTHORIZED
    assert connect(n2.mqtt_port, "alice", b"s3cret") == 0


def users_command(data_dir: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    done = subprocess.run(
        [sys.executable, "-m", "shardgate", "users", *args, "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr


def knock_while_starting(node: BrokerProcess, ports: dict[str, int]) -> None:
    """Start `node` while every protocol's client connects in a loop with a wrong password (and
    MQTT also anonymously); none may ever be let in. Each must be refused by the protocol a few
    times once the node is up, so the loops did reach it."""
    probes = [
        Prober("mqtt", lambda: mqtt_attempt(ports["mqtt"], "alice", "wrong")),
        Prober("mqtt-anonymous", lambda: mqtt_attempt(ports["mqtt"], None, None)),
        Prober("mqtt-ws", lambda: mqtt_attempt(ports["mqtt-ws"], "alice", "wrong", "websockets")),
        Prober("amqp", lambda: amqp_attempt(ports["amqp"], "alice", "wrong")),
        Prober("grpc", lambda: grpc_attempt(ports["grpc"], "alice", "wrong")),
    ]
    for probe in probes:
        probe.start()
    try:
        node.start(ports["mqtt"])
        assert {name: node.ports[name] for name in ports} == ports
        for probe in probes:
            probe.mark_ready()
        wait_for(lambda: all(probe.refused_after_ready >= 3 or probe.errors for probe in probes),
                 timeout=120, interval=0.05)
    finally:
        for probe in probes:
            probe.stop()
    for probe in probes:
        assert not probe.errors, (probe.name, probe.errors)
        assert probe.outcomes[ACCEPTED] == 0, (probe.name, probe.outcomes)
        assert probe.outcomes[REFUSED] >= 3, (probe.name, probe.outcomes)
    # the right password is let in: the refusals were about the credentials
    assert mqtt_attempt(ports["mqtt"], "alice", "s3cret") == ACCEPTED
    assert grpc_attempt(ports["grpc"], "alice", "s3cret") == ACCEPTED
    assert amqp_attempt(ports["amqp"], "alice", "s3cret") == ACCEPTED


def listener_ports() -> tuple[dict[str, int], list[str]]:
    ports = {name: free_port() for name in ("mqtt", "mqtt-ws", "amqp", "grpc")}
    return ports, ["--mqtt-ws-port", str(ports["mqtt-ws"]), "--amqp-port", str(ports["amqp"]),
                   "--grpc-port", str(ports["grpc"])]


def test_a_node_started_into_a_cluster_with_users_refuses_wrong_credentials_from_the_start(
        cluster: Cluster, etcd: EtcdServer, tmp_path: Path) -> None:
    (n1,) = cluster(1)
    users_command(n1.data_dir, "add", "alice", "--password", "s3cret")
    users_command(n1.data_dir, "add", "bob", "--password", "hunter2")
    wait_for(lambda: etcd.keys("auth/users"), timeout=20)
    ports, args = listener_ports()
    n2 = ClusterNodeProcess(tmp_path / "n2", "n2", etcd.url, extra_args=args,
                            extra_config=NO_LOGIN_DELAY)
    try:
        knock_while_starting(n2, ports)
        # a user removed on node 1 is refused on node 2 once etcd carried the change (bob
        # stays: with no user left a broker is open, as a single one is)
        users_command(n1.data_dir, "remove", "alice")
        wait_for(lambda: mqtt_attempt(ports["mqtt"], "alice", "s3cret") == REFUSED, timeout=20)
        assert mqtt_attempt(ports["mqtt"], "bob", "hunter2") == ACCEPTED
    finally:
        n2.kill()


def test_a_single_broker_with_users_refuses_wrong_credentials_from_the_start(tmp_path: Path) -> None:
    data_dir = tmp_path / "single"
    users_command(data_dir, "add", "alice", "--password", "s3cret")
    ports, args = listener_ports()
    config = tmp_path / "single.toml"
    config.write_text(NO_LOGIN_DELAY)
    broker = BrokerProcess(data_dir, args, config_file=config)
    try:
        knock_while_starting(broker, ports)
    finally:
        broker.kill()


async def test_users_changed_between_reading_the_catalog_and_joining_reach_the_node(
        tmp_path: Path, etcd: EtcdServer) -> None:
    """A node reads the users from etcd before it listens and starts watching only once it has
    joined (after its listeners are up): a change another node makes in between is applied at
    join, not left until the next change."""
    settings = ClusterSettings(etcd=etcd.url, name="gap", lease_ttl_s=3, connect_timeout_s=5,
                               secret=CLUSTER_SECRET)
    node = ClusterNode(settings, "n1", tmp_path / "n1")
    await node.connect()
    users_file = tmp_path / "n1" / "users.json"
    try:
        await node.read_catalog()
        shared = SharedFiles(node, {"users": users_file})
        await shared.start()  # nothing in etcd yet, nor here
        assert not users_file.exists()
        added = b'{"alice": {"password": "scrypt$...", "roles": []}}'
        await node.client.put(node.key("auth/users"), added)  # on another node, meanwhile
        await node.join("127.0.0.1:1", {})
        assert users_file.read_bytes() == added
        await shared.stop()
    finally:
        await node.stop()
