"""A replicated shard's journal log on this node: the leader's side as the core sees it, the
follower's side as the fetcher fills it (the I/O around `replica_leader` and
`replica_follower`).

`ReplicatedShardLog` stands where the core expects a `ShardLog` (the broker appends to it,
durable cursors and the archiver read it). While this node leads the shard
(`lead`), an append goes to the journal and its commit future resolves when the high
watermark passes it while `min_insync_replicas` replicas are in sync (it waits while fewer
are: `replica_leader`), not when the local fsync is done; it fails with `ShardUnavailable`
when this leadership ends first. Readers see only
what is below the high watermark (`deliverable_end`, `committed_offset`, `read`,
`read_block`): a record above it may still be cut by a failover, so nobody may have seen it.
Appends are refused (`NotEnoughReplicas`, `NotLeader`: both `StorageUnavailable`, which the
core answers with its retryable `ShardUnavailable`) while the leader cannot take them. A shard of one
replica, and every shard on a single node, never gets here.

The same object answers followers' fetches (`serve_fetch`, `serve_epoch_end`), and, while
this node follows, takes the fetched records (`FollowerLog`). As Kafka's leader, it sends
followers what it appended before its own fsync is done: the records the journal has
published are read from it, the newer ones from `_unsynced` (the records this leader appended
and the journal has not made durable yet, kept in memory until it has). The leader's fsync
and its followers' then run side by side, instead of one after the other. Nothing is
acknowledged earlier for it: the high watermark is still the lowest durable end over the
in-sync set, this leader's own included. A fetch that finds nothing new is parked (`fetch`)
and answered at the next append. Each answer also carries the leader's dispatched mark
(`dispatch_mark`, `dispatch_marks.py`), which the follower keeps (`dispatched_known`): where a
new leader hands on from after this one died. Should the journal fail a commit, this node
resigns before anything else is appended (`append` checks it too, not only the commit's
callback): the offsets it may have sent are then cut from its log at the role change, never
written here with other (empty) records under the same epoch; and it tells `gave_up` (the
replica manager asks the controller to move the shard). A follower whose journal fails a write (a full disk)
cuts its log back to its durable end and fetches again after a pause (`follow`).

A node that leaves gracefully stops taking publishes for the shards it leads (`stop_taking`,
then maybe `freeze`; `replica_leader`'s graceful leave) until `handed_over`: its followers
know the high watermark it ends at. Its leaderships in a newer epoch, if any, stay so. A
drain does the same for one shard before the controller moves it, and `reopen` ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Protocol

from ..core.errors import ShardUnavailable
from ..storage.interfaces import StorageError, StorageUnavailable, StoredRecord
from ..storage.journal import JournalShardLog, RecordBlock
from .replica_epochs import (
    EpochCache,
    EpochEndAnswer,
    EpochEndRequest,
    FetchPlan,
    FetchRequest,
    FetchResponse,
    Refused,
    ReplicaError,
)
from .replica_follower import FollowerReplica, FollowerState, ResetLog, Truncate
from .replica_leader import LeaderReplica

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class NotLeader(StorageUnavailable):
    """This node does not lead the shard now (a failover is under way): retry."""


class NotEnoughReplicas(StorageUnavailable):
    """Fewer replicas than `min_insync_replicas` are in sync: retry later."""


_REFUSALS: dict[ReplicaError, str] = {
    ReplicaError.NOT_LEADER: "this node no longer leads the shard",
    ReplicaError.NOT_ENOUGH_REPLICAS: "fewer replicas than min_insync_replicas are in sync",
}


def refusal(error: ReplicaError, where: str) -> ShardUnavailable:
    return ShardUnavailable(f"{where}: {_REFUSALS.get(error, error.value)}")


class ReplicatedShardLog:
    """One replicated shard's journal log on this node (see the module docstring)."""

    def __init__(self, journal_log: JournalShardLog, clock: Clock, name: str = "") -> None:
        self.log = journal_log
        self.epochs: EpochCache = journal_log.leader_epochs
        self._clock = clock
        self._name = name or str(journal_log.directory)
        self.leader: LeaderReplica[asyncio.Future[None]] | None = None
        self._follower_hw = 0
        self._watched: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._waiter_end = -1
        self._news: asyncio.Future[None] | None = None
        # what this leader appended and the journal has not published yet: the records
        # from `_unsynced_start` on, in offset order (see the module docstring)
        self._unsynced: list[StoredRecord] = []
        self._unsynced_start = 0
        # told the leadership this node gave up after its journal failed a commit (a full
        # disk), once it resigned: the replica manager asks the controller to move the shard
        self.gave_up: Callable[[LeaderReplica[asyncio.Future[None]]], None] | None = None
        # while this node leads: its dispatched mark, told with each fetch answer (the replica
        # manager's user sets it; `dispatch_marks.py`)
        self.dispatch_mark: Callable[[], int | None] | None = None
        # while it follows: the mark its leader told it last (None: not known)
        self.dispatched_known: int | None = None
        # this node leaves: no more publishes (and, once frozen, no more commits)
        self._closed = False
        self._frozen = False

    # -- leadership ---------------------------------------------------------------------------

    def lead(self, leader: LeaderReplica[asyncio.Future[None]]) -> None:
        """This node leads the shard from now on, in `leader`'s epoch."""
        self.resign()
        self.leader = leader
        self._closing(leader)
        self._unsynced = []
        self._unsynced_start = self.log.next_offset
        self._watch_commit()  # appends still on their way to the disk count when written
        self._settle()

    def lead_again(self, leader: LeaderReplica[asyncio.Future[None]]) -> None:
        """This node, leading now, leads the shard again in `leader`'s newer epoch (the
        controller changed its replicas): done at once, so no publish is refused meanwhile,
        and what waits for its commit carries over to the new epoch, acknowledged once its
        high watermark passes it (the log is the same log: nothing is cut)."""
        old = self.leader
        if old is None:
            self.lead(leader)
            return
        carried = old.hand_over()
        self._settle()
        self.leader = leader
        self._closing(leader)
        now = self._clock()
        for end, waiter in carried:
            leader.await_commit(end, waiter, now)
        self._watch_commit()
        self._settle()
        self._wake()

    def hold_alone(self) -> None:
        """This node, leading now, holds the shard alone from now on (the controller left it
        one replica, this one): the broker gets the plain journal log back; what waits for
        its commit is acknowledged once the journal has it durable, as on a shard of one
        replica (nothing is refused: the record is in the log and stays there)."""
        old = self.leader
        if old is None:
            return
        carried = old.hand_over()
        self.resign()
        if not carried:
            return
        journal_waiter = self.log.commit_waiter()

        def settle(done: asyncio.Future[None] | None) -> None:
            error = None
            if done is not None and (done.cancelled() or done.exception() is not None):
                error = (StorageUnavailable(f"{self._name}: the journal commit was cancelled")
                         if done.cancelled() else done.exception())
            for _end, waiter in carried:
                if waiter.done():
                    continue
                if error is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(error)

        if journal_waiter is None:
            settle(None)
        else:
            journal_waiter.add_done_callback(settle)

    def resign(self) -> None:
        """This node stops leading (a newer epoch, or it follows now): what waits fails."""
        leader = self.leader
        if leader is None:
            return
        self._follower_hw = leader.high_watermark
        leader.supersede()
        self._settle()
        self.leader = None
        self._waiter = None
        self._waiter_end = -1
        self._unsynced = []
        self._wake()

    # -- a graceful leave ---------------------------------------------------------------------

    def stop_taking(self) -> None:
        """This node leaves: it takes no more publishes for the shard (refused, retryable),
        and what it holds goes on committing (see the module docstring)."""
        self._closed = True
        if self.leader is not None:
            self.leader.close()

    def freeze(self) -> None:
        """... and commits nothing more: its high watermark stays where it is."""
        self._closed = self._frozen = True
        if self.leader is not None:
            self.leader.close()
            self.leader.freeze()
        self._wake()

    def reopen(self, *, leading: bool) -> None:
        """A drain's quiesce is over (`replicated_shards.ReplicatedShards.reopen`): a later
        leadership takes publishes again, and with `leading` the present one too."""
        self._closed = self._frozen = False
        if leading and self.leader is not None:
            self.leader.reopen()
            self._wake()

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def handed_over(self) -> bool:
        """Whether this node leads the shard no more, or its in-sync followers know the high
        watermark it ends at (after `stop_taking`)."""
        leader = self.leader
        return leader is None or leader.fenced or leader.final_mark_known()

    def wake_fetches(self) -> None:
        """Answer the followers' parked fetches now (with the high watermark as it is)."""
        self._wake()

    def _closing(self, leader: LeaderReplica[asyncio.Future[None]]) -> None:
        if self._closed:
            leader.close()
        if self._frozen:
            leader.freeze()

    @property
    def high_watermark(self) -> int:
        leader = self.leader
        return leader.high_watermark if leader is not None else self._follower_hw

    @high_watermark.setter
    def high_watermark(self, value: int) -> None:
        """A follower's high watermark (what its leader said, bounded by its own end)."""
        self._follower_hw = value

    @property
    def settled(self) -> bool:
        """Whether this node leads the shard and its high watermark reached the end the log
        had when its epoch began: every record an earlier leader may have acknowledged is
        readable here (a new leader's high watermark starts where it last heard it)."""
        leader = self.leader
        return leader is not None and leader.high_watermark >= leader.epoch_start

    @property
    def acknowledging(self) -> bool:
        """Whether this node leads the shard and acknowledges what its high watermark passes
        now (its lease alive, at least `min_insync_replicas` in sync): a copy sent again and
        found below the mark is acknowledged only then (`core/resends.py`)."""
        leader = self.leader
        return leader is not None and leader.check_append(self._clock()) is None

    # -- ShardLog -----------------------------------------------------------------------------

    @property
    def low_watermark(self) -> int:
        return self.log.low_watermark

    @property
    def next_offset(self) -> int:
        return self.log.next_offset

    @property
    def committed_offset(self) -> int:
        return min(self.log.committed_offset, self.high_watermark)

    @property
    def deliverable_end(self) -> int:
        return self.committed_offset

    def append(self, records: Sequence[tuple[int, bytes]]) -> int:
        leader = self.leader
        if leader is None:
            raise NotLeader(f"{self._name}: this node does not lead the shard")
        error = leader.check_append(self._clock())
        if error is ReplicaError.NOT_ENOUGH_REPLICAS:
            raise NotEnoughReplicas(f"{self._name}: {_REFUSALS[error]}")
        if error is not None:
            raise NotLeader(f"{self._name}: {_REFUSALS.get(error, error.value)}")
        watched = self._watched
        if watched is not None and watched.done() and (
                watched.cancelled() or watched.exception() is not None):
            # the journal failed a commit and its callback has not run yet: resign now, before
            # this append fills the failed offsets with empty records
            self._on_durable(watched)
            raise NotLeader(f"{self._name}: {_REFUSALS[ReplicaError.NOT_LEADER]}")
        first = self.log.append(records)
        unsynced = self._unsynced
        if first != self._unsynced_start + len(unsynced):
            # not contiguous with what is kept (it never is while this node leads, but then
            # the records before are read from the journal once published)
            unsynced.clear()
            self._unsynced_start = first
        unsynced.extend(StoredRecord(offset, timestamp_ms, data)
                        for offset, (timestamp_ms, data) in enumerate(records, first))
        leader.appended(self.log.next_offset)
        self._watch_commit()
        self._wake()
        return first

    def commit_waiter(self) -> asyncio.Future[None] | None:
        """A future resolved once the high watermark passes every record appended so far
        (failed with `ShardUnavailable` when it cannot); None when it already has."""
        leader = self.leader
        end = self.log.next_offset
        if leader is None:
            return None if end <= self._follower_hw else self._failed(ReplicaError.NOT_LEADER)
        if leader.high_watermark >= end:
            return None
        if self._waiter is not None and self._waiter_end == end and not self._waiter.done():
            return self._waiter
        waiter = asyncio.get_running_loop().create_future()
        self._waiter, self._waiter_end = waiter, end
        leader.await_commit(end, waiter, self._clock())
        self._settle()
        return waiter

    def read(self, from_offset: int, max_records: int = 1000) -> list[StoredRecord]:
        end = self.committed_offset
        if from_offset >= end:
            return []
        return self.log.read(from_offset, min(max_records, end - max(from_offset, self.low_watermark)))

    def read_block(self, from_offset: int, max_records: int = 10_000) -> RecordBlock:
        end = self.committed_offset
        block = self.log.read_block(from_offset, max(0, min(max_records, end - from_offset)))
        if block.end_offset > end:
            return block[:max(0, end - block.first_offset)]
        return block

    def offset_for_timestamp(self, timestamp_ms: int) -> int:
        return min(self.log.offset_for_timestamp(timestamp_ms), self.committed_offset)

    def delete_before(self, offset: int) -> int:
        return self._retained_from(self.log.delete_before(min(offset, self.committed_offset)))

    def apply_retention(self, min_needed_offset: int) -> int:
        """The journal's retention (`retention_bytes`, `retention_ms`), run by the node's
        periodic pass on leaders and followers alike, never past the high watermark (what is
        above it may still be cut by a failover) nor `min_needed_offset`. Returns the new low
        watermark (a follower behind it resumes from there, `ResetLog`)."""
        return self._retained_from(
            self.log.apply_retention(min(min_needed_offset, self.committed_offset)))

    def _retained_from(self, low: int) -> int:
        """The journal now starts at `low`: a leader tells its followers' state machine."""
        if self.leader is not None:
            self.leader.retained_from(low)
        return low

    def close(self) -> None:
        self.resign()
        self.log.close()

    # -- the leader's side of the peer link ---------------------------------------------------

    def serve_fetch(self, request: FetchRequest, max_records: int = 1000
                    ) -> tuple[FetchResponse, list[StoredRecord]] | Refused:
        """A follower's fetch: the records to send it (only what is durable here), with
        their epochs and the high watermark; or why not."""
        leader = self.leader
        if leader is None:
            return Refused(ReplicaError.NOT_LEADER)
        leader.retained_from(self.log.low_watermark)  # the journal's retention may have run
        plan = leader.on_fetch(request, self._clock())
        self._settle()
        if isinstance(plan, Refused):
            return plan
        return self._response(leader.epoch, plan, max_records)

    async def fetch(self, request: FetchRequest, max_records: int = 1000, max_wait_s: float = 0.5
                    ) -> tuple[FetchResponse, list[StoredRecord]] | Refused:
        """`serve_fetch`, held up to `max_wait_s` while there is nothing to send (a long
        poll: a follower at the end is answered as soon as something is appended here)."""
        answer = self.serve_fetch(request, max_records)
        if isinstance(answer, Refused) or answer[1]:
            return answer
        await self.wait_for_news(max_wait_s)
        return self.serve_fetch(request, max_records)

    @property
    def fetch_parked(self) -> bool:
        """Whether a fetch waits for news here (`wait_for_news`)."""
        news = self._news
        return news is not None and not news.done()

    async def wait_for_news(self, max_wait_s: float) -> None:
        """Return once something is appended here (or this node stops leading), or after
        `max_wait_s`: a fetch that found nothing to send waits so (a long poll)."""
        news = self._news
        if news is None or news.done():
            news = self._news = asyncio.get_running_loop().create_future()
        # asyncio.wait, not wait_for: in Python 3.11 wait_for can swallow a cancellation that
        # comes as the future completes, and a follower's loop would then never stop
        await asyncio.wait((news,), timeout=max_wait_s)

    def serve_epoch_end(self, request: EpochEndRequest) -> EpochEndAnswer | Refused:
        leader = self.leader
        if leader is None:
            return Refused(ReplicaError.NOT_LEADER)
        return leader.on_epoch_end(request)

    def _response(self, epoch: int, plan: FetchPlan, max_records: int
                  ) -> tuple[FetchResponse, list[StoredRecord]]:
        published = min(plan.end, self.log.committed_offset)
        records = self.log.read(plan.start, min(max_records, published - plan.start)) if published > plan.start else []
        end = plan.start + len(records)
        if end >= published and len(records) < max_records:
            # the rest from what is appended but not published yet (when kept from there on)
            unsynced, first = self._unsynced, self._unsynced_start
            if first <= end < first + len(unsynced):
                upto = min(plan.end, first + len(unsynced), end + max_records - len(records))
                records.extend(unsynced[end - first:upto - first])
                end = plan.start + len(records)
        epochs = tuple(entry for entry in plan.epochs if entry.start_offset < end)
        mark = self.dispatch_mark() if self.dispatch_mark is not None else None
        if mark is not None:
            mark = min(mark, plan.high_watermark)
        return FetchResponse(epoch, plan.start, end, plan.high_watermark, epochs, mark), records

    # -- commits ------------------------------------------------------------------------------

    def tick(self) -> None:
        """Let the leader look at its followers' lag (call every second or so)."""
        if self.leader is not None:
            self.leader.tick(self._clock())
            self._settle()

    def _watch_commit(self) -> None:
        waiter = self.log.commit_waiter()
        if waiter is not None and waiter is not self._watched:
            self._watched = waiter
            waiter.add_done_callback(self._on_durable)

    def _on_durable(self, waiter: asyncio.Future[None]) -> None:
        leader = self.leader
        if waiter.cancelled() or waiter.exception() is not None:
            if waiter is self._watched:
                self._watched = None
            # The journal rolled back what it had not written: those offsets will be filled
            # with empty records, which the followers would copy and count. This leader must
            # not acknowledge them: it resigns (the controller moves the shard).
            if leader is not None:
                log.error("%s: journal commit failed (%s); this node stops leading the shard",
                          self._name, "cancelled" if waiter.cancelled() else waiter.exception())
                self.resign()
                if self.gave_up is not None:
                    self.gave_up(leader)
            return
        if leader is not None:
            published = self.log.committed_offset
            unsynced = self._unsynced
            if published > self._unsynced_start:
                del unsynced[:published - self._unsynced_start]
                self._unsynced_start = published if unsynced else self.log.next_offset
            leader.durable(published, self._clock())
            self._settle()
        if self.log.commit_waiter() is not None:
            self._watch_commit()

    def _settle(self) -> None:
        leader = self.leader
        if leader is None:
            return
        for waiter, error in leader.take_completed():
            if waiter.done():
                continue
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(refusal(error, self._name))

    def _failed(self, error: ReplicaError) -> asyncio.Future[None]:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter.set_exception(refusal(error, self._name))
        # marked as seen: a reader that only waits on it (a durable cursor between two
        # leaderships) drops it, and asyncio would log it as an error never retrieved
        waiter.exception()
        return waiter

    def _wake(self) -> None:
        news, self._news = self._news, None
        if news is not None and not news.done():
            news.set_result(None)


