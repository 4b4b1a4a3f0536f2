"""Users and ACL rules in a cluster: a user added with `shardgate users add` on one node's
data directory is allowed, with the right password only, on every node."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

from shardgate.protocols.mqtt import packets as p

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess
from tests.mqtt_clients import RawClient

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
