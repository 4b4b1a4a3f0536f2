"""The follower's side of one replicated shard's log on this node: the fetched records into
the journal at the leader's offsets, truncation, and the loop that fetches (`follow`; the I/O
around `replica_follower`).

`FollowerLog` carries out what the follower's state machine decides: it appends a fetch
answer's records, cuts the journal where the follower found it diverging (KIP-101), and
tells the follower how far the journal holds the log durably, which the next fetch reports.
It also tells the shard's `ReplicatedShardLog` what the leader said (the high watermark, the
dispatched mark) and where the journal was cut: what a deposed leadership of this node kept
is settled by those (`replica_deposed.py`). A follower whose journal fails a write (a full
disk) cuts its log back to its durable end and fetches again after a pause (`follow`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Protocol

from ..storage.interfaces import StorageError, StorageUnavailable, StoredRecord
from ..storage.journal import JournalShardLog
from .replica_epochs import (
    EpochEndAnswer,
    EpochEndRequest,
    FetchRequest,
    FetchResponse,
    Refused,
    ReplicaError,
)
from .replica_follower import FollowerReplica, FollowerState, ResetLog, Truncate
from .replica_log import ReplicatedShardLog

log = logging.getLogger(__name__)


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
            self._truncate_to(action.end_offset)
            return
        if self._replicated is not None:
            # what was below this log's end was never compared with the leader's log
            self._replicated.cut(0)
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
            self._replicated.learned(response.leader_epoch,
                                     min(response.high_watermark, follower.log_end))
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
        self._truncate_to(end)
        self.follower.rewind(end)
        # A disk that is still full must not fetch again: a follower whose durable end is
        # the leader's (nothing new since) would be taken back into the in-sync set at its
        # first fetch, and every commit would then wait for it until it lags out again.
        await asyncio.to_thread(probe_disk, self.log.directory)
        self.failed = None

    def _truncate_to(self, end_offset: int) -> None:
        if self._replicated is not None:
            self._replicated.truncate_to(end_offset)
        else:
            self.log.truncate_to(end_offset)

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
    the follower drops out of the in-sync set meanwhile, and is back once it caught up. Any
    other error (an answer this node cannot use, a bug) is logged with its traceback and
    handled the same way: a follower never stops following silently, which would leave the
    shard short of a replica for good."""
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
            except Exception as exc:  # noqa: BLE001 - logged; never stop following
                log.exception("%s: recovering the follower failed", follower_log.log.directory)
                follower_log.failed = exc
            continue
        try:
            await _follow_step(follower_log, transport, retry_s)
        except (StorageError, OSError) as exc:
            follower_log.failed = exc
        except Exception as exc:  # noqa: BLE001 - logged; never stop following
            log.exception("%s: following %s failed", follower_log.log.directory,
                          follower_log.follower.leader)
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