class FollowerLog:
    """The follower's side of one shard: fetched records into the journal at the leader's
    offsets, truncation, and the durability that the next fetch reports."""

    def __init__(self, journal_log: JournalShardLog, follower: FollowerReplica,
                 replicated: ReplicatedShardLog | None = None, *,
                 failed: BaseException | None = None) -> None:
        self.log = journal_log
        self.follower = follower
        self._replicated = replicated
        self._watched: asyncio.Future[None] | None = None
        self.durable_changed = asyncio.Event()
        # why the journal could not keep what was fetched (a full disk), until `recover`;
        # set from the start when this node has just given the shard's leadership up for a
        # failed write: it fetches only once its disk takes a write again
        self.failed: BaseException | None = failed
        self.failures = 0  # failed writes in a row

    async def apply(self, action: Truncate | ResetLog | None) -> None:
        """Carry out on the journal what the follower decided (its state moved already)."""
        if action is None:
            return
        await self.log.flush()
        if isinstance(action, Truncate):
            self.log.truncate_to(action.end_offset)
            return
        # The leader's retention passed this log's end: the offsets up to its start become
        # empty records here (readers pass over them), and fetching goes on from there.
        gap = action.start_offset - self.log.next_offset
        while gap > 0:
            count = min(gap, 10_000)
            self.log.append([(0, b"")] * count)
            gap -= count
        await self.log.flush()
        self.follower.durable(self.log.committed_offset)

    def take(self, response: FetchResponse, records: Sequence[StoredRecord]) -> None:
        """The records of a fetch answer: append them where the leader has them."""
        follower = self.follower
        if not follower.accepts(response) or len(records) != response.end - response.start:
            follower.on_fetch(response)  # stale: dropped
            return
        if records:
            if self.log.next_offset != response.start:
                raise ValueError(f"{self.log.directory}: fetched records start at "
                                 f"{response.start}, the log ends at {self.log.next_offset}")
            self.log.append([(record.timestamp_ms, record.data) for record in records])
        follower.on_fetch(response)
        if self._replicated is not None:
            self._replicated.high_watermark = follower.high_watermark
            mark = response.dispatched_end
            self._replicated.dispatched_known = (
                None if mark is None else min(mark, follower.high_watermark))
        self._watch_commit()

    def refused(self, refusal: Refused) -> Truncate | ResetLog | None:
        return self.follower.on_fetch(refusal)

    def _watch_commit(self) -> None:
        waiter = self.log.commit_waiter()
        if waiter is None:
            self._durable()
        elif waiter is not self._watched:
            self._watched = waiter
            waiter.add_done_callback(self._committed)

    def _committed(self, waiter: asyncio.Future[None]) -> None:
        if waiter.cancelled() or waiter.exception() is not None:
            # the journal rolled back what it could not write: `follow` fetches it again
            self.failed = (waiter.exception() if not waiter.cancelled()
                           else StorageUnavailable(f"{self.log.directory}: commit cancelled"))
            self.durable_changed.set()
            return
        self.failures = 0
        self._durable()

    async def recover(self) -> None:
        """After a failed write: cut the log back to what it holds durably (the offsets the
        journal handed out and did not write included: here they are the leader's records,
        never empty ones) and fetch from there again."""
        with contextlib.suppress(StorageError):
            await self.log.flush()  # anything still appended is written or rolled back
        end = self.log.committed_offset
        self.log.truncate_to(end)
        self.follower.rewind(end)
        # A disk that is still full must not fetch again: a follower whose durable end is
        # the leader's (nothing new since) would be taken back into the in-sync set at its
        # first fetch, and every commit would then wait for it until it lags out again.
        await asyncio.to_thread(probe_disk, self.log.directory)
        self.failed = None

    def _durable(self) -> None:
        self.follower.durable(self.log.committed_offset)
        self.durable_changed.set()
        if self.log.commit_waiter() is not None:
            self._watch_commit()


