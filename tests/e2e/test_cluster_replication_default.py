"""Replication by default in a cluster (issue 28): a reliable stream created with no replica
settings gets `[cluster] default_replicas` replicas per shard (here set to 3, which is
also the built-in default, see docs/OPERATIONS.md), capped by the live nodes, and
`default_min_insync_replicas` (2), capped by the replicas the shard has. Real
`shardgate serve` nodes and a real etcd on loopback, MQTT clients and the gRPC SDK.

- Three nodes: the stream's shard has three replicas, all in sync; SIGKILL of its leader
  mid-publish: another node leads it, the first acknowledgement by the new leader comes
  within the failover time, and every acknowledged message is in the shard exactly once, in
  publish order (the publisher never retries: each payload is published once).
- One node, then two: alone, the shard has one replica (nothing replicated, publishes
  acknowledged at once); a second node joins and the shard grows to two replicas, both in
  sync; with one of the two dead, fewer than two are in sync and a publish is refused with the
  retryable PUBACK 0x80, never acknowledged (Kafka's replication factor 2 with
  `min.insync.replicas` 2); the one appended as the set fell below the minimum waits; once
  the node is back and caught up, it and the next ones are acknowledged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from shardgate.client import SyncClient

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    EtcdServer,
    linked,
    read_back,
    settled,
    topics_of,
)
from tests.mqtt_clients import RawClient

STREAM = "plain"
DEFAULTS = "default_replicas = 3\ndefault_min_insync_replicas = 2\n"


@pytest.fixture
def cluster(tmp_path: Path, etcd: EtcdServer) -> Iterator[Callable[..., list[ClusterNodeProcess]]]:
    """Nodes n<first>.. with the issue's cluster defaults (three replicas, two in sync)."""
    started: list[ClusterNodeProcess] = []

    def start(count: int, *, first: int = 1) -> list[ClusterNodeProcess]:
        nodes = []
        for index in range(first, first + count):
            node = ClusterNodeProcess(tmp_path / f"n{index}", f"n{index}", etcd.url)
            assert node.config_file is not None
            text = node.config_file.read_text()
            node.config_file.write_text(text.replace("[cluster]\n", "[cluster]\n" + DEFAULTS, 1))
            started.append(node)
            nodes.append(node.start())
        everyone = {n.node_id for n in started if n.alive()}
        for node in nodes:
            wait_for(lambda node=node: settled(node, everyone), timeout=30, interval=0.05)
        for node in (n for n in started if n.alive()):
            wait_for(lambda node=node: linked(node) >= everyone - {node.node_id},
                     timeout=30, interval=0.05)
        return nodes

    yield start
    for node in started:
        if node.alive():
            node.kill()


def shard(node: ClusterNodeProcess) -> dict[str, Any] | None:
    """The stream's shard 0 as `cluster status` shows a replicated shard; None when it is not
    replicated (one replica) or the node does not answer."""
    try:
        return node.status()["replicated_shards"].get(f"{STREAM}/0")
    except OSError:
        return None


def replicated_on(node: ClusterNodeProcess, count: int) -> dict[str, Any] | None:
    placed = shard(node)
    if placed is None or len(placed["replicas"]) != count or len(placed["isr"]) != count:
        return None
    return placed


def create_without_replica_settings(node: ClusterNodeProcess) -> None:
    with SyncClient(node.grpc_url) as client:
        client.admin.create_stream(STREAM, mode="reliable", partitions=1)
        info = client.admin.describe_stream(STREAM)
    assert (info.replicas, info.min_insync_replicas) == (None, None)  # the cluster's defaults


def _sequence(payload: str) -> int:
    return int(payload.rsplit("-", 1)[1])


