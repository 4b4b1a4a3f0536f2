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
`JournalShardLog` is assembled from parts over `LogState` (`log_state.py`): `log_ends.py`
(retention, deletion, truncation, a new start) and `log_handover.py` (the hand-over's
event-loop side); appends, reads and the worker thread's I/O are here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from bisect import bisect_right
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..interfaces import StorageFull, StoredRecord
from .block import RecordBlock
from .commit import GroupCommitter, resolve
from .config import JournalClosed, JournalConfig
from .epochs import LeaderEpochCache
from .framing import frame_records
from .keyindex import KeyedBlock
from .log_ends import LogEnds
from .log_handover import CommitHandover
from .log_state import KEYED_SEALED_SEGMENTS, LogState, _Group, _Tail
from .record import checksum_function
from .reservation import OffsetReservation, read_reservation
from .segment import (
    Segment,
    fsync_directory,
    parse_segment_name,
    sync_file,
    write_all,
    write_durably,
)

__all__ = ["KEYED_SEALED_SEGMENTS", "JournalShardLog", "LogState", "_Group", "_Tail"]

log = logging.getLogger(__name__)

_NO_TIMESTAMP = -(2**63)
RESERVE_BLOCK = 16_384
"""How far beyond the next offset a reservation reaches when it is renewed: after a crash at
most about this many offsets are skipped."""
RESERVE_AHEAD = RESERVE_BLOCK // 2
"""Renew the reservation once fewer than this many offsets are left in it."""

class JournalShardLog(LogEnds, CommitHandover):
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
        """Wait until every record appended so far is durable (see `commit_waiter`). A flush
        cancelled meanwhile leaves the group's future alone: its other appenders wait on it
        (a replica leading the log next would otherwise take the group for a failed one)."""
        waiter = self.commit_waiter()
        if waiter is not None:
            await asyncio.shield(waiter)

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

    def read_block(self, from_offset: int, max_records: int = 10_000,
                   allocate: Callable[[int], Any] | None = None) -> RecordBlock:
        """Published records from `from_offset` (clamped to the low watermark) as one
        `RecordBlock` (one segment, one read: possibly fewer than `max_records` even when more
        are published; an empty block at the committed end). For bulk readers; `allocate`:
        see `Segment.read_block`."""
        start = max(from_offset, self._bases[0])
        i = self._segment_for_read(start, max_records)
        if i is None:
            return RecordBlock.empty(start)
        return self._segments[i].read_block(start, min(max_records, self._committed - start),
                                            allocate=allocate)

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
