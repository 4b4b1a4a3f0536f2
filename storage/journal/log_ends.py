"""The ends of a journal shard log, moved on purpose: retention and deletion of the oldest
sealed segments (the low watermark), truncation of the newest records (a replica whose log
diverged from its leader's, `epochs.py`) and a new start for a log that holds nothing. Each
takes the committer's I/O lock where it touches files; none runs per record.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from .config import JournalBusy, JournalClosed
from .log_state import LogState, _Tail
from .segment import INDEX_SUFFIX, TIMEINDEX_SUFFIX, Segment, fsync_directory


class LogEnds(LogState):
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

