"""Three nodes' `ReplicaManager`s in one process, each with its own journal, following one
placement (a `StaticClusterView` per node over shared assignments) and reaching each other's
leaders by direct calls: roles follow the placement, publishes are acknowledged by the
in-sync set, a failover to another in-sync replica with a new epoch keeps every acknowledged
message, and the old leader comes back as a follower with the same log as the new leader."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from shardgate.core.errors import ShardUnavailable
from shardgate.storage.interfaces import StorageUnavailable, StoredRecord
from shardgate.storage.journal import JournalStorage

from shardgate.cluster.membership import ShardAssignment, StaticClusterView
from shardgate.cluster.replica_control import ReplicaSet, apply_proposal, elect, rejoined
from shardgate.cluster.replica_epochs import (
    EpochEndAnswer,
    EpochEndRequest,
    FetchRequest,
    FetchResponse,
    Refused,
    ReplicaError,
)
from shardgate.cluster.replica_leader import IsrProposal
from shardgate.cluster.replica_manager import ReplicaManager

NODES = ("a", "b", "c")
KEY = ("s", 0)


class Cluster:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.assignments: dict[tuple[str, int], ShardAssignment] = {}
        self.views: dict[str, StaticClusterView] = {}
        self.journals: dict[str, JournalStorage] = {}
        self.managers: dict[str, ReplicaManager] = {}
        self.down: set[str] = set()
        self.proposals: list[IsrProposal] = []
        self.fetching = 0
        self.refusals: list[tuple[str, ReplicaError]] = []
        # fetches that get no answer, as if the link dropped them: (follower, leader, request)
        self.lost: Callable[[str, FetchRequest], bool] = lambda _leader, _request: False

    def start(self, node: str) -> ReplicaManager:
        self.down.discard(node)
        self.views[node] = StaticClusterView(node, assignments=self.assignments)
        self.journals[node] = JournalStorage(self.tmp_path / node)
        manager = ReplicaManager(
            node, self.views[node], self.journals[node], lambda _s, _i: Transport(self),
            min_insync=lambda _s: 2,
            lag_time_max_s=0.5, tick_s=0.05, proposal_timeout_s=0.5,
            propose=lambda _stream, _shard, proposal: self.proposals.append(proposal))
        manager.start()
        manager.watch(*KEY)
        self.managers[node] = manager
        return manager

    async def stop(self, node: str) -> None:
        """The node's process ends (what its journal wrote stays on its disk)."""
        self.down.add(node)
        manager = self.managers.pop(node)
        await manager.close()
        self.journals.pop(node).close()

    def place(self, leader: str, epoch: int, isr: Sequence[str]) -> None:
        self.assignments[KEY] = ShardAssignment("s", 0, leader, epoch, NODES, tuple(isr))
        for node, view in self.views.items():
            if node not in self.down:
                view.changed()

    def publish(self, node: str, payload: bytes) -> asyncio.Future[None] | None:
        shard_log = self.managers[node].shard_log(*KEY)
        shard_log.append([(int(time.time() * 1000), payload)])
        return shard_log.commit_waiter()

    def records(self, node: str) -> list[bytes]:
        return [r.data for r in self.journals[node].open_shard(*KEY).read(0, 10_000)]


class Transport:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def _leading(self, leader: str):  # type: ignore[no-untyped-def]
        if leader in self.cluster.down or leader not in self.cluster.managers:
            raise ConnectionError(f"{leader} is down")
        return self.cluster.managers[leader].leading(*KEY)

    async def epoch_end(self, leader: str, request: EpochEndRequest) -> EpochEndAnswer | Refused:
        shard_log = self._leading(leader)
        return Refused(ReplicaError.NOT_LEADER) if shard_log is None else shard_log.serve_epoch_end(request)

    async def fetch(self, leader: str, request: FetchRequest
                    ) -> tuple[FetchResponse, Sequence[StoredRecord]] | Refused:
        shard_log = self._leading(leader)
        if shard_log is None:
            return Refused(ReplicaError.NOT_LEADER)
        if self.cluster.lost(leader, request):
            raise ConnectionError(f"the fetch from {leader} was lost")
        self.cluster.fetching += 1
        try:
            answer = await shard_log.fetch(request, max_wait_s=0.05)
        finally:
            self.cluster.fetching -= 1
        if isinstance(answer, Refused):
            self.cluster.refusals.append((request.replica, answer.error))
        return answer


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    made = Cluster(tmp_path)
    yield made
    for node in list(made.managers):
        await made.stop(node)


