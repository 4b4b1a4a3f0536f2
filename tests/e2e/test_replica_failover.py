"""Failover of a replicated shard in `shardgate serve`: three nodes and a real etcd on loopback,
a stream of three replicas placed by the controller, QoS 1 publishers on MQTT.

- SIGKILL of the leader mid-publish: the controller elects an in-sync replica in a higher epoch
  (in etcd and in `cluster status`), publishes through another node are acknowledged again by
  the new leader (the time from the kill to that first acknowledgement is printed; the goal is
  5 s with the default lease of 5 s), and every acknowledged message is in the shard.
- SIGSTOP of the leader past its lease, then SIGCONT: a new leader takes over, and the old one,
  which still runs, acknowledges nothing the new leader does not hold: every message either
  publisher (one on the frozen node itself) saw acknowledged is in the shard afterwards.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    EtcdServer,
    read_back,
    topics_of,
)

STREAM = "safe"
SAFE = f'[[streams]]\nname = "{STREAM}"\nmode = "reliable"\npartitions = 1\nreplicas = 3\n'


def shard(node: ClusterNodeProcess) -> dict[str, Any] | None:
    try:
        return node.status()["replicated_shards"].get(f"{STREAM}/0")
    except OSError:
        return None


def fully_replicated(node: ClusterNodeProcess) -> dict[str, Any] | None:
    placed = shard(node)
    if placed is None or len(placed["replicas"]) != 3 or len(placed["isr"]) != 3:
        return None
    return placed


def epoch_in_etcd(etcd: EtcdServer) -> tuple[str, int]:
    from shardgate.cluster.etcd import EtcdClient

    [key] = [key for key in etcd.keys("/placement/") if key.endswith("/placement/" + STREAM)]

    async def read() -> tuple[str, int]:
        client = EtcdClient([etcd.url])
        try:
            kv = await client.get(key)
            assert kv is not None
            placed = json.loads(kv.value)["shards"][0]
            return placed["leader"], placed["leader_epoch"]
        finally:
            await client.close()

    return asyncio.run(read())


def all_acknowledged_are_stored(node: ClusterNodeProcess, *publishers: ContinuousPublisher) -> None:
    acknowledged = {payload for publisher in publishers for payload in publisher.acknowledged}
    assert acknowledged
    got = asyncio.run(read_back(node.grpc_url, [f"{STREAM}/#"], acknowledged, timeout=60))
    missing = acknowledged - set(got)
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:5]}"


@pytest.mark.timeout(400)
def test_sigkill_of_the_leader_elects_an_in_sync_replica_in_a_higher_epoch_and_loses_nothing(
        cluster: Callable[..., list[ClusterNodeProcess]], etcd: EtcdServer) -> None:
    nodes = {node.node_id: node for node in cluster(3, lease_ttl_s=5, extra_config=SAFE)}
    placed = wait_for(lambda: fully_replicated(nodes["n1"]), timeout=60, interval=0.1)
    leader = nodes[placed["leader"]]
    other = next(node for name, node in nodes.items() if name != leader.node_id)
    topics = topics_of(other.status(), STREAM, f"{STREAM}/k")
    publisher = ContinuousPublisher(other.mqtt_port, "kill-writer", topics)
    wait_for(lambda: publisher.count() >= 100, timeout=60)
    leader.kill()
    killed_at, before = time.monotonic(), publisher.count()
    wait_for(lambda: publisher.count() > before, timeout=60, interval=0.005)
    failover_s = time.monotonic() - killed_at
    print(f"first acknowledgement by the new leader {failover_s:.2f} s after SIGKILL")
    wait_for(lambda: publisher.count() >= before + 100, timeout=60)
    publisher.stop()
    new_leader, epoch = epoch_in_etcd(etcd)
    assert new_leader != leader.node_id and new_leader in placed["isr"]
    assert epoch > placed["leader_epoch"]
    shown = shard(other)
    assert shown is not None and shown["leader"] == new_leader and shown["leader_epoch"] == epoch
    assert leader.node_id not in shown["isr"]
    all_acknowledged_are_stored(other, publisher)
    assert failover_s < 15, f"failover took {failover_s:.1f} s"


@pytest.mark.timeout(400)
def test_a_leader_frozen_past_its_lease_acknowledges_nothing_the_new_leader_lacks(
        cluster: Callable[..., list[ClusterNodeProcess]], etcd: EtcdServer) -> None:
    nodes = {node.node_id: node for node in cluster(3, extra_config=SAFE)}
    placed = wait_for(lambda: fully_replicated(nodes["n1"]), timeout=60, interval=0.1)
    leader = nodes[placed["leader"]]
    other = next(node for name, node in nodes.items() if name != leader.node_id)
    topics = topics_of(other.status(), STREAM, f"{STREAM}/s")
    elsewhere = ContinuousPublisher(other.mqtt_port, "stop-writer", topics)
    on_leader = ContinuousPublisher(leader.mqtt_port, "frozen-writer", topics, ack_timeout_s=60)
    wait_for(lambda: elsewhere.count() >= 50 and on_leader.count() >= 50, timeout=60)
    assert leader.proc is not None
    leader.proc.send_signal(signal.SIGSTOP)
    try:
        def replaced() -> bool:
            now = shard(other)
            return now is not None and now["leader"] != leader.node_id
        wait_for(replaced, timeout=60, interval=0.05)
        before = elsewhere.count()
        wait_for(lambda: elsewhere.count() > before + 20, timeout=60)
    finally:
        leader.proc.send_signal(signal.SIGCONT)
    # the old leader runs again: whatever it acknowledges now must be held by the new leader
    resumed = on_leader.count()
    wait_for(lambda: elsewhere.count() > before + 100, timeout=60)
    new_leader, epoch = epoch_in_etcd(etcd)
    assert new_leader != leader.node_id and epoch > placed["leader_epoch"]
    elsewhere.stop()
    on_leader.stop()
    print(f"frozen node's publisher: {resumed} acknowledged by SIGCONT, "
          f"{on_leader.count()} in the end, {on_leader.refusals()} refused")
    all_acknowledged_are_stored(other, elsewhere, on_leader)
