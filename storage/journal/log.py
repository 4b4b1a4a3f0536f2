"""`JournalShardLog`: one shard of the journal, a sequence of segments under one directory.

Appends assign offsets and frame records into an in-memory *group* (never touching the disk);
the group committer (`commit.py`) writes and fsyncs groups in a worker thread. Records become
*published* — readable, and their commit future resolved — once durable under the fsync
policy: `read` and `offset_for_timestamp` see published records only (offsets stay dense: a
record is published only after every lower offset). When a write or fsync fails, the shard is
rolled back to its last published state: the file is truncated there and every unpublished
group fails with StorageFull.

An offset, once handed out, never names another record: subscribers may already have seen it
(see `reservation.py`, and `deliverable_end`). The offsets of a failed commit, and after a
crash those between the recovered end and the durable reservation, are filled with *empty
records* (no data) by the next append: readers skip records whose data is empty.

Segment layout, recovery and reads are in `segment.py`; this module owns offsets, rolling,
retention and the hand-over of groups between the event loop and the worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..interfaces import StorageFull, StoredRecord
from .block import RecordBlock
from .commit import GroupCommitter, resolve
from .config import FsyncPolicy, JournalBusy, JournalClosed, JournalConfig
from .epochs import LeaderEpochCache
from .framing import frame_records
from .keyindex import KeyedBlock
from .record import checksum_function
from .reservation import OffsetReservation, read_reservation
from .segment import (
    INDEX_SUFFIX,
    TIMEINDEX_SUFFIX,
    Segment,
    fsync_directory,
    parse_segment_name,
    sync_file,
    write_all,
    write_durably,
)

log = logging.getLogger(__name__)

_NO_TIMESTAMP = -(2**63)
RESERVE_BLOCK = 16_384
"""How far beyond the next offset a reservation reaches when it is renewed: after a crash at
most about this many offsets are skipped."""
RESERVE_AHEAD = RESERVE_BLOCK // 2
"""Renew the reservation once fewer than this many offsets are left in it."""
KEYED_SEALED_SEGMENTS = 2
"""Sealed segments that may have a key index (the newest): older ones are read by scanning,
so the key indexes of a shard cover at most this many segments besides the active one."""


@dataclass(slots=True)
class _Tail:
    """Where the next appended record will land: the projected end of the active segment,
    counting groups that are buffered or in flight, and its index state there."""

    base_offset: int
    pos: int
    last_index_pos: int
    max_ts: int | None
    last_time_ts: int | None
    first_ts: int | None

    @classmethod
    def of(cls, segment: Segment) -> _Tail:
        return cls(
            segment.base_offset,
            segment.size,
            segment.index_positions[-1] if segment.index_positions else 0,
            segment.max_timestamp,
            segment.time_stamps[-1] if segment.time_stamps else None,
            segment.first_timestamp,
        )


class _Group:
    """Records appended between two commit passes, framed and ready to write."""

    __slots__ = (
        "first_offset",
        "end_offset",
        "buf",
        "start_pos",
        "end_pos",
        "segment_base",
        "roll",
        "index_offsets",
        "index_positions",
        "time_stamps",
        "time_offsets",
        "max_ts",
        "first_ts",
        "future",
        "new_segment",
        "reserve_to",
    )

    def __init__(self, first_offset: int, tail: _Tail, roll: bool) -> None:
        self.first_offset = first_offset
        self.end_offset = first_offset
        self.buf = bytearray()
        self.start_pos = tail.pos
        self.end_pos = tail.pos
        self.segment_base = tail.base_offset
        self.roll = roll
        self.index_offsets: list[int] = []
        self.index_positions: list[int] = []
        self.time_stamps: list[int] = []
        self.time_offsets: list[int] = []
        self.max_ts: int | None = tail.max_ts
        self.first_ts: int | None = tail.first_ts
        self.future: asyncio.Future[None] | None = None
        self.new_segment: Segment | None = None
        self.reserve_to = 0


class JournalShardLog:
    """A shard log on local disk (implements `ShardLog`; see the module docstring)."""

    def __init__(
        self,
        directory: Path,
        config: JournalConfig | None = None,
        committer: GroupCommitter | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.config = config or JournalConfig()
        self._owns_committer = committer is None
        self._committer = committer or GroupCommitter(self.config)
        # the journal's table of open files (`handles.py`), shared by its shard logs
        self._files = self._committer.files
        self._crc = checksum_function(self.config.checksum)
        self._key_of = self.config.index_key
        self._closed = False
        self.directory.mkdir(parents=True, exist_ok=True)
        self._segments = self._open_segments()
        self._bases = [s.base_offset for s in self._segments]
        active = self._segments[-1]
        self._next = self._committed = active.next_offset
        # Offsets below `_reserved` (durable in the reservation file) may be seen before they
        # are durable; `_reserve_target` is what the next commit pass makes durable.
        self._reservation = OffsetReservation(self.directory, self._files)
        self._reserved = read_reservation(self.directory)
        self._reserve_target = self._reserved
        # Offsets from `_hole_from` to `_next` were handed out but their records are gone (a
        # failed commit, or a crash before their fsync): the next append fills them.
        self._hole_from: int | None = None
        if self._reserved > self._next:
            log.info("%s: offsets %d..%d may have been seen before a crash; they are skipped",
                     self.directory, self._next, self._reserved - 1)
            self._hole_from = self._next
            self._next = self._reserved
        self._tail = _Tail.of(active)
        self._pending: _Group | None = None
        self._inflight: _Group | None = None
        self._unsynced: list[_Group] = []
        self._to_seal: list[Segment] = []
        self._io_segment = active
        self._broken: OSError | None = None
        self._max_pending = self.config.max_pending_bytes
        self._index_interval = self.config.index_interval_bytes
        # Which leader epoch wrote which part of the log (KIP-101); empty until a replicated
        # shard's leader assigns one.
        self.leader_epochs = LeaderEpochCache(self.directory)
        self._committer.register(self)

    def _open_segments(self) -> list[Segment]:
        bases: list[int] = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".tmp"):
                os.unlink(entry.path)  # an index file whose write was interrupted
                continue
            base = parse_segment_name(entry.name)
            if base is not None:
                bases.append(base)
        bases.sort()
        if not bases:
            return [Segment.create(self.directory, 0, self._crc, self._key_of, self._files)]
        interval = self.config.index_interval_bytes
        segments = [
            Segment.open_sealed(self.directory, base, next_base, interval, self._crc, self._key_of,
                                self._files)
            for base, next_base in zip(bases, bases[1:], strict=False)
        ]
        segments.append(
            Segment.recover_active(self.directory, bases[-1], interval, self._crc, self._key_of,
                                   self._files)
        )
        return segments

    # -- ShardLog -----------------------------------------------------------------------

    @property
    def low_watermark(self) -> int:
        return self._bases[0]

    @property
    def next_offset(self) -> int:
        """The offset the next appended record gets (appended records included)."""
        return self._next

    @property
    def committed_offset(self) -> int:
        """One past the last published record: what `read` can reach."""
        return self._committed

    @property
    def deliverable_end(self) -> int:
        """Records at offsets below this may be shown to subscribers before they are durable:
        none of these offsets will ever name another record, after a failed commit or a
        crash (the durable reservation). Offsets at or above it must wait for their commit."""
        return self._reserved

    def append(self, records: Sequence[tuple[int, bytes]]) -> int:
        """Frame `records` into the pending group; returns the first offset. No disk I/O."""
        if self._closed:
            raise JournalClosed(f"{self.directory} is closed")
        if self._broken is not None:
            raise StorageFull(f"{self.directory}: unusable until reopened: {self._broken}")
        if not records:
            return self._next
        refusing = self._committer.refusing
        if refusing is not None:
            raise StorageFull(refusing)
        if self._hole_from is not None:
            self._fill_hole(records[0][0])
        first = self._frame(records)
        if self._next + RESERVE_AHEAD > self._reserve_target:
            self._reserve_target = self._next + RESERVE_BLOCK
        return first

    def _fill_hole(self, timestamp_ms: int) -> None:
        """Frame one empty record for each offset of the hole, ahead of the next records."""
        hole_from = self._hole_from
        assert hole_from is not None
        end = self._next
        self._next = hole_from
        try:
            self._frame([(timestamp_ms, b"")] * (end - hole_from))
        except BaseException:
            self._next = end
            raise
        self._hole_from = None

    def _frame(self, records: Sequence[tuple[int, bytes]]) -> int:
        first = self._next
        saved_tail = self._tail
        group = self._pending
        created = group is None
        if group is None:
            group = self._new_group(records[0][0])
        elif len(group.buf) >= self._max_pending:
            raise StorageFull(f"{self.directory}: {len(group.buf)} bytes waiting for the disk")
        tail = self._tail
        buf = group.buf
        buf_len = len(buf)
        n_index = len(group.index_offsets)
        n_time = len(group.time_stamps)
        try:
            pos, last_index_pos, max_ts, last_time_ts = frame_records(
                buf, records, first, tail.base_offset, tail.pos, tail.last_index_pos,
                self._index_interval,
                _NO_TIMESTAMP if tail.max_ts is None else tail.max_ts,
                _NO_TIMESTAMP if tail.last_time_ts is None else tail.last_time_ts,
                group.index_offsets, group.index_positions, group.time_stamps,
                group.time_offsets, self._crc,
            )
        except Exception as exc:
            del buf[buf_len:]
            del group.index_offsets[n_index:], group.index_positions[n_index:]
            del group.time_stamps[n_time:], group.time_offsets[n_time:]
            if created:
                self._pending = None
                self._tail = saved_tail
            if isinstance(exc, struct.error):
                raise ValueError(f"record not accepted by the journal: {exc}") from exc
            raise
        offset = first + len(records)
        tail.pos = pos
        tail.last_index_pos = last_index_pos
        tail.max_ts = max_ts
        if last_time_ts != _NO_TIMESTAMP:
            tail.last_time_ts = last_time_ts
        if tail.first_ts is None:
            tail.first_ts = records[0][0]
        group.end_offset = self._next = offset
        group.end_pos = pos
        group.max_ts = max_ts
        group.first_ts = tail.first_ts
        return first

    def _new_group(self, first_timestamp: int) -> _Group:
        tail = self._tail
        config = self.config
        roll = tail.pos > 0 and (
            tail.pos >= config.segment_bytes
            or (tail.first_ts is not None and first_timestamp - tail.first_ts >= config.segment_ms)
        )
        if roll:
            tail = self._tail = _Tail(self._next, 0, 0, None, None, None)
        group = self._pending = _Group(self._next, tail, roll)
        self._committer.mark_dirty(self)
        return group

    def commit_waiter(self) -> asyncio.Future[None] | None:
        """The future of the newest group not yet durable (shared by all its appenders), or
        None when everything appended is durable. Needs a running event loop."""
        group = self._pending or self._inflight or (self._unsynced[-1] if self._unsynced else None)
        if group is None:
            return None
        if group.future is None:
            group.future = asyncio.get_running_loop().create_future()
        return group.future

    async def flush(self) -> None:
        """Wait until every record appended so far is durable (see `commit_waiter`)."""
        waiter = self.commit_waiter()
        if waiter is not None:
            await waiter

    def flush_sync(self) -> None:
        """Write and fsync everything appended so far, without an event loop (this flushes
        every log sharing the committer). Raises StorageFull when a write fails."""
        self._committer.flush_sync()

    def read(self, from_offset: int, max_records: int = 1000) -> list[StoredRecord]:
        """Published records from `from_offset` (clamped to the low watermark), in order."""
        out: list[StoredRecord] = []
        start = max(from_offset, self._bases[0])
        if start >= self._committed or max_records <= 0:
            return out
        segments = self._segments
        i = bisect_right(self._bases, start) - 1
        while i < len(segments) and len(out) < max_records:
            segment = segments[i]
            segment.read(start, max_records, out)
            start = segment.next_offset
            i += 1
        return out

    def read_block(self, from_offset: int, max_records: int = 10_000) -> RecordBlock:
        """Published records from `from_offset` (clamped to the low watermark) as one
        `RecordBlock` (one segment, one read: possibly fewer than `max_records` even when more
        are published; an empty block at the committed end). For bulk readers."""
        start = max(from_offset, self._bases[0])
        i = self._segment_for_read(start, max_records)
        if i is None:
            return RecordBlock.empty(start)
        return self._segments[i].read_block(start, min(max_records, self._committed - start))

    def read_keyed(
        self, from_offset: int, max_records: int, wants: Callable[[bytes], bool]
    ) -> KeyedBlock | None:
        """Published records from `from_offset` (clamped to the low watermark) whose key (see
        `JournalConfig.index_key`) `wants` accepts, read through the key index of one segment
        (at most `max_records`; `end_offset` says how far the block covers). None when that
        segment cannot serve it from an index (see `Segment.read_keyed`): use `read_block`."""
        start = max(from_offset, self._bases[0])
        i = self._segment_for_read(start, max_records)
        if i is None:
            return KeyedBlock.empty(start)
        segments = self._segments
        if i < len(segments) - 1 - KEYED_SEALED_SEGMENTS:
            return None
        return segments[i].read_keyed(start, min(max_records, self._committed - start), wants)

    def _segment_for_read(self, start: int, max_records: int) -> int | None:
        """Index of the segment holding published offset `start`, or None when a bulk read
        from there has nothing to return (at the committed end, nothing asked for)."""
        if start >= self._committed or max_records <= 0:
            return None
        segments = self._segments
        i = bisect_right(self._bases, start) - 1
        while i < len(segments) and start >= segments[i].next_offset:
            i += 1
        return i if i < len(segments) else None

    def offset_for_timestamp(self, timestamp_ms: int) -> int:
        """The first published offset whose timestamp is >= `timestamp_ms`, else the committed
        offset (where the next published record will be)."""
        for segment in list(self._segments):
            found = segment.offset_for_timestamp(timestamp_ms)
            if found is not None:
                return found
        return self._committed

    def delete_before(self, offset: int) -> int:
        """Delete the sealed segments whose records are all below `offset`; returns the new
        low watermark. The active segment is never deleted."""
        self._delete_while(lambda segment: segment.next_offset <= offset)
        return self._bases[0]

    def apply_retention(self, min_needed_offset: int, now_ms: int | None = None) -> int:
        """Delete the oldest sealed segments while the shard exceeds `retention_bytes` or their
        newest record is older than `retention_ms`, but never a segment holding an offset at
        or above `min_needed_offset` (what a durable cursor or the archiver still needs).
        Returns the new low watermark."""
        config = self.config
        if config.retention_bytes is None and config.retention_ms is None:
            return self._bases[0]
        now = int(time.time() * 1000) if now_ms is None else now_ms
        total = sum(segment.size for segment in self._segments)

        def expired(segment: Segment) -> bool:
            nonlocal total
            if segment.next_offset > min_needed_offset:
                return False
            by_size = config.retention_bytes is not None and total > config.retention_bytes
            by_age = (
                config.retention_ms is not None
                and segment.max_timestamp is not None
                and segment.max_timestamp < now - config.retention_ms
            )
            if by_size or by_age:
                total -= segment.size
                return True
            return False

        self._delete_while(expired)
        return self._bases[0]

    def truncate_to(self, offset: int) -> int:
        """Remove every record at `offset` and after: the next append gets `offset`. Returns
        the new end. For a replica whose log diverged from its leader's (the leader-epoch
        checkpoint says where, `epochs.py`): the caller guarantees that no reader saw those
        records (readers of a replicated shard stay below its high watermark), so unlike a
        failed commit their offsets are handed out again. Epochs starting at or after
        `offset` leave the checkpoint.

        An `offset` at or past the end changes nothing; one at or below the low watermark
        empties the log, which then starts at `offset`. Only published records can be
        truncated: raises JournalBusy while appended records wait for the disk (`await
        flush()` first), JournalClosed once closed. A crash during the call leaves the log
        ending anywhere between `offset` and the old end (and an emptied log empty, with its
        offsets below `offset` read as empty records): truncate again after the restart."""
        if self._closed:
            raise JournalClosed(f"{self.directory} is closed")
        if self._pending is not None or self._inflight is not None or self._unsynced:
            raise JournalBusy(f"{self.directory}: appended records wait for the disk; "
                              "flush before truncating")
        if offset < 0:
            raise ValueError(f"cannot truncate {self.directory} to offset {offset}")
        if offset >= self._next:
            return self._next
        with self._committer.io_lock:
            # No offset at or above `offset` is handed out any more: lower the reservation
            # first, so that a crash from here on never skips past the new end.
            self._reservation.lower(offset)
            self._reserved = self._reserve_target = offset
            self._hole_from = None
            if offset > self._committed:
                # only a hole is cut (offsets handed out but never written)
                self._hole_from = self._committed
                self._next = offset
                return offset
            self._cut_segments(offset)
        self._next = self._committed = offset
        self._tail = _Tail.of(self._segments[-1])
        self.leader_epochs.truncate_from(offset)
        return offset

    @property
    def holds_records(self) -> bool:
        """Whether the log holds a record, or has handed out an offset (appended records not
        yet written included): false for a new log, and for one whose every record
        retention deleted."""
        return self._next > self._bases[0] or len(self._segments) > 1

    def start_at(self, offset: int) -> int:
        """A log that holds no record continues at `offset`: the next append gets it. For a
        shard whose earlier records are elsewhere (the archive a previous owner, or this node
        before it lost its disk, wrote): its offsets never name two records. Returns the next
        offset; a log already at or past `offset` is left as it is. Raises JournalBusy when the
        log holds records or appended ones wait for the disk. A crash during the call leaves
        the log empty, at its old start or at `offset`."""
        if self._closed:
            raise JournalClosed(f"{self.directory} is closed")
        if offset <= self._next:
            return self._next
        if self.holds_records or self._pending is not None or self._inflight is not None:
            raise JournalBusy(f"{self.directory}: holds records; it cannot start at {offset}")
        with self._committer.io_lock:
            for segment in self._segments:
                if segment in self._to_seal:
                    self._to_seal.remove(segment)
                segment.delete_files()
            if self._io_segment not in self._segments:
                self._io_segment.close()
            fsync_directory(self.directory)
            active = Segment.create(self.directory, offset, self._crc, self._key_of, self._files)
            self._segments = [active]
            self._bases = [offset]
            self._io_segment = active
            # nothing below `offset` is this log's, nothing at or above it was handed out
            self._reservation.lower(offset)
            self._reserved = self._reserve_target = offset
            self._hole_from = None
        self._next = self._committed = offset
        self._tail = _Tail.of(active)
        return offset

    def _cut_segments(self, offset: int) -> None:
        """Delete the segments at or after `offset`, newest first (a crash leaves a prefix),
        cut the one holding it and reopen it as the active segment (I/O lock held)."""
        everything = offset <= self._bases[0]
        while self._segments and (everything or self._segments[-1].base_offset >= offset):
            segment = self._segments.pop()
            self._bases.pop()
            if segment in self._to_seal:
                self._to_seal.remove(segment)
            segment.delete_files()
        if self._io_segment not in self._segments:
            self._io_segment.close()
        if everything:
            fsync_directory(self.directory)
            active = Segment.create(self.directory, offset, self._crc, self._key_of, self._files)
        else:
            last = self._segments.pop()
            self._bases.pop()
            if last in self._to_seal:
                self._to_seal.remove(last)
            cut = last.size
            if offset < last.next_offset:
                cut = last.position_of(offset)
            last.close()
            for suffix in (INDEX_SUFFIX, TIMEINDEX_SUFFIX):
                last.path(suffix).unlink(missing_ok=True)
            os.truncate(last.path(), cut)
            fd = os.open(last.path(), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_directory(self.directory)
            active = Segment.recover_active(self.directory, last.base_offset,
                                            self._index_interval, self._crc, self._key_of,
                                            self._files)
        self._segments.append(active)
        self._bases.append(active.base_offset)
        self._io_segment = active

    def _delete_while(self, condition: Callable[[Segment], bool]) -> None:
        deleted = False
        while len(self._segments) > 1:
            segment = self._segments[0]
            if segment in self._to_seal or not condition(segment):
                break
            del self._segments[0]
            del self._bases[0]
            segment.delete_files()
            deleted = True
        if deleted:
            fsync_directory(self.directory)
            if self.leader_epochs.entries:
                self.leader_epochs.truncate_until(self._bases[0])

    def forget_caches(self) -> None:
        """Drop the segments' key indexes (`keyindex.py`): the next keyed read builds its
        segment's again from the file. Called once the broker is idle, so the index entries a
        load made do not stay in memory."""
        for segment in self._segments:
            segment.key_index = None

    def close(self) -> None:
        """Flush what was appended, then close the files. Idempotent."""
        if self._closed:
            return
        try:
            if self._owns_committer:
                self._committer.close()
            elif self._pending or self._inflight or self._unsynced:
                self._committer.flush_sync()
        finally:
            try:
                self._lower_reservation()
            finally:
                self._close_files()

    def _lower_reservation(self) -> None:
        """On close, lower the reservation to the next offset: no offset at or above it was
        handed out, so a restart after a clean stop continues without a gap."""
        if self._reserved > self._next or (
            self._reserve_target > self._next and self._reservation.exists
        ):
            try:
                self._reservation.lower(self._next)
            except OSError as exc:  # a larger reservation is still safe, only leaves a gap
                log.warning("could not lower the offset reservation of %s: %s",
                            self.directory, exc)

    def discard(self) -> None:
        """Close without flushing (the shard is being deleted): unwritten groups fail."""
        if self._closed:
            return
        self._closed = True
        self._committer.unregister(self)
        error = JournalClosed(f"{self.directory} was deleted")
        for group in (*self._unsynced, self._inflight, self._pending):
            if group is not None:
                resolve(group.future, error)
        self._unsynced, self._inflight, self._pending = [], None, None
        self._reservation.close()
        for segment in self._segments:
            segment.close()
        if self._io_segment not in self._segments:
            self._io_segment.close()
        if self._owns_committer:
            self._committer.close()

    def _close_files(self) -> None:
        self._closed = True
        self._committer.unregister(self)
        self._reservation.close()
        try:
            self._io_write_seals()
        finally:
            for segment in self._segments:
                segment.close()

    @property
    def segments(self) -> list[Segment]:
        """The published segments, oldest first (for tools and tests)."""
        return list(self._segments)

    # -- hand-over with the committer (event-loop side) ---------------------------------

    def _take_pending(self) -> _Group | None:
        group = self._pending
        if group is not None:
            self._pending = None
            self._inflight = group
            if self._reserve_target > self._reserved:
                group.reserve_to = self._reserve_target
        return group

    def _complete(self, group: _Group | None, synced: bool, error: OSError | None) -> None:
        if self._closed:
            return
        if error is not None:
            self._rollback(error, group)
            return
        if group is not None:
            self._inflight = None
            if group.reserve_to > self._reserved:
                self._reserved = group.reserve_to
            if group.new_segment is not None:
                # The roll fsynced the old segment: its unsynced groups are durable.
                self._publish_unsynced()
                old = self._segments[-1]
                old.seal()
                self._to_seal.append(old)
                self._segments.append(group.new_segment)
                self._bases.append(group.new_segment.base_offset)
                for sealed in self._segments[: -1 - KEYED_SEALED_SEGMENTS]:
                    sealed.key_index = None
            if synced or self.config.fsync is FsyncPolicy.OS:
                self._publish_unsynced()
                self._publish(group)
            else:
                self._unsynced.append(group)
        elif synced:
            self._publish_unsynced()

    def _publish_unsynced(self) -> None:
        for group in self._unsynced:
            self._publish(group)
        self._unsynced = []

    def _publish(self, group: _Group) -> None:
        segment = self._segments[-1]
        assert segment.base_offset == group.segment_base
        segment.size = group.end_pos
        segment.next_offset = group.end_offset
        segment.index_offsets.extend(group.index_offsets)
        segment.index_positions.extend(group.index_positions)
        segment.time_stamps.extend(group.time_stamps)
        segment.time_offsets.extend(group.time_offsets)
        segment.max_timestamp = group.max_ts
        if segment.first_timestamp is None:
            segment.first_timestamp = group.first_ts
        self._committed = group.end_offset
        resolve(group.future)

    def _rollback(self, error: OSError, group: _Group | None) -> None:
        failure = StorageFull(f"journal write failed in {self.directory}: {error}")
        failed = [*self._unsynced, group, self._pending]
        self._unsynced, self._inflight, self._pending = [], None, None
        self._committer.discard_dirty(self)
        # The failed offsets may have been seen: they are never handed out again but filled
        # with empty records by the next append.
        if self._next > self._committed:
            self._hole_from = self._committed
        self._tail = _Tail.of(self._segments[-1])
        for failed_group in failed:
            if failed_group is not None:
                resolve(failed_group.future, failure)

    # -- I/O (worker thread, or flush_sync's caller; the committer's I/O lock is held) ----

    def _io_write(self, group: _Group, durable: bool = False) -> None:
        """Write the group; `durable`: make it durable too, in the same call where possible
        (the file holds nothing else unsynced: the committer then skips `_io_sync`)."""
        if group.reserve_to:
            self._reservation.write(group.reserve_to)
        segment = self._io_segment
        if group.roll:
            with segment.file as fd:
                sync_file(fd)
            segment = self._io_segment = group.new_segment = Segment.create(
                self.directory, group.first_offset, self._crc, self._key_of, self._files
            )
        with segment.file as fd:
            if durable:
                write_durably(fd, group.buf, group.start_pos)
            else:
                write_all(fd, group.buf)

    def _io_sync(self) -> None:
        with self._io_segment.file as fd:
            sync_file(fd)

    def _io_undo(self) -> None:
        """Cut the files back to the last published state after a failed write or fsync."""
        durable = self._segments[-1]
        try:
            if self._io_segment is not durable:
                self._io_segment.delete_files()
                fsync_directory(self.directory)
                self._io_segment = durable
            with durable.file as fd:
                os.ftruncate(fd, durable.size)
        except OSError as exc:
            # Unpublished records stay in the file: writing the reused offsets after them
            # would let recovery prefer them to acknowledged ones. Refuse appends instead.
            log.error("could not cut %s back to byte %d: %s", self.directory, durable.size, exc)
            self._broken = exc

    def _io_write_seals(self) -> None:
        while self._to_seal:
            segment = self._to_seal[0]
            try:
                segment.write_indexes()
            except OSError as exc:
                log.warning(
                    "could not write indexes of %s (rebuilt on open): %s", segment.path(), exc
                )
            del self._to_seal[0]

    def __repr__(self) -> str:
        return (
            f"JournalShardLog({str(self.directory)!r}, low={self.low_watermark}, "
            f"committed={self._committed}, next={self._next})"
        )