async def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_roles_follow_the_placement_and_publishes_are_acknowledged_by_the_in_sync_set(
    cluster: Cluster,
) -> None:
    for node in NODES:
        cluster.start(node)
    cluster.place("a", 1, NODES)
    await wait_for(lambda: cluster.managers["a"].leading(*KEY) is not None)
    futures = [cluster.publish("a", f"m{i}".encode()) for i in range(50)]
    await asyncio.wait_for(asyncio.gather(*[f for f in futures if f is not None]), 15)
    for node in NODES:
        await wait_for(lambda node=node: len(cluster.records(node)) == 50)  # type: ignore[misc]
    assert cluster.records("b") == cluster.records("a") == [f"m{i}".encode() for i in range(50)]
    assert cluster.managers["b"].leading(*KEY) is None


async def test_a_dead_follower_is_proposed_out_of_the_in_sync_set(cluster: Cluster) -> None:
    for node in NODES:
        cluster.start(node)
    cluster.place("a", 1, NODES)
    await wait_for(lambda: cluster.managers["a"].leading(*KEY) is not None)
    await cluster.stop("c")
    future = cluster.publish("a", b"m0")
    await wait_for(lambda: any(p.isr == {"a", "b"} for p in cluster.proposals))
    assert future is not None and not future.done()  # c counts until the controller writes it
    cluster.place("a", 1, ("a", "b"))  # the controller wrote the proposal
    await asyncio.wait_for(future, 15)


async def test_a_leader_whose_journal_fails_a_write_gives_the_shard_up_to_an_in_sync_replica(
    cluster: Cluster,
) -> None:
    for node in NODES:
        cluster.start(node)
    cluster.place("a", 1, NODES)
    await wait_for(lambda: cluster.managers["a"].leading(*KEY) is not None)
    stored = cluster.publish("a", b"stored")
    assert stored is not None
    await asyncio.wait_for(stored, 15)
    journal_log = cluster.managers["a"].shard_log(*KEY).log
    journal_log._io_write = lambda *_args, **_kw: (_ for _ in ()).throw(  # type: ignore[method-assign]
        OSError(28, "No space left on device"))  # a's disk is full
    failed = cluster.publish("a", b"not stored")
    assert failed is not None
    with pytest.raises(ShardUnavailable):
        await asyncio.wait_for(failed, 15)
    # a resigned and asks the controller to move the shard, without it in the in-sync set
    await wait_for(lambda: any(p.gives_up for p in cluster.proposals))
    proposal = next(p for p in cluster.proposals if p.gives_up)
    assert proposal == IsrProposal("a", 1, 0, frozenset({"b", "c"}), gives_up=True)
    assert cluster.managers["a"].leading(*KEY) is None
    record = apply_proposal(ReplicaSet("a", NODES, frozenset(NODES), 1), proposal, set(NODES))
    assert record is not None and record.leader == "b" and record.epoch == 2
    cluster.place("b", 2, ("b", "c"))  # the controller wrote it
    await wait_for(lambda: cluster.managers["b"].leading(*KEY) is not None)
    moved = cluster.publish("b", b"after")
    assert moved is not None
    await asyncio.wait_for(moved, 15)
    # the refused record may be kept (a sent it to its followers before its own write, as a
    # Kafka leader does): a retry would be a duplicate, never a loss
    assert cluster.records("b") in ([b"stored", b"after"], [b"stored", b"not stored", b"after"])


