"""Replicated reliable shards in `shardgate serve` (issue 28's data path): three nodes and a
real etcd on loopback, a stream of three replicas whose shard's followers fetch from its
leader over the authenticated cluster port.

What these prove: a QoS 1 publish on one node is acknowledged once the in-sync replicas hold
it, and persistent subscribers on the leader and on a follower get every acknowledged message
in order; the followers' journals end byte-identical to the leader's; with one follower down
the in-sync set shrinks to the minimum and publishes go on, with both down they are refused
with the retryable error (PUBACK 0x80) and never acknowledged, except the one appended as the
set fell below the minimum, which waits (it is in the shard: refused, its client would send it
again and have it stored twice), and once the followers are back and caught up that one and
the next ones are acknowledged; a follower restarted with an empty data directory
re-replicates the whole log; a SIGKILLed leader is replaced from the in-sync set with no
acknowledged message lost, and catches up when it returns (with its data, and empty).

A placement the controller did not make with three replicas (an older controller) is
written in etcd as the controller would (leader, replicas, in-sync set, a new epoch).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from shardgate.client import SyncClient

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, ContinuousPublisher, EtcdServer
from tests.mqtt_clients import Paho, RawClient

STREAM = "orders"


def _placement(node: ClusterNodeProcess) -> dict[str, Any] | None:
    try:
        shards = node.status()["replicas"].get(STREAM)
    except OSError:
        return None
    return shards[0] if shards else None


def _write_placement(etcd: EtcdServer, placement: dict[str, Any]) -> None:
    from shardgate.cluster.etcd import EtcdClient

    [key] = [key for key in etcd.keys("/placement/") if key.endswith("/placement/" + STREAM)]

    async def write() -> None:
        client = EtcdClient([etcd.url])
        try:
            await client.put(key, json.dumps({"shards": [placement]}).encode())
        finally:
            await client.close()

    asyncio.run(write())


def _segments(node: ClusterNodeProcess) -> bytes:
    shard_dir = Path(node.data_dir) / "journal" / STREAM / "0"
    return b"".join(path.read_bytes() for path in sorted(shard_dir.glob("*.log")))


def _replicate(nodes: list[ClusterNodeProcess], etcd: EtcdServer) -> dict[str, Any]:
    with SyncClient(nodes[0].grpc_url) as client:
        client.admin.create_stream(STREAM, mode="reliable", replicas=3, min_insync_replicas=2)
    placed = wait_for(lambda: _placement(nodes[0]), timeout=30, interval=0.1)
    if len(placed["replicas"]) == 3:  # the controller placed the replicas itself
        for node in nodes:
            wait_for(lambda node=node: len((_placement(node) or {}).get("replicas", ())) == 3,
                     timeout=30, interval=0.1)
        return placed
    leader = placed["leader"]
    replicas = [leader] + sorted(n.node_id for n in nodes if n.node_id != leader)
    wanted = {"leader": leader, "replicas": replicas, "isr": replicas,
              "leader_epoch": placed["leader_epoch"] + 1, "isr_version": 0}
    _write_placement(etcd, wanted)
    for node in nodes:
        wait_for(lambda node=node: (_placement(node) or {}).get("replicas") == replicas,
                 timeout=30, interval=0.1)
    return wanted


def _received(subscriber: Paho, count: int, timeout: float = 60) -> list[str]:
    return [message.payload.decode() for message in subscriber.expect_n(count, timeout)]


def _publish(raw: RawClient, payload: str, packet_id: int) -> int:
    """A QoS 1 publish's PUBACK reason code (it may wait while the in-sync set changes)."""
    from shardgate.protocols.mqtt import packets as p

    raw.send(p.Publish(f"{STREAM}/a", payload.encode(), 1, packet_id=packet_id))
    puback = raw.receive(60)
    assert isinstance(puback, p.Puback), puback
    return int(puback.reason_code)


def _until(reader: Paho, last: str, timeout: float = 60) -> list[Any]:
    got = []
    while not got or got[-1].payload.decode() != last:
        got.append(reader.expect(timeout))
    return got


def _replicated(node: ClusterNodeProcess) -> dict[str, Any] | None:
    try:
        return node.status()["replicated_shards"].get(f"{STREAM}/0")
    except OSError:
        return None


def _nodes_seen(node: ClusterNodeProcess) -> set[str]:
    try:
        return {entry["node_id"] for entry in node.status()["nodes"]}
    except OSError:
        return set()


