"""The control plane's etcd store (`cluster/control_store.py`) against a real etcd: each
transaction writes what it is asked only while what it compares on holds, and says so."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from shardgate.cluster import keys
from shardgate.cluster.control_store import (
    MAX_TXN_OPS,
    AnsweredProposal,
    ControlStore,
    PlacementChange,
    decode_placement,
    encode_proposal,
)
from shardgate.cluster.etcd import EtcdClient
from shardgate.cluster.placement import ShardPlacement
from shardgate.cluster.replica_leader import IsrProposal
from tests.e2e.cluster_fixtures import EtcdServer

PREFIX = "/shardgate/store-test/"


@pytest.fixture
async def store(etcd: EtcdServer) -> AsyncIterator[ControlStore]:
    client = EtcdClient([etcd.url], timeout=5.0)
    await client.connect()
    yield ControlStore(client, PREFIX)
    await client.close()


def registration(instance: str) -> keys.NodeRegistration:
    return keys.NodeRegistration(node_id="n1", cluster_address="127.0.0.1:1", instance=instance,
                                 started_ms=1)


def placed(leader: str, epoch: int = 0) -> list[ShardPlacement]:
    return [ShardPlacement(leader, (leader,), (leader,), epoch)]


async def placement_of(store: ControlStore, stream: str) -> list[ShardPlacement] | None:
    kv = await store.get(store.key(keys.PLACEMENT + stream))
    return None if kv is None else decode_placement(kv.value)


async def test_a_node_key_is_created_once_and_taken_over_only_while_unchanged(
        store: ControlStore) -> None:
    first_lease, second_lease = await store.grant_lease(30), await store.grant_lease(30)
    assert await store.register(registration("a"), first_lease) == (True, None)
    created, held = await store.register(registration("b"), second_lease)
    assert not created and held is not None
    assert held.registration.instance == "a" and held.lease == first_lease
    await store.put_registration(registration("a"), first_lease)  # changed since it was read
    assert not await store.take_over_registration(registration("b"), second_lease, held)
    _, held = await store.register(registration("b"), second_lease)
    assert held is not None
    assert await store.take_over_registration(registration("b"), second_lease, held)
    kv = await store.get(store.key(keys.NODES + "n1"))
    assert kv is not None and kv.lease == second_lease
    assert keys.NodeRegistration.from_json(kv.value).instance == "b"


async def test_the_first_campaign_wins_and_the_next_wins_once_the_lease_is_gone(
        store: ControlStore) -> None:
    lease_a, lease_b = await store.grant_lease(30), await store.grant_lease(30)
    elected = await store.campaign("a", lease_a)
    assert elected is not None
    assert await store.campaign("b", lease_b) is None
    await store.revoke_lease(lease_a)  # the controller's node is gone: its key with it
    assert await store.campaign("b", lease_b) is not None


async def test_placement_is_written_only_by_the_elected_controller_from_the_guard_it_saw(
        store: ControlStore) -> None:
    lease = await store.grant_lease(30)
    election = await store.campaign("a", lease)
    assert election is not None
    first = await store.write_placement(PlacementChange("a", election, 0, {"s": placed("a")}))
    assert first.complete and first.guard_revision > 0
    assert await placement_of(store, "s") == placed("a")
    # a write from a view that missed the last one (the guard's old revision) changes nothing
    stale = await store.write_placement(PlacementChange("a", election, 0, {"s": placed("b")}))
    assert not stale.complete and stale.guard_revision == 0
    # nor one by a controller whose election is not the one in etcd
    deposed = await store.write_placement(
        PlacementChange("a", election + 1000, first.guard_revision, {"s": placed("b")}))
    assert not deposed.complete
    assert await placement_of(store, "s") == placed("a")
    removed = await store.write_placement(
        PlacementChange("a", election, first.guard_revision, {"t": placed("a")}, removed=["s"]))
    assert removed.complete and removed.guard_revision > first.guard_revision
    assert await placement_of(store, "s") is None and await placement_of(store, "t") == placed("a")


async def test_a_placement_larger_than_one_transaction_is_written_in_several(
        store: ControlStore) -> None:
    election = await store.campaign("a", await store.grant_lease(30))
    assert election is not None
    streams = {f"s{index:03d}": placed("a", index) for index in range(MAX_TXN_OPS * 2 + 5)}
    written = await store.write_placement(PlacementChange("a", election, 0, streams))
    assert written.complete
    kvs, _ = await store.read_all()
    assert sum(kv.key.startswith(store.key(keys.PLACEMENT)) for kv in kvs) == len(streams)
    guard = await store.get(store.key(keys.PLACEMENT_GUARD))
    assert guard is not None and guard.mod_revision == written.guard_revision


async def test_answered_proposals_are_deleted_with_the_write_unless_made_again_since(
        store: ControlStore) -> None:
    lease = await store.grant_lease(30)
    election = await store.campaign("a", lease)
    assert election is not None
    proposal = encode_proposal(IsrProposal("a", 0, 0, frozenset({"a"})))
    read_0 = await store.put(f"{keys.ISR_PROPOSALS}s/0", proposal, lease)
    read_1 = await store.put(f"{keys.ISR_PROPOSALS}s/1", proposal, lease)
    await store.put(f"{keys.ISR_PROPOSALS}s/1", proposal, lease)  # made again after the read
    answered = [AnsweredProposal("s", 0, read_0), AnsweredProposal("s", 1, read_1)]
    # the second proposal's compare fails, so the whole transaction does
    refused = await store.write_placement(PlacementChange("a", election, 0, {}, answered=answered))
    assert not refused.complete and refused.answered == ()
    written = await store.write_placement(PlacementChange("a", election, 0, {}, answered=answered[:1]))
    assert written.complete and written.answered == tuple(answered[:1])
    assert await store.get(store.key(f"{keys.ISR_PROPOSALS}s/0")) is None
    assert await store.get(store.key(f"{keys.ISR_PROPOSALS}s/1")) is not None


async def test_a_session_claim_compares_on_the_claim_it_knows_and_reads_the_winner(
        store: ControlStore) -> None:
    lease = await store.grant_lease(30)
    mine, theirs = keys.SessionEntry("n1", "alice", True), keys.SessionEntry("n2", "bob", True)
    snapshot = "/shardgate/store-test.state/sessions/c1"
    await store.client.put(snapshot, b"snapshot")
    won = await store.claim_session("c1", mine, lease, known_revision=0, also_read=[snapshot])
    assert won.succeeded and [kv.value for kv in won.reads[0]] == [b"snapshot"]
    lost = await store.claim_session("c1", theirs, lease, known_revision=0)
    assert not lost.succeeded and lost.current is not None
    assert keys.SessionEntry.from_json(lost.current.value) == mine
    assert lost.current.mod_revision == won.revision
    # a vacant claim also compares the snapshot's revision: one written since refuses it
    assert await store.release_session("c1", won.revision + 1000) is None  # not that claim
    assert await store.release_session("c1", won.revision) is not None
    stale_snapshot = await store.claim_session("c1", theirs, lease, known_revision=0,
                                               snapshot=(snapshot, 1))
    assert not stale_snapshot.succeeded and stale_snapshot.current is None
    kv = await store.get(snapshot)
    assert kv is not None
    fresh = await store.claim_session("c1", theirs, lease, known_revision=0,
                                      snapshot=(snapshot, kv.mod_revision))
    assert fresh.succeeded


async def test_a_declared_stream_never_replaces_the_clusters_definition(
        store: ControlStore) -> None:
    assert await store.declare_stream("s", {"partitions": 2})
    assert not await store.declare_stream("s", {"partitions": 8})
    kv = await store.get(store.key(keys.STREAMS + "s"))
    assert kv is not None and keys.decode(kv.value) == {"partitions": 2}