async def test_failover_keeps_every_acknowledged_message_and_the_old_leader_rejoins_as_follower(
    cluster: Cluster,
) -> None:
    for node in NODES:
        cluster.start(node)
    cluster.place("a", 1, NODES)
    await wait_for(lambda: cluster.managers["a"].leading(*KEY) is not None)
    acknowledged = [cluster.publish("a", f"ack{i}".encode()) for i in range(20)]
    await asyncio.wait_for(asyncio.gather(*[f for f in acknowledged if f is not None]), 15)
    # a is cut off from b and c (they see it down), and takes more publishes alone
    cluster.down.add("a")
    await wait_for(lambda: cluster.fetching == 0)  # fetches already under way are answered
    unacknowledged = [cluster.publish("a", f"lost{i}".encode()) for i in range(5)]
    await cluster.journals["a"].open_shard(*KEY).flush()
    await cluster.stop("a")
    for future in unacknowledged:
        assert future is not None
        with pytest.raises(ShardUnavailable):
            await asyncio.wait_for(future, 15)
    # the controller elects b from the in-sync set, with epoch 2
    cluster.place("b", 2, ("b", "c"))
    await wait_for(lambda: cluster.managers["b"].leading(*KEY) is not None)
    after = [cluster.publish("b", f"after{i}".encode()) for i in range(10)]
    await asyncio.wait_for(asyncio.gather(*[f for f in after if f is not None]), 15)
    expected = [f"ack{i}".encode() for i in range(20)] + [f"after{i}".encode() for i in range(10)]
    assert cluster.records("b") == expected
    # a restarts: its journal still ends with the 5 records nobody acknowledged
    cluster.start("a")
    assert cluster.records("a")[-1] == b"lost4"
    cluster.place("b", 2, ("b", "c"))
    await wait_for(lambda: cluster.records("a") == expected)
    await wait_for(lambda: any(p.isr == {"a", "b", "c"} for p in cluster.proposals))
    epochs = cluster.journals["a"].open_shard(*KEY).leader_epochs.entries
    assert epochs == cluster.journals["b"].open_shard(*KEY).leader_epochs.entries
    assert [entry.epoch for entry in epochs] == [1, 2]


@pytest.mark.parametrize("seed", range(10))
async def test_a_random_run_of_stops_restarts_and_elections_keeps_every_acknowledged_message(
    cluster: Cluster, seed: int,
) -> None:
    """A controller (the pure decisions of `replica_control`) elects from the in-sync set as
    nodes stop and start, and writes the leaders' proposals; publishes go to whoever leads.
    At the end every acknowledged message is in every replica's journal, once, and the
    journals are the same."""
    rng = random.Random(seed)
    record = ReplicaSet("a", NODES, frozenset(NODES), 1)
    outcomes: dict[bytes, asyncio.Future[None] | None] = {}

    def write(new: ReplicaSet) -> None:
        nonlocal record
        record = new
        if new.leader is not None:
            cluster.place(new.leader, new.epoch, sorted(new.isr))

    for node in NODES:
        cluster.start(node)
    write(record)
    for step in range(60):
        live = set(cluster.managers)
        roll = rng.random()
        if roll < 0.5 and record.leader in live:
            manager = cluster.managers[record.leader]
            if manager.leading(*KEY) is not None:
                payload = f"m{step}".encode()
                try:
                    outcomes[payload] = cluster.publish(record.leader, payload)
                except StorageUnavailable:
                    pass  # refused: below the in-sync minimum, or not leading yet
        elif roll < 0.65 and len(live) == len(NODES):
            victim = rng.choice(NODES)
            await cluster.stop(victim)
            write(elect(record, set(cluster.managers)))
        elif roll < 0.8:
            for node in NODES:
                if node not in cluster.managers:
                    cluster.start(node)
                    write(elect(rejoined(record, node), set(cluster.managers)))
                    break
        while cluster.proposals:  # the controller writes what the leader proposed
            proposal = cluster.proposals.pop(0)
            based = replace(record, isr_version=proposal.isr_version)  # no version in placement
            new = apply_proposal(based, proposal, set(cluster.managers))
            if new is not None:
                write(replace(new, isr_version=record.isr_version + 1))
        await asyncio.sleep(rng.uniform(0.0, 0.05))
    for node in NODES:  # heal
        if node not in cluster.managers:
            cluster.start(node)
            write(elect(rejoined(record, node), set(cluster.managers)))
    assert record.leader is not None
    leader = record.leader
    await wait_for(lambda: cluster.managers[leader].leading(*KEY) is not None)

    def settled() -> bool:
        while cluster.proposals:
            proposal = cluster.proposals.pop(0)
            new = apply_proposal(replace(record, isr_version=proposal.isr_version), proposal,
                                 set(cluster.managers))
            if new is not None:
                write(replace(new, isr_version=record.isr_version + 1))
        logs = [cluster.records(node) for node in NODES]
        return record.isr == set(NODES) and logs[0] == logs[1] == logs[2]

    try:
        await wait_for(settled, timeout=30)
    except AssertionError:
        raise AssertionError(f"not settled: {record}, ends "
                             f"{ {n: len(cluster.records(n)) for n in NODES} }, roles "
                             f"{ {n: cluster.managers[n].role(*KEY) for n in NODES} }") from None
    final = cluster.records(leader)
    acknowledged = [payload for payload, future in outcomes.items()
                    if future is None or (future.done() and not future.cancelled()
                                          and future.exception() is None)]
    assert acknowledged, "the run acknowledged nothing"
    for payload in acknowledged:
        assert final.count(payload) == 1, f"acknowledged {payload!r} lost or doubled"


