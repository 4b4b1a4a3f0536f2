"""The controller's replication decisions written in a real etcd: cluster nodes in process
(`ClusterNode`: registration, watch, controller) on a real etcd, without the data plane.

Replicated shards are placed on every node with leaders spread; a dead leader is replaced by an
in-sync replica in a new epoch in one transaction; with no live in-sync replica the shard stays
unavailable until one is back, in a new epoch; leaders' in-sync set proposals are applied or
refused and deleted; `drain` moves replicas and leadership off a node (a live leader once it
answered the controller's request to quiesce the shard); and when the controller
itself dies another node takes over and goes on.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from shardgate.cluster import keys
from shardgate.cluster.control import ClusterNode
from shardgate.cluster.placement import ShardPlacement
from shardgate.cluster.replica_leader import IsrProposal
from shardgate.cluster.settings import ClusterSettings
from tests.e2e.cluster_fixtures import CLUSTER_SECRET, EtcdServer

TTL_S = 2
STREAM = "orders"


async def start_node(tmp_path: Path, etcd: EtcdServer, node_id: str) -> ClusterNode:
    settings = ClusterSettings(etcd=etcd.url, name="repl", lease_ttl_s=TTL_S, connect_timeout_s=5,
                               secret=CLUSTER_SECRET)
    node = ClusterNode(settings, node_id, tmp_path / node_id)
    node.replication = True
    await node.connect()
    await node.join("127.0.0.1:1", {})
    return node


async def until(condition, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def placement_in_etcd(node: ClusterNode) -> list[ShardPlacement]:
    """What etcd holds (not the node's cached view)."""
    kv = await node.client.get(node.key(keys.PLACEMENT + STREAM))
    assert kv is not None
    return [ShardPlacement.from_json(shard) for shard in keys.decode(kv.value)["shards"]]


async def create_stream(node: ClusterNode, partitions: int, replicas: int = 3) -> None:
    await node.client.put(node.key(keys.STREAMS + STREAM), keys.encode(
        {"mode": "reliable", "partitions": partitions, "replicas": replicas}))


async def kill(node: ClusterNode) -> None:
    """As SIGKILL seen from etcd: the node's lease ends with no leave (its keys go)."""
    await node.stop()


async def test_failover_elects_an_in_sync_replica_in_a_new_epoch_and_a_new_controller_goes_on(
        tmp_path: Path, etcd: EtcdServer) -> None:
    nodes = {name: await start_node(tmp_path, etcd, name) for name in ("a", "b", "c")}
    try:
        any_node = nodes["a"]
        await until(lambda: len(any_node.view.registrations) == 3)
        await create_stream(any_node, 3)
        await until(lambda: len(any_node.view.placement.get(STREAM, [])) == 3)
        shards = await placement_in_etcd(any_node)
        assert sorted(shard.leader for shard in shards) == ["a", "b", "c"]  # leaders spread
        for shard in shards:
            assert set(shard.replicas) == set(shard.isr) == {"a", "b", "c"}
            assert shard.leader_epoch == 1
        # the controller's node dies with the leader of one shard
        controller = any_node.view.controller_id
        assert controller is not None
        victim = nodes.pop(controller)
        led = [index for index, shard in enumerate(shards) if shard.leader == controller]
        killed_at = time.monotonic()
        await kill(victim)
        survivor = next(iter(nodes.values()))

        def failed_over() -> bool:
            placed = survivor.view.placement.get(STREAM, [])
            return bool(placed) and all(placed[i].leader != controller for i in led)

        await until(failed_over, timeout=TTL_S + 10)
        elapsed = time.monotonic() - killed_at
        assert survivor.view.controller_id in nodes  # another node took the controller over
        after = await placement_in_etcd(survivor)
        for index, (before, now) in enumerate(zip(shards, after, strict=True)):
            assert controller not in now.isr and set(now.replicas) == {"a", "b", "c"}
            if index in led:
                assert now.leader in before.isr and now.leader_epoch == before.leader_epoch + 1
            else:  # a live leader keeps its epoch; only its in-sync set lost the dead node
                assert now.leader == before.leader and now.leader_epoch == before.leader_epoch
                assert now.isr_version == before.isr_version + 1
        assert elapsed < TTL_S + 5, f"failover took {elapsed:.1f} s"
    finally:
        for node in nodes.values():
            await node.stop()


async def test_proposals_are_applied_or_refused_and_no_unclean_leader_is_elected(
        tmp_path: Path, etcd: EtcdServer) -> None:
    nodes = {name: await start_node(tmp_path, etcd, name) for name in ("a", "b", "c")}
    try:
        a = nodes["a"]
        await until(lambda: len(a.view.registrations) == 3)
        await create_stream(a, 1)
        await until(lambda: len(a.view.placement.get(STREAM, [])) == 1)
        (shard,) = await placement_in_etcd(a)
        leader = nodes[shard.leader]
        followers = [n for n in nodes if n != shard.leader]
        # a stale proposal (an older in-sync set version) changes nothing, and is deleted
        leader.propose_isr(STREAM, 0, IsrProposal(shard.leader, shard.leader_epoch,
                                                  shard.isr_version + 5, frozenset({shard.leader})))
        await until(lambda: not a.view.proposals and a.view.revision > 0)
        assert await placement_in_etcd(a) == [shard]
        # the leader proposes both followers out: written with the next version
        leader.propose_isr(STREAM, 0, IsrProposal(shard.leader, shard.leader_epoch,
                                                  shard.isr_version, frozenset({shard.leader})))
        await until(lambda: a.view.placement[STREAM][0].isr == (shard.leader,))
        shrunk = (await placement_in_etcd(a))[0]
        assert shrunk.isr_version == shard.isr_version + 1
        assert shrunk.leader_epoch == shard.leader_epoch
        assert await a.client.get_keys(a.key(keys.ISR_PROPOSALS)) == []
        # the only in-sync replica dies: the shard stays unavailable, no follower leads
        await kill(nodes.pop(shard.leader))
        watcher = nodes[followers[0]]
        await until(lambda: shard.leader not in watcher.view.registrations, timeout=TTL_S + 10)
        await until(lambda: watcher.view.controller_id in nodes, timeout=TTL_S + 10)
        await asyncio.sleep(1.5)  # a controller pass or two: nothing may change
        assert await placement_in_etcd(watcher) == [shrunk]
        assert not watcher.view.available(STREAM, 0)
        # it comes back (a new process, a new lease): it leads again, in a new epoch
        nodes[shard.leader] = await start_node(tmp_path, etcd, shard.leader)
        await until(lambda: watcher.view.placement[STREAM][0].leader_epoch
                    == shrunk.leader_epoch + 1)
        back = (await placement_in_etcd(watcher))[0]
        assert back.leader == shard.leader and watcher.view.available(STREAM, 0)
    finally:
        for node in nodes.values():
            await node.stop()


async def test_drain_moves_replicas_and_leadership_off_a_node_once_the_new_replica_caught_up(
        tmp_path: Path, etcd: EtcdServer) -> None:
    nodes = {name: await start_node(tmp_path, etcd, name) for name in ("a", "b", "c")}
    try:
        a = nodes["a"]
        await until(lambda: len(a.view.registrations) == 3)
        await create_stream(a, 1)
        await until(lambda: len(a.view.placement.get(STREAM, [])) == 1)
        (shard,) = await placement_in_etcd(a)
        nodes["d"] = await start_node(tmp_path, etcd, "d")
        await until(lambda: len(a.view.registrations) == 4)
        await a.drain(shard.leader)
        # first a replica on the new node, not in sync: the leader stays
        await until(lambda: "d" in a.view.placement[STREAM][0].replicas)
        added = (await placement_in_etcd(a))[0]
        assert added.leader == shard.leader and "d" not in added.isr
        assert added.leader_epoch == shard.leader_epoch + 1  # the leader learns its new follower
        await asyncio.sleep(1.0)
        assert (await placement_in_etcd(a))[0] == added
        # the leader says it caught up: the controller asks it to quiesce the shard first
        leader = nodes[shard.leader]
        leader.propose_isr(STREAM, 0, IsrProposal(
            shard.leader, added.leader_epoch, added.isr_version, frozenset(added.replicas)))
        request = leader.key(f"{keys.QUIESCE}{STREAM}/0")
        await until(lambda: a.view.quiesce_requests.get((STREAM, 0)) is not None)
        kv = await leader.client.get(request)
        assert kv is not None and kv.lease  # under the controller's lease
        assert keys.decode(kv.value) == {"leader": shard.leader, "epoch": added.leader_epoch}
        assert (await placement_in_etcd(a))[0].leader == shard.leader
        # it answers (as `leader_handoff.LeaderHandoff` does): leadership and the replica
        # leave the drained node, and the request goes
        leader.submit(f"{keys.QUIESCED}{STREAM}/0", keys.encode(
            {"leader": shard.leader, "epoch": added.leader_epoch, "asked": kv.mod_revision,
             "high_watermark": 0, "known": True}), under_lease=True)
        await until(lambda: shard.leader not in a.view.placement[STREAM][0].replicas)
        drained = (await placement_in_etcd(a))[0]
        assert drained.leader != shard.leader and drained.leader_epoch == added.leader_epoch + 1
        assert set(drained.replicas) == set(drained.isr) == {"a", "b", "c", "d"} - {shard.leader}
        await until(lambda: (STREAM, 0) not in a.view.quiesce_requests)
        assert await leader.client.get(request) is None
    finally:
        for node in nodes.values():
            await node.stop()
