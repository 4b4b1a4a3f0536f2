"""Replication between two real journals in one process: the leader's `ReplicatedShardLog`
under the core's `Broker`, a follower fetching from it with `follow` over a direct-call
transport. A publish is acknowledged, and delivered to subscribers, only once the follower
holds it durably; readers stay below the high watermark; the follower's journal ends up with
the same records at the same offsets; below the in-sync minimum, or after the leader
resigned, nothing is acknowledged; a leader that leaves takes no publish and waits until its
follower knows the high watermark it ends at."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from shardgate.core.broker import Broker
from shardgate.core.durable import encode_cursor_state
from shardgate.core.errors import ShardUnavailable
from shardgate.core.message import Message
from shardgate.core.streams import StreamConfig
from shardgate.storage.interfaces import StorageUnavailable, StoredRecord
from shardgate.storage.journal import JournalShardLog, JournalStorage

from shardgate.cluster.replica_epochs import (
    EpochEndAnswer,
    EpochEndRequest,
    FetchRequest,
    FetchResponse,
    Refused,
    ReplicaError,
)
from shardgate.cluster.replica_follow import FollowerLog, follow
from shardgate.cluster.replica_follower import FollowerReplica
from shardgate.cluster.replica_leader import LeaderReplica
from shardgate.cluster.replica_log import NotEnoughReplicas, ReplicatedShardLog


class Transport:
    """The peer link, as direct calls to the leaders' logs; `cut` makes a leader unreachable
    (a fetch parked there when the link is cut gets no answer either)."""

    def __init__(self) -> None:
        self.leaders: dict[str, ReplicatedShardLog] = {}
        self.cut: set[str] = set()

    async def epoch_end(self, leader: str, request: EpochEndRequest) -> EpochEndAnswer | Refused:
        if leader in self.cut:
            raise ConnectionError(f"{leader} is unreachable")
        return self.leaders[leader].serve_epoch_end(request)

    async def fetch(self, leader: str, request: FetchRequest
                    ) -> tuple[FetchResponse, Sequence[StoredRecord]] | Refused:
        if leader in self.cut:
            raise ConnectionError(f"{leader} is unreachable")
        answer = await self.leaders[leader].fetch(request, max_wait_s=0.05)
        if leader in self.cut:  # cut while the fetch was parked: its answer is lost
            raise ConnectionError(f"{leader} is unreachable")
        return answer


class OneShardStorage:
    """The broker's storage: the leader's replicated log for shard 0 of stream `s`."""

    def __init__(self, shard_log: ReplicatedShardLog) -> None:
        self.shard_log = shard_log

    def open_shard(self, stream: str, shard: int) -> ReplicatedShardLog:
        assert (stream, shard) == ("s", 0)
        return self.shard_log

    def list_shards(self) -> list[tuple[str, int]]:
        return [("s", 0)]

    def delete_shard(self, stream: str, shard: int) -> None:
        raise AssertionError("not in these tests")

    async def flush(self) -> None:
        await self.shard_log.log.flush()

    def close(self) -> None:
        pass


class Recorder:
    consumer_id = "recorder"
    available = True

    def __init__(self) -> None:
        self.got: list[tuple[int, bytes]] = []

    def deliver(self, message: Message, subscription: object, filters: tuple[str, ...]) -> None:
        self.got.append((message.offset, message.payload))


class Pair:
    """Node a leads shard s/0 (replicas a, b); node b follows it."""

    def __init__(self, tmp_path: Path, *, isr: tuple[str, ...] = ("a", "b"), min_insync: int = 2) -> None:
        self.journals = {name: JournalStorage(tmp_path / name) for name in ("a", "b")}
        self.logs: dict[str, JournalShardLog] = {n: j.open_shard("s", 0) for n, j in self.journals.items()}
        self.history = {name: log.leader_epochs for name, log in self.logs.items()}
        self.replicated = ReplicatedShardLog(self.logs["a"], time.monotonic, "a:s/0")
        self.leader: LeaderReplica[asyncio.Future[None]] = LeaderReplica(
            "a", 1, ("a", "b"), isr, min_insync=min_insync, lag_time_max_s=30.0,
            history=self.history["a"], log_end=0, durable_end=0, high_watermark=0,
            now=time.monotonic())
        self.replicated.lead(self.leader)
        self.transport = Transport()
        self.transport.leaders["a"] = self.replicated
        self.follower = FollowerReplica("b", "a", 1, history=self.history["b"], log_end=0,
                                        durable_end=0, high_watermark=0)
        self.follower_log = FollowerLog(self.logs["b"], self.follower)
        self.task: asyncio.Task[None] | None = None
        self.broker = Broker(storage=OneShardStorage(self.replicated),  # type: ignore[arg-type]
                             default_stream=StreamConfig("s", mode="reliable"))
        sub = self.broker.subscription("live")
        self.broker.add_filter(sub, "t/#")
        self.recorder = Recorder()
        self.broker.attach(sub, self.recorder)

    def start_following(self) -> None:
        self.task = asyncio.get_running_loop().create_task(follow(self.follower_log, self.transport,
                                                                  retry_s=0.01))

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        for journal in self.journals.values():
            journal.close()


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    made = Pair(tmp_path)
    yield made
    await made.stop()


async def wait_for(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_a_publish_is_acknowledged_and_delivered_only_once_the_follower_holds_it(pair: Pair) -> None:
    future = pair.broker.publish(Message("t/1", b"one"))
    assert future is not None
    await pair.logs["a"].flush()  # durable on the leader...
    await asyncio.sleep(0.05)
    assert not future.done()  # ...but not acknowledged: b has not fetched
    assert pair.recorder.got == []  # nor seen by any subscriber
    assert pair.replicated.read(0) == [] and pair.replicated.deliverable_end == 0
    pair.start_following()
    await asyncio.wait_for(future, 10)
    assert pair.recorder.got == [(0, b"one")]
    assert pair.logs["b"].committed_offset == 1
    assert pair.follower_log.follower.high_watermark <= 1


async def test_the_followers_journal_holds_the_same_records_at_the_same_offsets(pair: Pair) -> None:
    pair.start_following()
    futures = [pair.broker.publish(Message(f"t/{i % 3}", b"x" * i)) for i in range(200)]
    await asyncio.wait_for(asyncio.gather(*[f for f in futures if f is not None]), 20)
    assert pair.replicated.high_watermark == 200
    await wait_for(lambda: pair.logs["b"].committed_offset == 200)
    assert pair.logs["b"].read(0, 500) == pair.logs["a"].read(0, 500)
    assert pair.history["b"].entries == pair.history["a"].entries
    assert [offset for offset, _ in pair.recorder.got] == list(range(200))


async def test_readers_see_only_what_is_below_the_high_watermark(pair: Pair) -> None:
    pair.start_following()
    first = pair.broker.publish(Message("t/1", b"one"))
    assert first is not None
    await asyncio.wait_for(first, 10)
    pair.transport.cut.add("a")  # b cannot fetch any more
    second = pair.broker.publish(Message("t/1", b"two"))
    assert second is not None
    await pair.logs["a"].flush()
    assert pair.logs["a"].committed_offset == 2
    assert [r.offset for r in pair.replicated.read(0)] == [0]
    assert pair.replicated.committed_offset == 1
    assert len(pair.replicated.read_block(0)) == 1
    assert not second.done()
    pair.transport.cut.clear()
    await asyncio.wait_for(second, 10)
    assert [r.offset for r in pair.replicated.read(0)] == [0, 1]


async def test_below_min_insync_a_publish_is_refused_and_never_stored(tmp_path: Path) -> None:
    pair = Pair(tmp_path, isr=("a",), min_insync=2)
    try:
        # retryable "unavailable" (MQTT 0x80 with the reason, AMQP nack, gRPC UNAVAILABLE),
        # not the publisher's own quota (StoreFull: MQTT 0x97, gRPC RESOURCE_EXHAUSTED)
        with pytest.raises(ShardUnavailable, match="fewer replicas than min_insync_replicas"):
            pair.broker.publish(Message("t/1", b"one"))
        outcomes = pair.broker.publish_many([Message("t/1", b"two"), Message("t/2", b"three")])
        assert all(isinstance(outcome, ShardUnavailable) for outcome in outcomes)
        assert pair.logs["a"].next_offset == 0
        with pytest.raises(NotEnoughReplicas):
            pair.replicated.append([(0, b"x")])
    finally:
        await pair.stop()


async def test_a_resigning_leader_fails_what_waits_with_a_retryable_error(pair: Pair) -> None:
    future = pair.broker.publish(Message("t/1", b"one"))
    assert future is not None
    pair.replicated.resign()  # a newer epoch exists
    with pytest.raises(ShardUnavailable, match="no longer leads"):
        await asyncio.wait_for(future, 10)
    assert pair.recorder.got == []
    assert pair.replicated.serve_fetch(FetchRequest("b", 1, 0, 0)) == Refused(ReplicaError.NOT_LEADER)


async def test_a_fetch_naming_the_next_epoch_keeps_what_waits_for_the_leader_of_that_epoch(
    pair: Pair,
) -> None:
    """The follower saw the placement of epoch 2 (a leads it again, its replicas changed)
    before the leader did: its fetch naming epoch 2 is refused, retryably, and the publish
    that waited is neither refused nor delivered until the leader leads epoch 2
    (`lead_again`), then acknowledged and delivered once (no resend, so no duplicate)."""
    future = pair.broker.publish(Message("t/1", b"one"))
    assert future is not None
    ahead = FollowerReplica("b", "a", 2, history=pair.history["b"], log_end=0, durable_end=0,
                            high_watermark=0)
    follower_log = FollowerLog(pair.logs["b"], ahead)
    pair.task = asyncio.get_running_loop().create_task(
        follow(follower_log, pair.transport, retry_s=0.01))
    await wait_for(lambda: ahead.last_refusal is ReplicaError.UNKNOWN_LEADER_EPOCH)
    await asyncio.sleep(0.05)  # refused again and again meanwhile
    assert not future.done()
    assert not pair.leader.fenced
    assert pair.recorder.got == []
    again: LeaderReplica[asyncio.Future[None]] = LeaderReplica(
        "a", 2, ("a", "b"), ("a", "b"), min_insync=2, lag_time_max_s=30.0,
        history=pair.history["a"], log_end=pair.logs["a"].next_offset,
        durable_end=pair.logs["a"].committed_offset, high_watermark=pair.replicated.high_watermark,
        now=time.monotonic())
    pair.replicated.lead_again(again)
    await asyncio.wait_for(future, 10)
    await wait_for(lambda: pair.recorder.got == [(0, b"one")])
    assert [r.data for r in pair.logs["b"].read(0, 10)] == [r.data for r in pair.logs["a"].read(0, 10)]
    assert pair.logs["b"].next_offset == 1


async def test_a_fetch_at_the_end_is_held_until_something_is_committed(pair: Pair) -> None:
    pending = asyncio.ensure_future(pair.replicated.fetch(FetchRequest("b", 1, 0, 0), max_wait_s=5.0))
    await asyncio.sleep(0.05)
    assert not pending.done()
    started = time.monotonic()
    pair.broker.publish(Message("t/1", b"one"))
    answer = await asyncio.wait_for(pending, 10)
    assert time.monotonic() - started < 4.0
    assert not isinstance(answer, Refused)
    response, records = answer
    assert (response.start, response.end, [r.data != b"" for r in records]) == (0, 1, [True])


async def test_an_unreachable_leader_is_retried(pair: Pair) -> None:
    pair.transport.cut.add("a")
    pair.start_following()
    future = pair.broker.publish(Message("t/1", b"one"))
    assert future is not None
    await asyncio.sleep(0.1)
    assert not future.done()
    pair.transport.cut.clear()
    await asyncio.wait_for(future, 10)


async def test_a_follower_whose_journal_fails_a_write_fetches_the_records_again_and_catches_up(
    pair: Pair,
) -> None:
    # the follower's disk is full: its journal's writes fail (and roll back) until it has room
    follower_log = pair.logs["b"]
    real_write = follower_log._io_write
    full = True

    def write(group: object, durable: bool = False) -> None:
        if full:
            raise OSError(28, "No space left on device")
        real_write(group, durable)  # type: ignore[arg-type]

    follower_log._io_write = write  # type: ignore[method-assign]
    pair.start_following()
    sent = [pair.broker.publish(Message("t/1", f"m{i}".encode())) for i in range(3)]
    await wait_for(lambda: pair.follower_log.failures >= 2)
    assert not any(future is not None and future.done() for future in sent)
    assert follower_log.committed_offset == 0
    full = False  # room again: the follower fetches from its durable end and catches up
    for future in sent:
        assert future is not None
        await asyncio.wait_for(future, 10)
    await wait_for(lambda: follower_log.committed_offset == 3)
    # the leader's records at the leader's offsets, never an empty record for a failed write
    assert [r.data for r in follower_log.read(0)] == [r.data for r in pair.logs["a"].read(0)]
    assert follower_log.next_offset == 3
    assert pair.follower_log.failures == 0 and pair.follower_log.failed is None


async def test_after_a_failover_the_old_leader_cuts_its_unacknowledged_tail_from_its_journal(
    pair: Pair,
) -> None:
    pair.start_following()
    acknowledged = [pair.broker.publish(Message("t/1", f"ack{i}".encode())) for i in range(5)]
    await asyncio.wait_for(asyncio.gather(*[f for f in acknowledged if f is not None]), 10)
    pair.transport.cut.add("a")  # b stops hearing from a: a's next records reach only a's disk
    lost = [pair.broker.publish(Message("t/1", f"lost{i}".encode())) for i in range(3)]
    await pair.logs["a"].flush()
    assert pair.logs["a"].committed_offset == 8
    assert pair.task is not None
    pair.task.cancel()
    await asyncio.gather(pair.task, return_exceptions=True)
    # the controller makes b the leader of epoch 2 (a's lease ran out); a learns it and resigns
    pair.replicated.resign()
    for future in lost:
        assert future is not None
        with pytest.raises(ShardUnavailable):
            await asyncio.wait_for(future, 10)
    b_log = ReplicatedShardLog(pair.logs["b"], time.monotonic, "b:s/0")
    b_leader: LeaderReplica[asyncio.Future[None]] = LeaderReplica(
        "b", 2, ("a", "b"), ("b",), min_insync=1, lag_time_max_s=30.0,
        history=pair.logs["b"].leader_epochs, log_end=pair.logs["b"].next_offset,
        durable_end=pair.logs["b"].committed_offset, high_watermark=5, now=time.monotonic())
    b_log.lead(b_leader)
    pair.transport.leaders["b"] = b_log
    b_log.append([(1, b"new-on-b")])
    waiter = b_log.commit_waiter()
    assert waiter is not None
    await asyncio.wait_for(waiter, 10)
    # a follows b in epoch 2: it asks where epoch 1 ends on b (5) and cuts its journal there
    a_follower = FollowerReplica("a", "b", 2, history=pair.logs["a"].leader_epochs,
                                 log_end=pair.logs["a"].next_offset,
                                 durable_end=pair.logs["a"].committed_offset, high_watermark=5)
    pair.transport.cut.clear()
    task = asyncio.get_running_loop().create_task(
        follow(FollowerLog(pair.logs["a"], a_follower), pair.transport, retry_s=0.01))
    try:
        await wait_for(lambda: pair.logs["a"].committed_offset == 6 and b_log.high_watermark == 6)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    a_records = pair.logs["a"].read(0, 100)
    assert a_records == pair.logs["b"].read(0, 100)
    assert a_records[5].data == b"new-on-b"
    assert pair.logs["a"].leader_epochs.entries == pair.logs["b"].leader_epochs.entries
    assert [e.epoch for e in pair.logs["a"].leader_epochs.entries] == [1, 2]


async def test_a_follower_behind_the_journals_retention_is_told_where_the_log_starts(
    tmp_path: Path,
) -> None:
    journal = JournalStorage(tmp_path / "a", segment_bytes=4096)
    try:
        shard_log = journal.open_shard("s", 0)
        replicated = ReplicatedShardLog(shard_log, time.monotonic, "a:s/0")
        replicated.lead(LeaderReplica("a", 1, ("a", "b"), ("a",), min_insync=1, lag_time_max_s=30.0,
                                      history=shard_log.leader_epochs, log_end=0, durable_end=0,
                                      high_watermark=0, now=time.monotonic()))
        for _ in range(40):  # a commit per record: segments roll every few records
            replicated.append([(1, b"x" * 500)])
            await shard_log.flush()
        low = shard_log.delete_before(30)  # the journal's own retention, past the wrapper
        assert 0 < low <= 30
        assert replicated.serve_fetch(FetchRequest("b", 1, 0, 0)) == Refused(ReplicaError.BEHIND_LOG_START, low)
        answer = replicated.serve_fetch(FetchRequest("b", 1, low, low))
        assert not isinstance(answer, Refused)
        assert answer[0].start == low and answer[1][0].offset == low
    finally:
        journal.close()


async def test_the_journals_retention_runs_on_a_replicated_shard_and_stops_at_the_high_watermark(
    tmp_path: Path,
) -> None:
    """The node's periodic retention pass calls `apply_retention` on every shard log that has
    it: a replicated shard's too (it had none, and its journal grew for ever), never past
    what a failover may still cut (the high watermark) nor what a cursor still needs."""
    journal = JournalStorage(tmp_path / "a", segment_bytes=4096, retention_bytes=1)
    try:
        shard_log = journal.open_shard("s", 0)
        replicated = ReplicatedShardLog(shard_log, time.monotonic, "a:s/0")
        replicated.lead(LeaderReplica("a", 1, ("a", "b"), ("a", "b"), min_insync=1, lag_time_max_s=30.0,
                                      history=shard_log.leader_epochs, log_end=0, durable_end=0,
                                      high_watermark=0, now=time.monotonic()))
        for _ in range(80):  # a commit per record: segments roll every few records
            replicated.append([(1, b"x" * 500)])
            await shard_log.flush()
        assert replicated.high_watermark == 0, "b holds nothing yet"
        assert replicated.apply_retention(10**9) == 0
        assert not isinstance(replicated.serve_fetch(FetchRequest("b", 1, 60, 60)), Refused)
        assert replicated.high_watermark == 60
        assert 0 < replicated.apply_retention(20) <= 20, "a cursor needs offset 20"
        low = replicated.apply_retention(10**9)
        assert 20 < low <= 60, "nothing at or above the high watermark goes"
        assert replicated.low_watermark == low and replicated.read(0, 1)[0].offset == low
    finally:
        journal.close()


async def test_a_restored_cursors_unacknowledged_messages_wait_for_a_new_leaders_high_watermark(
    pair: Pair,
) -> None:
    """A durable queue on the shard's leader stopped with three messages handed out and not
    acknowledged; the node comes back leading in a new epoch, whose high watermark starts
    below them until the follower fetches in that epoch (or its lease is proven alive). The
    restored cursor redelivers them once they can be read: none is passed over for good
    (the chaos run's AMQP queue lost such messages)."""
    pair.start_following()
    futures = [pair.broker.publish(Message("t/1", f"m{i}".encode())) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*[f for f in futures if f is not None]), 10)
    assert pair.task is not None
    pair.task.cancel()
    await asyncio.gather(pair.task, return_exceptions=True)
    # the new epoch: a leads again, b (in sync) has not fetched in it yet
    pair.replicated.lead(LeaderReplica(
        "a", 2, ("a", "b"), ("a", "b"), min_insync=1, lag_time_max_s=30.0,
        history=pair.history["a"], log_end=3, durable_end=3, high_watermark=0,
        now=time.monotonic()))
    assert pair.replicated.read(0) == []
    sub = pair.broker.durable_subscription("queue")
    pair.broker.add_filter(sub, "t/#")
    sub.restore_cursor("s", 0, encode_cursor_state(3, [0, 1, 2]))
    queue = Recorder()
    pair.broker.attach(sub, queue)
    await asyncio.sleep(0.3)  # pumps meanwhile read nothing: nothing is handed out yet
    assert queue.got == []
    follower = FollowerReplica("b", "a", 2, history=pair.history["b"], log_end=3, durable_end=3,
                               high_watermark=0)
    task = asyncio.get_running_loop().create_task(
        follow(FollowerLog(pair.logs["b"], follower), pair.transport, retry_s=0.01))
    try:
        await wait_for(lambda: len(queue.got) == 3)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert queue.got == [(0, b"m0"), (1, b"m1"), (2, b"m2")]