def place_replicas(cluster: Cluster, leader: str, epoch: int, replicas: Sequence[str],
                   isr: Sequence[str], adding: Sequence[str] = ()) -> None:
    """The controller writes `replicas` (not all three nodes: a drain, a grow, a shrink)."""
    cluster.assignments[KEY] = ShardAssignment("s", 0, leader, epoch, tuple(replicas), tuple(isr),
                                               adding=tuple(adding))
    for node, view in cluster.views.items():
        if node not in cluster.down:
            view.changed()


async def test_a_leader_given_new_replicas_keeps_leading_and_acknowledges_what_waited(
    cluster: Cluster,
) -> None:
    """The controller drops a dead replica (the leader's replicas change, so its epoch too):
    the publish that waited for that replica is acknowledged in the new epoch, not refused
    (its record is in the leader's log and stays there), and a publish right after the change
    is taken (no moment without a leader)."""
    for node in NODES:
        cluster.start(node)
    cluster.place("a", 1, NODES)
    await wait_for(lambda: cluster.managers["a"].leading(*KEY) is not None)
    await cluster.stop("c")
    waiting = cluster.publish("a", b"m0")
    assert waiting is not None
    await asyncio.sleep(0.1)
    assert not waiting.done()  # c is still in the in-sync set
    place_replicas(cluster, "a", 2, ("a", "b"), ("a", "b"))
    after = cluster.publish("a", b"m1")  # raises NotLeader when the leader stepped down
    await asyncio.wait_for(waiting, 15)
    assert after is not None
    await asyncio.wait_for(after, 15)
    await wait_for(lambda: cluster.records("b") == [b"m0", b"m1"])


