"""A SIGKILLed leader is failed over as soon as its peers find its cluster port refusing
connections, not when its lease runs out: with a 30 s lease, publishes through another node
are acknowledged by the new leader within seconds, and nothing acknowledged is lost. (A frozen
leader's kernel still accepts connections: it is failed over by its lease alone, as
`test_replica_failover.py` shows.) Three nodes and a real etcd on loopback."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    EtcdServer,
    topics_of,
)
from tests.e2e.test_replica_failover import (
    SAFE,
    STREAM,
    all_acknowledged_are_stored,
    epoch_in_etcd,
    fully_replicated,
)


@pytest.mark.timeout(400)
def test_a_killed_leader_is_failed_over_long_before_its_lease_runs_out(
        cluster: Callable[..., list[ClusterNodeProcess]], etcd: EtcdServer) -> None:
    nodes = {node.node_id: node for node in cluster(3, lease_ttl_s=30, extra_config=SAFE)}
    placed = wait_for(lambda: fully_replicated(nodes["n1"]), timeout=60, interval=0.1)
    leader = nodes[placed["leader"]]
    other = next(node for name, node in nodes.items() if name != leader.node_id)
    topics = topics_of(other.status(), STREAM, f"{STREAM}/d")
    publisher = ContinuousPublisher(other.mqtt_port, "dead-writer", topics, ack_timeout_s=60)
    wait_for(lambda: publisher.count() >= 100, timeout=60)
    leader.kill()
    killed_at, before = time.monotonic(), publisher.count()
    wait_for(lambda: publisher.count() > before, timeout=60, interval=0.005)
    failover_s = time.monotonic() - killed_at
    print(f"first acknowledgement by the new leader {failover_s:.2f} s after SIGKILL (lease 30 s)")
    wait_for(lambda: publisher.count() >= before + 100, timeout=60)
    publisher.stop()
    new_leader, epoch = epoch_in_etcd(etcd)
    assert new_leader != leader.node_id and epoch > placed["leader_epoch"]
    assert leader.node_id not in {node["node_id"] for node in other.status()["nodes"]}
    all_acknowledged_are_stored(other, publisher)
    assert failover_s < 15, f"failover took {failover_s:.1f} s with a 30 s lease"