# what `probe_disk` writes and removes: a few pages, more than a record batch's header
PROBE_BYTES = 64 * 1024


def probe_disk(directory: str | os.PathLike[str]) -> None:
    """Raise OSError unless `directory`'s file system takes (and syncs) a small write now."""
    path = os.path.join(directory, ".write-probe")
    try:
        with open(path, "wb") as probe:
            probe.write(b"\0" * PROBE_BYTES)
            probe.flush()
            os.fsync(probe.fileno())
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)


class ReplicaTransport(Protocol):
    """How a follower reaches its leader (the peer link; in tests, direct calls). A request
    that cannot be answered raises `ConnectionError` or `TimeoutError`."""

    async def epoch_end(self, leader: str, request: EpochEndRequest) -> EpochEndAnswer | Refused: ...

    async def fetch(self, leader: str, request: FetchRequest
                    ) -> tuple[FetchResponse, Sequence[StoredRecord]] | Refused: ...


async def follow(follower_log: FollowerLog, transport: ReplicaTransport, *,
                 retry_s: float = 0.2, max_retry_s: float = 10.0) -> None:
    """Follow one shard's leader until cancelled: truncate, then fetch, one request at a
    time, each sent once what the previous one brought is durable here. When the journal
    cannot write what was fetched (a full disk), the log is cut back to its durable end and
    fetched again after a pause that doubles at each failure in a row, up to `max_retry_s`:
    the follower drops out of the in-sync set meanwhile, and is back once it caught up."""
    while True:
        await asyncio.sleep(0)  # an answer that came at once must not starve the loop
        if follower_log.failed is not None:
            follower_log.failures += 1
            pause = min(retry_s * 2 ** follower_log.failures, max_retry_s)
            log.warning("%s: could not write the records fetched from %s (%s); fetching them "
                        "again in %.1f s", follower_log.log.directory, follower_log.follower.leader,
                        follower_log.failed, pause)
            await asyncio.sleep(pause)
            try:
                await follower_log.recover()
            except (StorageError, OSError) as exc:
                follower_log.failed = exc
            continue
        try:
            await _follow_step(follower_log, transport, retry_s)
        except (StorageError, OSError) as exc:
            follower_log.failed = exc


