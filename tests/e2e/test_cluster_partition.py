"""A replicated shard's leader partitioned from the other nodes by Linux network namespaces
(issue 28, "a network namespace partitions the leader from the others"): three
`shardgate serve` nodes, each in its own namespace with a front link (clients and etcd, which
runs in the root namespace) and a peer link (the node-to-node cluster port), a reliable stream
of one shard with three replicas of which two must be in sync (`netns_fixtures.py`). A QoS 1
MQTT publisher counts every PUBACK; a persistent QoS 1 subscriber sits on a follower.

- The leader cut from its peers only (its peer link down; etcd and its clients still reach
  it): the followers cannot fetch, the leader takes them out of the in-sync set, and from then
  on it acknowledges nothing: every message it acknowledged is in a follower's journal while
  the partition lasts (read from the follower's files); the publish it had appended as the
  in-sync set shrank waits, and new ones are refused. Healed, the followers catch up and are
  in sync again, publishes are acknowledged again, and the subscriber gets every acknowledged
  message.
- The leader cut from everything (both links down): its lease runs out, the controller elects
  an in-sync follower in a newer epoch, and publishes through another node are acknowledged by
  it (the time from the cut is printed); that node holds what it forwarded meanwhile and sends
  it to the new leader, so its publisher sees a pause, never a refusal. Healed, the old leader rejoins as a follower and
  catches up, the three journals end byte-identical (so what the old leader held past the new
  epoch's start was cut), and the subscriber got every acknowledged message at least once.

The tests skip where namespaces cannot be made (not root, no iproute2 `ip`) or etcd is absent.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shardgate.protocols.mqtt import packets as p

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ETCD,
    ClusterNodeProcess,
    ContinuousPublisher,
    EtcdServer,
    linked,
    start_together,
    wait_settled,
)
from tests.e2e.netns_fixtures import PartitionNet, netns_get
from tests.mqtt_clients import V5, Paho, RawClient

STREAM = "part"
TOPIC = f"{STREAM}/a"
STREAMS = (f'[[streams]]\nname = "{STREAM}"\nmode = "reliable"\npartitions = 1\nreplicas = 3\n'
           "min_insync_replicas = 2\n")
# Each node's cluster port, in its own namespace (so the same for all, and always free): its
# advertised address must name it before the node starts.
CLUSTER_PORT = 7001
LEASE_TTL_S = 3


class NamespacedNode(ClusterNodeProcess):
    """A cluster node run in namespace `index` of `net`: client listeners on every address of
    the namespace (the front one is what clients dial), the cluster port advertised on the peer
    address, the admin API on the namespace's loopback (read through `netns_get`)."""

    def __init__(self, net: PartitionNet, index: int, directory: Path, etcd_url: str) -> None:
        self.net = net
        self.index = index
        self.front = net.front_address(index)
        config = (f'advertise_address = "{net.peer_address(index)}:{CLUSTER_PORT}"\n\n'
                  # the clients come from the front bridge, not loopback
                  "[auth]\nallow_anonymous = true\n\n" + STREAMS)
        super().__init__(directory / f"n{index}", f"n{index}", etcd_url, lease_ttl_s=LEASE_TTL_S,
                         extra_config=config,
                         extra_args=["--host", "0.0.0.0", "--cluster-port", str(CLUSTER_PORT)])
        self.command_prefix = tuple(net.command_prefix(index))

    def http_get(self, path: str) -> bytes:
        return netns_get(self.net.netns(self.index), self.ports["http"], path)

    @property
    def grpc_url(self) -> str:
        return f"{self.front}:{self.ports['grpc']}"