@pytest.mark.timeout(400)
def test_replicated_stream_acknowledges_at_the_in_sync_replicas_and_followers_catch_up(
    cluster: Any, etcd: EtcdServer,
) -> None:
    nodes = cluster(3)
    placed = _replicate(nodes, etcd)
    by_id = {node.node_id: node for node in nodes}
    leader = by_id[placed["leader"]]
    first, second = (by_id[name] for name in placed["replicas"][1:])
    # a QoS 1 publisher on a follower (its publishes are forwarded to the leader), persistent
    # subscribers on that follower (pushed to by the leader) and on the leader
    publisher = Paho(first.mqtt_port, "replica-writer")
    readers = [Paho(node.mqtt_port, f"replica-reader-{node.node_id}", clean=False,
                    session_expiry=600) for node in (first, leader)]
    for reader in readers:
        reader.subscribe(f"{STREAM}/#", qos=1)
    sent = [f"m{i}" for i in range(200)]
    for payload in sent:
        publisher.publish(f"{STREAM}/a", payload, qos=1)  # waits for its PUBACK
    for reader in readers:
        assert _received(reader, len(sent)) == sent
    # the followers' journals end byte-identical to the leader's
    wait_for(lambda: _segments(first) == _segments(second) == _segments(leader) != b"",
             timeout=30, interval=0.2)

    # one follower down: the in-sync set shrinks to two, the minimum, and publishes go on
    publisher.disconnect()
    readers[0].disconnect()
    reader = readers[1]  # on the leader, which stays up
    raw = RawClient(leader.mqtt_port, version=5)
    raw.connect("replica-gate")
    second.kill()
    assert _publish(raw, "one-down", 1) == 0
    # both down: a publish appended as the in-sync set fell below the minimum waits (it is in
    # the shard: refused, its client would have it stored twice); once the set is below it,
    # publishes are refused with the retryable error, never stored nor acknowledged
    from shardgate.protocols.mqtt import packets as p

    first.kill()
    raw.send(p.Publish(f"{STREAM}/a", b"both-down", 1, packet_id=2))
    wait_for(lambda: (_replicated(leader) or {}).get("isr") == [leader.node_id], timeout=60,
             interval=0.1)
    raw.send(p.Publish(f"{STREAM}/a", b"still-down", 1, packet_id=3))
    puback = raw.receive(60)
    assert isinstance(puback, p.Puback) and puback.packet_id == 3, puback
    assert puback.reason_code == 0x80, puback
    first.start()
    second.start()
    # back and caught up, the followers rejoin the in-sync set: the waiting one is
    # acknowledged, and the next ones again
    puback = raw.receive(120)
    assert isinstance(puback, p.Puback) and puback.packet_id == 2, puback
    assert puback.reason_code == 0, puback
    packet_id = 4
    deadline = time.monotonic() + 90
    while _publish(raw, "back", packet_id) != 0:
        assert time.monotonic() < deadline, "never acknowledged again"
        packet_id += 1
        time.sleep(0.2)
    got = [message.payload.decode() for message in _until(reader, "back")]
    assert got[0] == "one-down" and got[-1] == "back"
    assert [message for message in got if message != "back"] == ["one-down", "both-down"]
    raw.close()
    wait_for(lambda: _segments(first) == _segments(second) == _segments(leader), timeout=60,
             interval=0.2)
    publisher = Paho(leader.mqtt_port, "replica-writer-2")
    readers = [reader]

    # a follower restarted with an empty data directory re-replicates the whole log
    second.kill()
    shutil.rmtree(second.data_dir)
    wait_for(lambda: second.node_id not in _nodes_seen(leader), timeout=30, interval=0.2)
    second.start()
    wait_for(lambda: _segments(second) == _segments(leader), timeout=60, interval=0.2)
    after = [f"after{i}" for i in range(20)]
    for payload in after:
        publisher.publish(f"{STREAM}/a", payload, qos=1)
    for reader in readers:
        assert _received(reader, len(after)) == after
    wait_for(lambda: _segments(first) == _segments(second) == _segments(leader), timeout=30,
             interval=0.2)
    publisher.disconnect()
    for reader in readers:
        reader.disconnect()


def _sequence(payload: str) -> int:
    return int(payload.rsplit("-", 1)[1])


@pytest.mark.timeout(500)
def test_a_killed_leader_loses_no_acknowledged_message_and_catches_up_when_restarted(
    cluster: Any, etcd: EtcdServer,
) -> None:
    nodes = cluster(3)
    placed = _replicate(nodes, etcd)
    by_id = {node.node_id: node for node in nodes}
    leader = by_id[placed["leader"]]
    first, second = (node for node in nodes if node is not leader)
    reader = Paho(second.mqtt_port, "failover-reader", clean=False, session_expiry=600)
    reader.subscribe(f"{STREAM}/#", qos=1)
    publisher = ContinuousPublisher(first.mqtt_port, "failover-writer", [f"{STREAM}/a"])
    wait_for(lambda: publisher.count() >= 200, timeout=60, interval=0.05)
    leader.kill()  # SIGKILL mid-stream
    at_kill = publisher.count()
    # the controller elects an in-sync follower; the new leader acknowledges again
    wait_for(lambda: (_placement(first) or {}).get("leader") not in (None, leader.node_id),
             timeout=60, interval=0.1)
    wait_for(lambda: publisher.count() >= at_kill + 200, timeout=60, interval=0.05)
    publisher.stop()
    acknowledged = set(publisher.acknowledged)
    assert not publisher.dropped.is_set()
    # every acknowledged message reaches the persistent subscriber, at least once, in order
    got: list[str] = []
    deadline = time.monotonic() + 90
    while not acknowledged <= set(got):
        assert time.monotonic() < deadline, (
            f"{len(acknowledged - set(got))} acknowledged messages never arrived, e.g. "
            f"{sorted(acknowledged - set(got), key=_sequence)[:5]}")
        got.append(reader.expect(timeout=max(0.1, deadline - time.monotonic())).payload.decode())
    firsts = list(dict.fromkeys(got))
    assert [_sequence(p) for p in firsts] == sorted(_sequence(p) for p in firsts)
    new_leader = by_id[(_placement(first) or {})["leader"]]

    # the killed node, restarted, catches up byte-identical (its unacknowledged tail cut)
    leader.start()
    wait_for(lambda: _segments(leader) == _segments(new_leader), timeout=90, interval=0.2)
    # and, restarted again with an empty data directory, re-replicates the whole log
    leader.kill()
    shutil.rmtree(leader.data_dir)
    wait_for(lambda: leader.node_id not in _nodes_seen(new_leader), timeout=30, interval=0.2)
    leader.start()
    wait_for(lambda: _segments(leader) == _segments(new_leader), timeout=90, interval=0.2)
    reader.disconnect()