@pytest.mark.timeout(400)
def test_a_stream_with_no_replica_settings_survives_the_sigkill_of_its_leader(
        cluster: Callable[..., list[ClusterNodeProcess]], etcd: EtcdServer) -> None:
    nodes = {node.node_id: node for node in cluster(3)}
    create_without_replica_settings(nodes["n1"])
    # three replicas by default, all in sync, as every node sees it
    placed = wait_for(lambda: replicated_on(nodes["n1"], 3), timeout=60, interval=0.1)
    assert placed["wanted_replicas"] == 3
    for node in nodes.values():
        wait_for(lambda node=node: replicated_on(node, 3), timeout=60, interval=0.1)
    leader = nodes[placed["leader"]]
    other = next(node for name, node in nodes.items() if name != leader.node_id)
    topics = topics_of(other.status(), STREAM, f"{STREAM}/k")
    publisher = ContinuousPublisher(other.mqtt_port, "default-writer", topics)
    wait_for(lambda: publisher.count() >= 100, timeout=60)
    leader.kill()  # SIGKILL mid-stream
    killed_at, before = time.monotonic(), publisher.count()
    # the second acknowledgement after the kill is of a publish sent after it (one in flight
    # at a time): the new leader's
    wait_for(lambda: publisher.count() >= before + 2, timeout=60, interval=0.005)
    failover_s = time.monotonic() - killed_at
    print(f"first acknowledgement by the new leader {failover_s:.2f} s after SIGKILL "
          f"(lease {3} s)")
    wait_for(lambda: publisher.count() >= before + 100, timeout=60)
    publisher.stop()
    assert not publisher.dropped.is_set()
    now = shard(other)
    assert now is not None and now["leader"] not in (None, leader.node_id)
    assert now["leader"] in placed["isr"] and now["leader_epoch"] > placed["leader_epoch"]
    # every acknowledged message is read exactly once, in publish order
    acknowledged = set(publisher.acknowledged)
    got = asyncio.run(read_back(other.grpc_url, [f"{STREAM}/#"], acknowledged, timeout=90))
    missing = acknowledged - set(got)
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:5]}"
    twice = {payload: count for payload, count in got.items() if count > 1}
    assert not twice, f"read more than once: {sorted(twice.items())[:5]}"
    order = [_sequence(payload) for payload in got if payload in acknowledged]
    assert order == sorted(order)
    # the failover time: the lease (3 s) for the controller to see the leader dead, its pass,
    # the new leader's first commit, with room for a loaded machine
    assert failover_s < 15, f"failover took {failover_s:.1f} s"


def _publish(raw: RawClient, payload: str, packet_id: int) -> int:
    """A QoS 1 publish's PUBACK reason code (it may wait while the in-sync set changes)."""
    from shardgate.protocols.mqtt import packets as p

    raw.send(p.Publish(f"{STREAM}/a", payload.encode(), 1, packet_id=packet_id))
    puback = raw.receive(60)
    assert isinstance(puback, p.Puback), puback
    return int(puback.reason_code)


@pytest.mark.timeout(400)
def test_one_node_keeps_one_copy_and_two_nodes_need_both_in_sync(
        cluster: Callable[..., list[ClusterNodeProcess]], etcd: EtcdServer) -> None:
    [first] = cluster(1)
    create_without_replica_settings(first)
    wait_for(lambda: STREAM in first.status()["placement"], timeout=30, interval=0.05)
    raw = RawClient(first.mqtt_port, version=5)
    raw.connect("default-gate")
    # alone: one replica, nothing replicated, acknowledged at once
    assert _publish(raw, "alone", 1) == 0
    assert shard(first) is None
    assert first.status()["replicated_shards"] == {}
    # a second node joins: the shard grows to two replicas, both in sync
    [second] = cluster(1, first=2)
    placed = wait_for(lambda: replicated_on(first, 2), timeout=90, interval=0.1)
    assert placed["leader"] == first.node_id and placed["wanted_replicas"] == 3
    assert _publish(raw, "both", 2) == 0
    # one of two dead: fewer in sync than the minimum (2): refused, retryable, never stored nor
    # acknowledged; the publish appended as the set fell below it waits (it is in the shard)
    from shardgate.protocols.mqtt import packets as p

    second.kill()
    raw.send(p.Publish(f"{STREAM}/a", b"one-dead", 1, packet_id=3))
    wait_for(lambda: (shard(first) or {}).get("isr") == [first.node_id], timeout=60,
             interval=0.1)
    raw.send(p.Publish(f"{STREAM}/a", b"still-dead", 1, packet_id=4))
    puback = raw.receive(60)
    assert isinstance(puback, p.Puback) and puback.packet_id == 4, puback
    assert puback.reason_code == 0x80, puback
    # back and caught up: the waiting one is acknowledged, and the next ones again
    second.start()
    puback = raw.receive(120)
    assert isinstance(puback, p.Puback) and puback.packet_id == 3, puback
    assert puback.reason_code == 0, puback
    packet_id = 5
    deadline = time.monotonic() + 90
    while _publish(raw, "back", packet_id) != 0:
        assert time.monotonic() < deadline, "never acknowledged again"
        packet_id += 1
        time.sleep(0.2)
    raw.close()
    got = asyncio.run(read_back(first.grpc_url, [f"{STREAM}/#"],
                                {"alone", "both", "one-dead", "back"}, timeout=60))
    assert got["alone"] == got["both"] == got["one-dead"] == 1 and got["back"] >= 1
    assert set(got) == {"alone", "both", "one-dead", "back"}