@contextlib.contextmanager
def partitionable_cluster(directory: Path, node_class: type[NamespacedNode] = NamespacedNode,
                          ) -> Iterator[dict[str, NamespacedNode]]:
    """Three settled nodes (of `node_class`), each in its own namespace, and etcd on the front
    bridge; the nodes killed, etcd stopped and every namespace, link and bridge deleted at the
    end, whatever happened."""
    if ETCD is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    net = PartitionNet.create(3)
    nodes: list[NamespacedNode] = []
    etcd: EtcdServer | None = None
    try:
        etcd = EtcdServer(directory / "etcd", host=net.front_host).start()
        nodes = [node_class(net, index, directory, etcd.url) for index in (1, 2, 3)]
        start_together(list(nodes))
        wait_settled(list(nodes))
        yield {node.node_id: node for node in nodes}
    finally:
        for node in nodes:
            if node.alive():
                node.kill()
        if etcd is not None:
            etcd.stop()
        net.close()


def shard(node: ClusterNodeProcess) -> dict[str, Any] | None:
    """The stream's shard as `node` shows it (None while it does not answer)."""
    try:
        return node.status()["replicated_shards"].get(f"{STREAM}/0")
    except (OSError, ValueError):
        return None


def fully_in_sync(node: ClusterNodeProcess) -> dict[str, Any] | None:
    placed = shard(node)
    if placed is None or len(placed["replicas"]) != 3 or len(placed["isr"]) != 3:
        return None
    return placed


def journal_payloads(node: ClusterNodeProcess) -> list[bytes]:
    """The payloads in `node`'s journal of the shard, in offset order, read from its segment
    files (`storage/journal/record.py`'s layout): as far as the node has written them."""
    from shardgate.core.records import decode_message
    from shardgate.storage.journal.record import HEADER

    payloads: list[bytes] = []
    for path in sorted((node.data_dir / "journal" / STREAM / "0").glob("*.log")):
        data = path.read_bytes()
        position = 0
        while position + HEADER.size <= len(data):
            length = HEADER.unpack_from(data, position)[0]
            end = position + HEADER.size + length
            if length == 0 or end > len(data):
                break
            with contextlib.suppress(Exception):  # (not a message record)
                payloads.append(decode_message(data[position + HEADER.size:end]).payload)
            position = end
    return payloads


def segments(node: ClusterNodeProcess) -> bytes:
    shard_dir = node.data_dir / "journal" / STREAM / "0"
    return b"".join(path.read_bytes() for path in sorted(shard_dir.glob("*.log")))


def identical(nodes: list[NamespacedNode]) -> bool:
    with contextlib.suppress(OSError):
        first = segments(nodes[0])
        return first != b"" and all(segments(node) == first for node in nodes[1:])
    return False