async def test_a_publish_refused_as_leadership_moves_is_a_warning_not_an_error(
        pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    # a graceful shard move refuses what the old leader had not committed with a retryable
    # error: expected, and the publisher retries; an ERROR in the log would say otherwise
    future = pair.broker.publish(Message("t/1", b"one"))
    assert future is not None
    with caplog.at_level(logging.WARNING, logger="shardgate.core"):
        pair.replicated.resign()
        with pytest.raises(ShardUnavailable):
            await asyncio.wait_for(future, 10)
        await asyncio.sleep(0)
    refused = [record for record in caplog.records if "no longer leads" in record.getMessage()]
    assert refused, "the refused commit is logged"
    assert all(record.levelno == logging.WARNING for record in refused), [
        (record.levelname, record.getMessage()) for record in refused]


def _leading(tmp_path: Path, *, fsync: str = "always", fsync_interval_ms: int = 50
             ) -> tuple[JournalStorage, ReplicatedShardLog, LeaderReplica[asyncio.Future[None]]]:
    journal = JournalStorage(tmp_path / "leader", fsync=fsync, fsync_interval_ms=fsync_interval_ms)
    shard_log = journal.open_shard("s", 0)
    replicated = ReplicatedShardLog(shard_log, time.monotonic, "a:s/0")
    leader: LeaderReplica[asyncio.Future[None]] = LeaderReplica(
        "a", 1, ("a", "b"), ("a", "b"), min_insync=2, lag_time_max_s=30.0,
        history=shard_log.leader_epochs, log_end=0, durable_end=0, high_watermark=0,
        now=time.monotonic())
    replicated.lead(leader)
    return journal, replicated, leader


async def test_a_parked_fetch_is_answered_the_moment_the_leader_appends(tmp_path: Path) -> None:
    # the leader fsyncs once a minute: the answer cannot be waiting for its fsync
    journal, replicated, _leader = _leading(tmp_path, fsync="interval", fsync_interval_ms=60_000)
    try:
        # a follower at the leader's end: its fetch parks (for up to a minute)
        parked = asyncio.get_running_loop().create_task(
            replicated.fetch(FetchRequest("b", 1, 0, 0), max_wait_s=60.0))
        await asyncio.sleep(0)
        assert not parked.done()
        replicated.append([(1, b"one"), (2, b"two")])
        answer = await asyncio.wait_for(parked, 10)  # not the minute: the append woke it
        assert not isinstance(answer, Refused)
        response, records = answer
        assert (response.start, response.end) == (0, 2)
        assert [record.data for record in records] == [b"one", b"two"]
    finally:
        journal.close()


async def test_the_leader_sends_what_is_not_durable_yet_but_acknowledges_only_once_durable_everywhere(
    tmp_path: Path,
) -> None:
    # the leader fsyncs once a minute: what it appends is not durable here until a flush
    journal, replicated, leader = _leading(tmp_path, fsync="interval", fsync_interval_ms=60_000)
    try:
        replicated.append([(1, b"one")])
        waiter = replicated.commit_waiter()
        assert waiter is not None
        answer = replicated.serve_fetch(FetchRequest("b", 1, 0, 0))
        assert not isinstance(answer, Refused)
        assert [record.data for record in answer[1]] == [b"one"]  # sent before the leader's fsync
        assert replicated.log.committed_offset == 0
        # the follower holds it durably: still not acknowledged, the leader's own fsync is missing
        answer = replicated.serve_fetch(FetchRequest("b", 1, 1, 1))
        assert not isinstance(answer, Refused) and answer[1] == []
        assert leader.high_watermark == 0 and not waiter.done()
        assert replicated.read(0) == []
        await journal.flush()  # the leader's fsync, at once: now both hold it
        await asyncio.wait_for(waiter, 10)
        assert leader.high_watermark == 1
        assert [record.data for record in replicated.read(0)] == [b"one"]
    finally:
        journal.close()


async def test_a_leader_whose_journal_failed_a_commit_resigns_before_the_next_append(
    tmp_path: Path,
) -> None:
    journal, replicated, _leader = _leading(tmp_path)
    try:
        replicated.append([(1, b"sent")])
        waiter = replicated.commit_waiter()
        assert waiter is not None
        # the journal rolls the record back (as after a failed write); the commit's callback
        # has not run yet when the next publish comes
        written = replicated.log.commit_waiter()
        assert written is not None
        replicated.log._rollback(OSError(28, "No space left on device"), None)
        assert written.done()
        with pytest.raises(StorageUnavailable):
            replicated.append([(2, b"would fill the failed offset with an empty record")])
        assert replicated.leader is None
        assert replicated.log.next_offset == 1  # nothing appended: the failed offset stays a hole
        with pytest.raises(ShardUnavailable):
            await waiter
    finally:
        journal.close()


async def test_a_leaving_leader_takes_no_publish_and_its_follower_learns_where_it_ends(pair: Pair) -> None:
    pair.start_following()
    future = pair.broker.publish(Message("t/1", b"one"))
    assert future is not None
    await asyncio.wait_for(future, 10)
    pair.replicated.stop_taking()
    with pytest.raises(StorageUnavailable):
        pair.replicated.append([(0, b"two")])
    pair.replicated.wake_fetches()
    await wait_for(lambda: pair.replicated.handed_over)
    assert pair.follower.high_watermark == pair.replicated.high_watermark == 1
    assert pair.recorder.got == [(0, b"one")]
    # leading again in a newer epoch (its replicas changed meanwhile) takes no publish either
    again: LeaderReplica[asyncio.Future[None]] = LeaderReplica(
        "a", 2, ("a", "b"), ("a", "b"), min_insync=2, lag_time_max_s=30.0,
        history=pair.history["a"], log_end=pair.logs["a"].next_offset,
        durable_end=pair.logs["a"].committed_offset, high_watermark=pair.replicated.high_watermark,
        now=time.monotonic())
    pair.replicated.lead_again(again)
    with pytest.raises(StorageUnavailable):
        pair.replicated.append([(0, b"two")])


async def test_a_frozen_leaving_leader_commits_nothing_more_while_its_follower_catches_up(
        pair: Pair) -> None:
    future = pair.broker.publish(Message("t/1", b"one"))  # stored, never committed
    assert future is not None
    pair.replicated.stop_taking()
    pair.replicated.freeze()
    pair.start_following()
    await wait_for(lambda: pair.logs["b"].committed_offset == 1 and pair.replicated.handed_over)
    await asyncio.sleep(0.1)  # the follower's fetches go on
    assert pair.replicated.high_watermark == pair.follower.high_watermark == 0
    assert not future.done() and pair.recorder.got == []
    pair.replicated.resign()  # the next leader commits it and hands it on
    with pytest.raises(ShardUnavailable):
        await asyncio.wait_for(future, 10)
    assert pair.recorder.got == []


async def test_a_drains_quiesce_called_off_takes_publishes_and_commits_again(pair: Pair) -> None:
    future = pair.broker.publish(Message("t/1", b"one"))  # stored, not committed yet
    assert future is not None
    pair.replicated.stop_taking()
    pair.replicated.freeze()
    pair.start_following()
    await wait_for(lambda: pair.logs["b"].committed_offset == 1 and pair.replicated.handed_over)
    assert not future.done()
    # the controller wants the shard moved no more: this leadership goes on as before
    pair.replicated.reopen(leading=True)
    await asyncio.wait_for(future, 10)
    more = pair.broker.publish(Message("t/1", b"two"))
    assert more is not None
    await asyncio.wait_for(more, 10)
    assert pair.recorder.got == [(0, b"one"), (1, b"two")]
    # quiesced again, then moved (reopened without its leadership): a later one is open
    pair.replicated.stop_taking()
    pair.replicated.reopen(leading=False)
    with pytest.raises(StorageUnavailable):
        pair.replicated.append([(0, b"three")])
    again: LeaderReplica[asyncio.Future[None]] = LeaderReplica(
        "a", 2, ("a", "b"), ("a", "b"), min_insync=2, lag_time_max_s=30.0,
        history=pair.history["a"], log_end=pair.logs["a"].next_offset,
        durable_end=pair.logs["a"].committed_offset, high_watermark=pair.replicated.high_watermark,
        now=time.monotonic())
    pair.replicated.lead_again(again)
    assert pair.replicated.append([(0, b"three")]) == 2


async def test_a_replica_that_gave_the_leadership_up_for_a_full_disk_fetches_only_once_it_has_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # b led the shard, its journal failed a write, it resigned; it follows a now, holding
    # everything up to a's epoch start: fetching at once would put it back in the in-sync
    # set (its durable end is a's log end), with a disk that still cannot write
    from shardgate.cluster import replica_follow

    full = True
    probes = 0

    def probe(directory: object) -> None:
        nonlocal probes
        probes += 1
        if full:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(replica_follow, "probe_disk", probe)
    pair = Pair(tmp_path, isr=("a",), min_insync=1)
    try:
        pair.follower_log = FollowerLog(pair.logs["b"], pair.follower,
                                        failed=StorageUnavailable("the journal failed a write"))
        pair.start_following()
        await wait_for(lambda: probes >= 3)
        assert pair.leader.follower("b").last_fetch_time == float("-inf")  # never fetched
        assert pair.leader.pending_proposal is None  # never proposed back into the in-sync set
        full = False  # room again: it fetches, and the leader proposes it back
        await wait_for(lambda: pair.leader.pending_proposal is not None)
        assert pair.leader.pending_proposal.isr == frozenset({"a", "b"})
        assert pair.follower_log.failed is None
    finally:
        await pair.stop()


def test_the_disk_probe_writes_syncs_and_removes_its_file(tmp_path: Path) -> None:
    from shardgate.cluster.replica_follow import probe_disk

    probe_disk(tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OSError):
        probe_disk(tmp_path / "missing")


async def test_the_follower_learns_the_leaders_dispatched_mark_with_each_fetch(tmp_path: Path) -> None:
    # (a follower elected after the leader died hands on from it: `dispatch_marks.py`)
    pair = Pair(tmp_path)
    try:
        b_log = ReplicatedShardLog(pair.logs["b"], time.monotonic, "b:s/0")
        pair.follower_log = FollowerLog(pair.logs["b"], pair.follower, b_log)
        told: list[int | None] = [None]
        pair.replicated.dispatch_mark = lambda: told[0]
        pair.start_following()
        for index in range(3):
            future = pair.broker.publish(Message("t/1", str(index).encode()))
            assert future is not None
            await asyncio.wait_for(future, 10)
        assert b_log.dispatched_known is None  # the leader knows none
        told[0] = 2
        future = pair.broker.publish(Message("t/1", b"3"))
        assert future is not None
        await asyncio.wait_for(future, 10)
        await wait_for(lambda: b_log.dispatched_known == 2)
        told[0] = 100  # never above the high watermark
        await wait_for(lambda: b_log.dispatched_known == b_log.high_watermark == 4)
        told[0] = None  # a leader that knows none says so: what was told of another is gone
        await wait_for(lambda: b_log.dispatched_known is None)
    finally:
        await pair.stop()