async def _follow_step(follower_log: FollowerLog, transport: ReplicaTransport,
                       retry_s: float) -> None:
    """One step of `follow`: wait, or one request and what its answer asks of the log."""
    follower = follower_log.follower
    unreachable = Refused(ReplicaError.NOT_LEADER)
    follower_log.durable_changed.clear()
    step = follower.next_request()
    if step is None:
        if follower.state is FollowerState.WAITING:
            await asyncio.sleep(retry_s)
            follower.retry()
        else:
            await follower_log.durable_changed.wait()
        return
    if isinstance(step, Truncate):
        await follower_log.apply(step)
    elif isinstance(step, EpochEndRequest):
        try:
            answer: EpochEndAnswer | Refused = await transport.epoch_end(follower.leader, step)
        except (ConnectionError, TimeoutError) as exc:
            log.debug("epoch end from %s: %s", follower.leader, exc)
            answer = unreachable
        await follower_log.apply(follower.on_epoch_end(answer))
    else:
        try:
            fetched = await transport.fetch(follower.leader, step)
        except (ConnectionError, TimeoutError) as exc:
            log.debug("fetch from %s: %s", follower.leader, exc)
            fetched = unreachable
        if isinstance(fetched, Refused):
            await follower_log.apply(follower_log.refused(fetched))
        else:
            follower_log.take(*fetched)