class Subscriber:
    """A persistent QoS 1 MQTT 5 subscriber to the stream, keeping every payload it got."""

    def __init__(self, node: NamespacedNode, client_id: str) -> None:
        self.client = Paho(node.mqtt_port, client_id, V5, clean=False, session_expiry=600,
                           host=node.front)
        self.client.subscribe(f"{STREAM}/#", qos=1)
        self.got: set[str] = set()

    def received_all(self, wanted: set[str], timeout: float) -> set[str]:
        """What of `wanted` did not come within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not wanted <= self.got and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                self.got.add(self.client.expect(0.5).payload.decode())
        return wanted - self.got

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.disconnect()


@pytest.mark.timeout(300)
def test_a_leader_cut_from_its_peers_acknowledges_nothing_below_min_insync_and_loses_nothing(
        tmp_path: Path) -> None:
    with partitionable_cluster(tmp_path) as nodes:
        placed = wait_for(lambda: fully_in_sync(nodes["n1"]), timeout=60, interval=0.1)
        leader = nodes[placed["leader"]]
        followers = [nodes[name] for name in placed["replicas"] if name != leader.node_id]
        subscriber = Subscriber(followers[0], "part-peers-sub")
        publisher = ContinuousPublisher(leader.mqtt_port, "pp", [TOPIC], host=leader.front,
                                        pause_s=0.005, ack_timeout_s=60)
        try:
            wait_for(lambda: publisher.count() >= 50, timeout=60)
            assert publisher.refusals() == 0

            leader.net.cut_from_peers(leader.index)
            cut_at, acknowledged_at_cut = time.monotonic(), publisher.count()

            def shrunk() -> dict[str, Any] | None:
                now = shard(leader)
                return now if now is not None and now["isr"] == [leader.node_id] else None

            wait_for(shrunk, timeout=90, interval=0.1)
            shrunk_s = time.monotonic() - cut_at
            # the partition is real: the leader's links to its peers are down
            wait_for(lambda: not linked(leader), timeout=30, interval=0.1)
            acknowledged_at_shrink = publisher.count()
            # below min_insync_replicas: new publishes are refused, never acknowledged; the one
            # appended before the shrink waits (it is in the shard: refused, its client would
            # send it again and have it stored twice), so another client asks
            probe = RawClient(leader.mqtt_port, version=5, host=leader.front)
            probe.connect("pp-probe")
            for packet_id in range(1, 21):
                probe.send(p.Publish(TOPIC, f"probe-{packet_id}".encode(), 1, packet_id=packet_id))
                puback = probe.receive(60)
                assert isinstance(puback, p.Puback) and puback.reason_code == 0x80, puback
            probe.close()
            assert publisher.count() == acknowledged_at_shrink, (
                f"{publisher.count() - acknowledged_at_shrink} acknowledged by the leader alone")
            # every acknowledged message is in a follower's journal (no follower can fetch
            # now: their journals stay as they are)
            acknowledged = set(publisher.latest_acknowledged(publisher.count()))
            held = {payload.decode() for follower in followers
                    for payload in journal_payloads(follower)}
            lacking = {payload for payload, _topic in acknowledged} - held
            assert not lacking, f"{len(lacking)} acknowledged, on no follower: {sorted(lacking)[:5]}"
            refused_in_partition = publisher.refusals() + 20
            reasons = {(code, reason) for code, reason, _topic in publisher.refused}
            print(f"in-sync set down to the leader {shrunk_s:.1f} s after the cut; acknowledged "
                  f"{acknowledged_at_shrink - acknowledged_at_cut} after the cut, none after the "
                  f"shrink; refused {refused_in_partition}: {sorted(reasons)}")

            leader.net.heal(leader.index)
            wait_for(lambda: fully_in_sync(leader), timeout=90, interval=0.1)
            healed_at = publisher.count()
            wait_for(lambda: publisher.count() >= healed_at + 50, timeout=60)
            publisher.stop()
            assert not publisher.dropped.is_set()
            everything = set(publisher.acknowledged)
            missing = subscriber.received_all(everything, timeout=90)
            assert not missing, (f"the subscriber lacks {len(missing)} of {len(everything)} "
                                 f"acknowledged, e.g. {sorted(missing)[:5]}")
            wait_for(lambda: identical([leader, *followers]), timeout=60, interval=0.2)
            print(f"{len(everything)} acknowledged, all received; "
                  f"{publisher.refusals()} refused in all")
        finally:
            with contextlib.suppress(AssertionError):
                publisher.stop()
            subscriber.close()


@pytest.mark.timeout(300)
def test_a_leader_cut_from_everything_is_replaced_and_rejoins_as_a_follower(
        tmp_path: Path) -> None:
    with partitionable_cluster(tmp_path) as nodes:
        placed = wait_for(lambda: fully_in_sync(nodes["n1"]), timeout=60, interval=0.1)
        leader = nodes[placed["leader"]]
        writer_node, reader_node = (nodes[name] for name in placed["replicas"]
                                    if name != leader.node_id)
        subscriber = Subscriber(reader_node, "part-all-sub")
        elsewhere = ContinuousPublisher(writer_node.mqtt_port, "pa", [TOPIC],
                                        host=writer_node.front, pause_s=0.005, ack_timeout_s=60)
        on_leader = ContinuousPublisher(leader.mqtt_port, "pl", [TOPIC], host=leader.front,
                                        pause_s=0.005, ack_timeout_s=20)
        publishers = (elsewhere, on_leader)
        marker: RawClient | None = None
        try:
            wait_for(lambda: elsewhere.count() >= 50 and on_leader.count() >= 50, timeout=60)
            controller = leader.status()["controller"]

            # first from its peers only, until it holds a tail nobody can have fetched (a
            # publish it took after the cut), then from everything, long before it could
            # take the followers out of the in-sync set
            leader.net.cut_from_peers(leader.index)
            marker = RawClient(leader.mqtt_port, version=5, host=leader.front)
            marker.connect("part-tail")
            marker.send(p.Publish(TOPIC, b"tail-marker", 1, packet_id=1))
            wait_for(lambda: b"tail-marker" in journal_payloads(leader), timeout=30,
                     interval=0.02)
            tail = shard(leader)
            assert tail is not None and tail["log_end"] > tail["high_watermark"]
            leader.net.cut_from_everything(leader.index)
            cut_at, before = time.monotonic(), elsewhere.count()
            assert len(tail["isr"]) == 3, "the in-sync set shrank before the cut"
            wait_for(lambda: elsewhere.count() > before, timeout=60, interval=0.005)
            failover_s = time.monotonic() - cut_at

            def replaced() -> dict[str, Any] | None:
                now = shard(writer_node)
                return now if (now is not None and now["leader"] != leader.node_id
                               and now["leader_epoch"] > placed["leader_epoch"]) else None

            new = wait_for(replaced, timeout=60, interval=0.1)
            assert new["leader"] in placed["isr"]
            wait_for(lambda: elsewhere.count() >= before + 50, timeout=60)
            new_leader = nodes[new["leader"]]
            # what the old leader holds that the new epoch does not: never acknowledged
            unfetched = set(journal_payloads(leader)) - set(journal_payloads(new_leader))
            print(f"first acknowledgement after the cut {failover_s:.2f} s (lease "
                  f"{LEASE_TTL_S} s, controller {controller}, leader {leader.node_id}); new "
                  f"leader {new['leader']} in epoch {new['leader_epoch']}; "
                  f"the old leader held {len(unfetched)} records beyond it (log end "
                  f"{tail['log_end']}, high watermark {tail['high_watermark']})")
            assert b"tail-marker" in unfetched

            leader.net.heal(leader.index)

            def rejoined() -> dict[str, Any] | None:
                now = fully_in_sync(writer_node)
                return now if (now is not None and now["leader"] != leader.node_id
                               and leader.node_id in now["isr"]) else None

            back = wait_for(rejoined, timeout=90, interval=0.1)
            wait_settled(list(nodes.values()))
            healed_at = elsewhere.count()
            wait_for(lambda: elsewhere.count() >= healed_at + 50, timeout=60)
            for publisher in publishers:
                publisher.stop()
            assert not elsewhere.dropped.is_set()
            everything = {payload for publisher in publishers for payload in publisher.acknowledged}
            wrongly = {payload.decode() for payload in unfetched} & everything
            assert not wrongly, f"acknowledged, yet only on the cut leader: {sorted(wrongly)[:5]}"
            # the old leader cut its tail: the three journals are byte-identical
            wait_for(lambda: identical(list(nodes.values())), timeout=60, interval=0.2)
            assert not unfetched & set(journal_payloads(leader))
            missing = subscriber.received_all(everything, timeout=90)
            assert not missing, (f"the subscriber lacks {len(missing)} of {len(everything)} "
                                 f"acknowledged, e.g. {sorted(missing)[:5]}")
            # the publisher on another node saw a pause, not an error: its node held what it
            # forwarded to the cut leader and sent it to the new one
            assert elsewhere.refusals() == 0, (
                f"{elsewhere.refusals()} refused through {writer_node.node_id}: "
                f"{sorted({(code, reason) for code, reason, _topic in elsewhere.refused})[:3]}")
            print(f"{len(everything)} acknowledged ({on_leader.count()} through the old leader), "
                  f"{on_leader.refusals()} refused through the old leader, none elsewhere, "
                  f"all received; old "
                  f"leader back in sync under {back['leader']} (epoch {back['leader_epoch']}); "
                  f"journals identical ({len(journal_payloads(leader))} records)")
        finally:
            for publisher in publishers:
                with contextlib.suppress(AssertionError):
                    publisher.stop()
            subscriber.close()
            if marker is not None:
                with contextlib.suppress(OSError):
                    marker.close()