async def test_a_leader_whose_follower_saw_its_new_epoch_first_acknowledges_what_waited(
    cluster: Cluster,
) -> None:
    """The controller drops a dead replica, and the remaining follower learns the new epoch
    before the leader does (etcd watches are not in step across nodes): its fetch names an
    epoch the leader has not seen. That is not a newer leader elsewhere (a follower fetches
    from the leader its view names), so the publish that waited is not refused: the leader
    carries it over once its own view shows the epoch, and it is acknowledged there."""
    for node in NODES:
        cluster.start(node)
    cluster.place("a", 1, NODES)
    await wait_for(lambda: cluster.managers["a"].leading(*KEY) is not None)
    await cluster.stop("c")
    waiting = cluster.publish("a", b"m0")
    assert waiting is not None
    cluster.assignments[KEY] = ShardAssignment("s", 0, "a", 2, ("a", "b"), ("a", "b"))
    cluster.views["b"].changed()  # only b has seen epoch 2 yet
    await wait_for(lambda: ("b", ReplicaError.UNKNOWN_LEADER_EPOCH) in cluster.refusals)
    assert not waiting.done()
    leading = cluster.managers["a"].leading(*KEY)
    assert leading is not None and leading.leader is not None and not leading.leader.fenced
    cluster.views["a"].changed()
    await asyncio.wait_for(waiting, 15)
    after = cluster.publish("a", b"m1")
    assert after is not None
    await asyncio.wait_for(after, 15)
    await wait_for(lambda: cluster.records("b") == [b"m0", b"m1"])


async def test_a_leader_left_alone_acknowledges_what_waited_once_its_journal_has_it(
    cluster: Cluster,
) -> None:
    """The controller leaves the leader as the shard's only replica (the others drained
    away): the publish that waited for them is acknowledged once durable here, not refused,
    and the shard is no longer replicated here."""
    for node in NODES:
        cluster.start(node)
    cluster.place("a", 1, NODES)
    await wait_for(lambda: cluster.managers["a"].leading(*KEY) is not None)
    await cluster.stop("b")
    await cluster.stop("c")
    waiting = cluster.publish("a", b"m0")
    assert waiting is not None
    await asyncio.sleep(0.1)
    assert not waiting.done()
    place_replicas(cluster, "a", 2, ("a",), ("a",))
    await asyncio.wait_for(waiting, 15)
    manager = cluster.managers["a"]
    assert not manager.replicated(*KEY)
    assert cluster.records("a") == [b"m0"]


async def test_a_shard_held_alone_takes_publishes_at_once_when_given_replicas(
    cluster: Cluster,
) -> None:
    """A shard this node held alone, with appends still on their way to the disk, is given
    two more replicas with this node leading: it leads at once (a publish right after the
    change is taken), and the followers copy the whole log."""
    for node in NODES:
        cluster.start(node)
    place_replicas(cluster, "a", 1, ("a",), ("a",))
    plain = cluster.journals["a"].open_shard(*KEY)
    plain.append([(int(time.time() * 1000), b"alone")])
    assert plain.commit_waiter() is not None  # not durable yet
    place_replicas(cluster, "a", 2, NODES, ("a",), adding=("b", "c"))
    waiting = cluster.publish("a", b"replicated")  # raises NotLeader while it converges
    assert waiting is not None
    await asyncio.wait_for(waiting, 15)
    for node in ("b", "c"):
        await wait_for(lambda node=node: cluster.records(node) == [b"alone", b"replicated"])  # type: ignore[misc]


async def test_a_leader_restarted_while_placed_in_its_old_epoch_waits_for_a_new_one(
    cluster: Cluster,
) -> None:
    """Its followers may hold records its earlier run sent before they were durable there:
    leading that epoch again could put two records at one offset in one epoch."""
    for node in NODES:
        cluster.start(node)
    cluster.place("a", 1, NODES)
    await wait_for(lambda: cluster.managers["a"].leading(*KEY) is not None)
    first = cluster.publish("a", b"m0")
    assert first is not None
    await asyncio.wait_for(first, 15)
    await cluster.stop("a")
    manager = cluster.start("a")  # the placement still names a, in epoch 1
    await wait_for(lambda: manager.role(*KEY) is not None)
    assert manager.leading(*KEY) is None
    with pytest.raises(StorageUnavailable):
        cluster.publish("a", b"refused")
    cluster.place("a", 2, NODES)  # the controller: a registered again, so a new epoch
    await wait_for(lambda: manager.leading(*KEY) is not None)
    second = cluster.publish("a", b"m1")
    assert second is not None
    await asyncio.wait_for(second, 15)
    for node in NODES:
        await wait_for(lambda node=node: cluster.records(node) == [b"m0", b"m1"])  # type: ignore[misc]
    epochs = cluster.journals["b"].open_shard(*KEY).leader_epochs.entries
    assert [entry.epoch for entry in epochs] == [1, 2]


