"""A replicated shard's journal log on this node: the leader's side as the core sees it (the
I/O around `replica_leader`); the follower's side, which fills the same journal, is
`replica_follow.py`.

`ReplicatedShardLog` stands where the core expects a `ShardLog` (the broker appends to it,
durable cursors and the archiver read it). While this node leads the shard
(`lead`), an append goes to the journal and its commit future resolves when the high
watermark passes it while `min_insync_replicas` replicas are in sync (it waits while fewer
are: `replica_leader`), not when the local fsync is done; it fails with `ShardUnavailable`
when this leadership ends first, or, once this node follows, when the new leader turns out
not to hold it (`depose`, `replica_deposed.py`). Readers see only
what is below the high watermark (`deliverable_end`, `committed_offset`, `read`,
`read_block`): a record above it may still be cut by a failover, so nobody may have seen it.
Appends are refused (`NotEnoughReplicas`, `NotLeader`: both `StorageUnavailable`, which the
core answers with its retryable `ShardUnavailable`) while the leader cannot take them. A shard of one
replica, and every shard on a single node, never gets here.

The same object answers followers' fetches (`serve_fetch`, `serve_epoch_end`), and, while
this node follows, learns the leader's high watermark and dispatched mark from the fetched
answers (`replica_follow.FollowerLog`). As Kafka's leader, it sends
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
replica manager asks the controller to move the shard).

A leadership that ends while this node stays a replica (`depose`: it lost its epoch, frozen
past its lease, or moved by the controller) keeps what waits for its commit: once a fetch
answer of the new leader says its high watermark passed it, on a journal never cut below it
since (`truncate_to`), it is acknowledged; else it is refused as before (cut, or not settled
within `deposed_wait_s`). The messages of one so acknowledged are not dispatched here
(`hand_off`): the new leader dispatches what it holds. Carried into a new leadership here
instead (`lead`), it is acknowledged and dispatched as this node's own.

A node that leaves gracefully stops taking publishes for the shards it leads (`stop_taking`,
then maybe `freeze`; `replica_leader`'s graceful leave) until `handed_over`: its followers
know the high watermark it ends at. Its leaderships in a newer epoch, if any, stay so. A
drain does the same for one shard before the controller moves it, and `reopen` ends it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..core.errors import ShardUnavailable
from ..storage.interfaces import StorageUnavailable, StoredRecord
from ..storage.journal import JournalShardLog, RecordBlock
from .replica_deposed import DeposedWaiters
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
from .replica_leader import LeaderReplica

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Waiter = asyncio.Future[None]

# How long a leader that lost its epoch keeps a publish it appended and had not acknowledged,
# waiting to learn from the new leader whether that one holds it (`depose`): about a
# failover's time (the default lease), after which it is refused as before
DEPOSED_WAIT_S = 5.0


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
        # the publishes a leadership here appended and had not acknowledged when it lost its
        # epoch, kept while this node follows (`depose`, `replica_deposed.py`)
        self._deposed: DeposedWaiters[Waiter] = DeposedWaiters()
        self.deposed_wait_s = DEPOSED_WAIT_S
        # told the waiters `depose` kept that the next leader's high watermark acknowledges,
        # just before: the messages they hold are not this node's to dispatch (that leader
        # does; the replica manager's user sets it to the core's `dispatched_elsewhere`)
        self.hand_off: Callable[[list[Waiter]], None] | None = None

    # -- leadership ---------------------------------------------------------------------------

    def lead(self, leader: LeaderReplica[asyncio.Future[None]]) -> None:
        """This node leads the shard from now on, in `leader`'s epoch. What an earlier
        leadership here kept after it lost its epoch (`depose`) carries over: its records are
        in this log (never cut since), and are acknowledged once this high watermark passes
        them."""
        carried = self._deposed.take_all()
        self.resign()
        self.leader = leader
        self._closing(leader)
        self._unsynced = []
        self._unsynced_start = self.log.next_offset
        now = self._clock()
        for end, waiter in carried:
            leader.await_commit(end, waiter, now)
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
        """This node stops leading, and stops holding the shard (it is no longer a replica,
        its journal failed, it shuts down): what waits fails, retryable, and so does what
        a deposed leadership here kept (`depose`)."""
        leader = self.leader
        if leader is not None:
            self._follower_hw = leader.high_watermark
            leader.supersede()
            self._settle()
            self._stepped_down()
        self._deposed.refuse_all()
        self._settle_deposed()

    def depose(self) -> None:
        """This node stops leading and goes on holding the shard's log (it follows the new
        leader, or waits to): what waits for its commit is kept, not refused
        (`replica_deposed.py`). A fetch answer of the new leader acknowledges it once that
        leader's high watermark passes it (`learned`), unless its records are cut from this
        log first (`truncate_to`) or `deposed_wait_s` passes (`tick`): then it is refused."""
        leader = self.leader
        if leader is None:
            return
        self._follower_hw = leader.high_watermark
        waiting = leader.hand_over()
        self._settle()
        self._stepped_down()
        if waiting:
            log.info("%s: lost the leadership of epoch %d with %d commits waiting (up to offset "
                     "%d): kept until the next leader's high watermark settles them",
                     self._name, leader.epoch, len(waiting), waiting[-1][0] - 1)
            self._deposed.add(leader.epoch, waiting, self._clock() + self.deposed_wait_s)

    def _stepped_down(self) -> None:
        self.leader = None
        self._waiter = None
        self._waiter_end = -1
        self._unsynced = []
        self._wake()

    def truncate_to(self, end_offset: int) -> None:
        """Cut the journal at `end_offset` (a role change, a follower's truncation): a
        publish a deposed leadership here kept is refused if its records were cut."""
        self.log.truncate_to(end_offset)
        self.cut(end_offset)

    def cut(self, end_offset: int) -> None:
        """The journal was cut at `end_offset` (see `truncate_to`)."""
        if len(self._deposed):
            self._deposed.cut(end_offset)
            self._settle_deposed()

    def learned(self, leader_epoch: int, high_watermark: int) -> None:
        """A fetch answer from the leader of `leader_epoch`: its high watermark, bounded by
        this log's end (below which this log is now the leader's). What a deposed leadership
        here kept below it is in the shard for good: acknowledged."""
        if len(self._deposed):
            self._deposed.learned(leader_epoch, high_watermark)
            self._settle_deposed()

    @property
    def deposed_waiting(self) -> int:
        """How many publishes a deposed leadership here still keeps (`depose`)."""
        return len(self._deposed)

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

    def read_block(self, from_offset: int, max_records: int = 10_000,
                   allocate: Callable[[int], Any] | None = None) -> RecordBlock:
        end = self.committed_offset
        block = self.log.read_block(from_offset, max(0, min(max_records, end - from_offset)),
                                    allocate)
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
        """Let the leader look at its followers' lag, and refuse what a deposed leadership
        kept past `deposed_wait_s` (call every second or so)."""
        if self.leader is not None:
            self.leader.tick(self._clock())
            self._settle()
        if len(self._deposed):
            self._deposed.expire(self._clock())
            expired = self._deposed.take_completed()
            if expired:
                log.warning("%s: %d commits kept from a lost leadership were not settled by the "
                            "next leader in %.1f s: refused (retryable)", self._name, len(expired),
                            self.deposed_wait_s)
                self._resolve(expired)

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
        if leader is not None:
            self._resolve(leader.take_completed())

    def _settle_deposed(self) -> None:
        completed = self._deposed.take_completed()
        acknowledged = [waiter for waiter, error in completed if error is None and not waiter.done()]
        if acknowledged and self.hand_off is not None:
            # the new leader dispatches these records (it hands on what it holds): not here
            self.hand_off(acknowledged)
        self._resolve(completed)

    def _resolve(self, completed: list[tuple[Waiter, ReplicaError | None]]) -> None:
        for waiter, error in completed:
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
