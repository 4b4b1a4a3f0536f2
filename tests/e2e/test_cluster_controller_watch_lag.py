"""The controller against a real etcd while its watch lags behind its own writes: the
controller's view gets the placement guard's revision (what every placement write compares
on) both from the writes it made and from the watch, which may bring an earlier write's
events after a later write. A pass that read such an older guard is refused, rightly (its
placement is that older one too); the controller must then go on from the guard the watch
has brought since, not from the one that pass read. It used to keep the one the pass read: no
later event ever corrects it (only the controller writes the guard), so every pass after was
refused and the cluster's placement froze, for good: a leader's last in-sync set proposal was
never applied and no new node got a replica (CI: shard `work/2` of a new three-node cluster
kept its in-sync set at `['n1']` and no shard got a replica on `n3`).

Real etcd, the real `ControlStore`, `EtcdClusterView` and `Controller`; the view is fed the
real watch's events, in their order, at the moments the test chooses (a loaded node's watch
delivers them late)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from shardgate.cluster import keys
from shardgate.cluster.control_store import (
    ControlStore,
    PlacementChange,
    PlacementWritten,
    decode_placement,
    encode_placement,
    encode_proposal,
)
from shardgate.cluster.controller import Controller
from shardgate.cluster.etcd import EtcdClient, WatchEvent
from shardgate.cluster.etcd_view import EtcdClusterView
from shardgate.cluster.placement import ShardPlacement
from shardgate.cluster.replica_leader import IsrProposal
from shardgate.cluster.settings import ClusterSettings
from tests.e2e.cluster_fixtures import EtcdServer

PREFIX = "/shardgate/watch-lag/"
SHARDS = 3


@pytest.fixture
async def store(etcd: EtcdServer) -> AsyncIterator[ControlStore]:
    client = EtcdClient([etcd.url], timeout=5.0)
    await client.connect()
    yield ControlStore(client, PREFIX)
    await client.close()


class LaggingWatch:
    """The real watch's events, applied to the view only up to the revision the test says."""

    def __init__(self, store: ControlStore, view: EtcdClusterView, revision: int) -> None:
        self.view = view
        self.events: list[WatchEvent] = []
        self.task = asyncio.get_running_loop().create_task(self._collect(store, revision + 1))

    async def _collect(self, store: ControlStore, revision: int) -> None:
        async for events in store.watch(revision):
            self.events.extend(events)

    async def deliver_until(self, revision: int) -> None:
        """Apply, in order, every event up to `revision` (waiting for the watch to bring them)."""
        deadline = time.monotonic() + 10
        while self.view.revision < revision:
            due = [event for event in self.events
                   if self.view.revision < event.revision <= revision]
            if due:
                self.view.apply(PREFIX, due)
            elif time.monotonic() > deadline:
                raise AssertionError(f"the watch brought nothing up to revision {revision}")
            else:
                await asyncio.sleep(0.01)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class WatchDuringWrite:
    """The store, but with the watch's events up to `revision` arriving while the next
    placement transaction is on its way (as a node's watch task runs during the await)."""

    def __init__(self, store: ControlStore, watch: LaggingWatch) -> None:
        self.store = store
        self.watch = watch
        self.arriving: int | None = None

    async def write_placement(self, change: PlacementChange) -> PlacementWritten:
        if self.arriving is not None:
            await self.watch.deliver_until(self.arriving)
            self.arriving = None
        return await self.store.write_placement(change)


async def guard_revision(store: ControlStore) -> int:
    kv = await store.get(store.key(keys.PLACEMENT_GUARD))
    assert kv is not None
    return kv.mod_revision


async def in_sync(store: ControlStore) -> list[tuple[str, ...]]:
    kv = await store.get(store.key(keys.PLACEMENT + "r"))
    assert kv is not None
    return [placed.isr for placed in decode_placement(kv.value)]


async def test_a_controller_refused_while_its_watch_caught_up_writes_again_from_the_newer_guard(
        store: ControlStore) -> None:
    lease = await store.grant_lease(60)
    for node in ("a", "b"):
        await store.put(keys.NODES + node, keys.NodeRegistration(
            node_id=node, cluster_address="127.0.0.1:1", instance=node, started_ms=1, lease=lease,
            replication=True).to_json(), lease)
    await store.put(keys.STREAMS + "r", keys.encode(
        {"mode": "reliable", "partitions": SHARDS, "replicas": 2}))
    # each shard led by a, b a replica out of sync, as after a start: a proposes b back for each
    await store.put(keys.PLACEMENT + "r", encode_placement(
        [ShardPlacement("a", ("a", "b"), ("a",), 3, 1) for _ in range(SHARDS)]))
    assert await store.campaign("a", lease) is not None
    view = EtcdClusterView("a")
    kvs, revision = await store.read_all()
    view.load(PREFIX, kvs, revision)
    view.lease_valid_until = time.monotonic() + 60
    watch = LaggingWatch(store, view, revision)
    writer = WatchDuringWrite(store, watch)
    controller = Controller(writer, view, "a", ClusterSettings())  # type: ignore[arg-type]
    assert controller.elected

    proposal = encode_proposal(IsrProposal("a", 3, 1, frozenset({"a", "b"})))
    try:
        proposed = [await store.put(f"{keys.ISR_PROPOSALS}r/{shard}", proposal, lease)
                    for shard in range(2)]
        await watch.deliver_until(proposed[0])
        await controller.write_placement()  # shard 0's proposal: the guard's first write
        first = await guard_revision(store)
        assert first > proposed[1] and await in_sync(store) == [("a", "b"), ("a",), ("a",)]
        last_proposal = await store.put(f"{keys.ISR_PROPOSALS}r/2", proposal, lease)
        # shard 1's proposal reaches the view before the watch brings the first write back
        await watch.deliver_until(proposed[1])
        await controller.write_placement()
        second = await guard_revision(store)
        assert second > last_proposal
        assert await in_sync(store) == [("a", "b"), ("a", "b"), ("a",)]
        # now the watch brings the first write (and shard 2's proposal): the view holds the
        # first write's placement and guard again, and the next pass, made from them, is
        # refused while the watch brings the second write
        await watch.deliver_until(last_proposal)
        assert view.guard_revision == first
        writer.arriving = second
        await controller.write_placement()
        assert await guard_revision(store) == second  # refused: nothing written
        assert view.guard_revision == second, (
            f"the view went back to the guard of a refused pass ({view.guard_revision}); etcd's "
            f"is {second}, and no event will say so again")
        # the next passes go on from there: shard 2's proposal is applied
        for _ in range(3):
            await controller.write_placement()
        assert await in_sync(store) == [("a", "b"), ("a", "b"), ("a", "b")]
    finally:
        await watch.close()