async def test_a_leader_deposed_after_its_followers_fetched_acknowledges_what_the_new_leader_kept(
    cluster: Cluster,
) -> None:
    """a appends m1; b and c fetch it, but a never hears them say so (their next fetches are
    lost): a leads no more (the controller elects b in epoch 2). a neither acknowledges nor
    refuses m1 until b's fetch answer says b's high watermark passed it: refused, a client
    would send it again and the shard would hold it twice."""
    for node in NODES:
        cluster.start(node)
    cluster.place("a", 1, NODES)
    await wait_for(lambda: cluster.managers["a"].leading(*KEY) is not None)
    first = cluster.publish("a", b"m0")
    assert first is not None
    await asyncio.wait_for(first, 15)
    cluster.lost = lambda leader, request: leader == "a" and request.fetch_offset > 1
    waiting = cluster.publish("a", b"m1")
    assert waiting is not None
    for node in ("b", "c"):
        await wait_for(lambda node=node: cluster.records(node) == [b"m0", b"m1"])  # type: ignore[misc]
    await asyncio.sleep(0.1)
    assert not waiting.done()
    cluster.place("b", 2, ("b", "c"))  # a's lease ran out, say
    await wait_for(lambda: cluster.managers["a"].role(*KEY) is not None
                   and cluster.managers["a"].role(*KEY).leader == "b")  # type: ignore[union-attr]
    await asyncio.wait_for(waiting, 15)
    assert cluster.managers["a"].shard_log(*KEY).deposed_waiting == 0
    after = cluster.publish("b", b"m2")
    assert after is not None
    await asyncio.wait_for(after, 15)
    for node in NODES:
        await wait_for(lambda node=node: cluster.records(node) == [b"m0", b"m1", b"m2"])  # type: ignore[misc]


async def test_a_deposed_leaders_wait_is_bounded_and_ends_with_its_replica(
    cluster: Cluster,
) -> None:
    """What a deposed leader keeps is refused, retryable, when the new leader's high
    watermark does not pass it within `deposed_wait_s`, or at once when the node is no longer
    a replica of the shard."""
    for node in NODES:
        cluster.start(node)
    cluster.managers["a"].shard_log(*KEY).deposed_wait_s = 0.3
    cluster.place("a", 1, NODES)
    await wait_for(lambda: cluster.managers["a"].leading(*KEY) is not None)
    # the followers get m0, a never hears that they hold it, nor a from b later
    cluster.lost = lambda leader, request: leader in ("a", "b") and request.fetch_offset > 0
    waiting = cluster.publish("a", b"m0")
    assert waiting is not None
    await wait_for(lambda: cluster.records("b") == cluster.records("c") == [b"m0"])
    cluster.place("b", 2, ("b", "c"))
    with pytest.raises(ShardUnavailable, match="no longer leads"):
        await asyncio.wait_for(waiting, 15)  # past the wait
    # kept again, then the controller drops a from the replicas: refused at once
    cluster.lost = lambda _leader, _request: False
    cluster.managers["a"].shard_log(*KEY).deposed_wait_s = 60.0
    cluster.place("a", 3, NODES)
    await wait_for(lambda: cluster.managers["a"].leading(*KEY) is not None)
    cluster.lost = lambda leader, request: leader == "a" and request.fetch_offset > 1
    second = cluster.publish("a", b"m1")
    assert second is not None
    await wait_for(lambda: cluster.records("b") == [b"m0", b"m1"])
    place_replicas(cluster, "b", 4, ("b", "c"), ("b", "c"))
    with pytest.raises(ShardUnavailable, match="no longer leads"):
        await asyncio.wait_for(second, 5)
