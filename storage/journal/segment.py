"""One journal segment: a `.log` file of framed records beside its sparse `.index` and
`.timeindex`, after Kafka's log segments.

Files are named by the segment's base offset, zero-padded to 20 digits. The `.index` holds
(offset - base, byte position) pairs, one every `index_interval_bytes` of records; the
`.timeindex` holds (largest timestamp so far, offset - base) pairs written at the same points
whenever the largest timestamp grew, so that every record at or below such an offset has a
timestamp at or below it. Both index files are written once, atomically, when the segment is
sealed; the active segment keeps its indexes in memory and rebuilds them on recovery.

A `Segment` holds only what is *published* (durable and visible to readers): its `size`,
`next_offset` and index lists change only through `publish`, on the thread that reads. The
commit machinery writes bytes ahead of that (see `log.py`). This module never decides when to
roll, fsync or delete: the shard log does.

`Segment` is assembled from parts over `SegmentState` (`segment_state.py`: its slots and
files): `segment_indexes.py` (the index files), `segment_keyed.py` (keyed reads);
`segment_files.py` names the files, walks their records and holds the plain writes
(`write_all`, `fsync_directory`). The durable write of the commit path (`write_durably`,
`sync_file`) is here. Every name is importable from here as before.
"""

from __future__ import annotations

import errno
import logging
import os
from array import array
from bisect import bisect_right
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from ...core.native import load_c_extension
from ..interfaces import CorruptRecord, StoredRecord
from .block import RecordBlock
from .framing import SCAN_BAD_CRC, SCAN_BAD_OFFSET, scan_block
from .handles import OpenFiles, default_files
from .keyindex import INDEX_RECORDS, KeyFunction, KeyIndex
from .record import CRC_START, HEADER, HEADER_SIZE, Checksum, checksum, checksum_function
from .segment_files import (
    BAD_CRC,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    OFFSET_DIGITS,
    OK,
    READ_CHUNK,
    TIMEINDEX_SUFFIX,
    TRUNCATED,
    fsync_directory,
    parse_segment_name,
    pinned,
    segment_name,
    walk,
    write_all,
)
from .segment_indexes import SegmentIndexFiles
from .segment_keyed import DENSE_SHARE, MERGE_GAP, MERGE_SPAN, RECORD_GUESS, KeyedReads

__all__ = [
    "BAD_CRC", "BLOCK_CHUNK", "DENSE_SHARE", "FETCH_CHUNK", "INDEX_SUFFIX", "LOG_SUFFIX",
    "MERGE_GAP", "MERGE_SPAN", "OFFSET_DIGITS", "OK", "READ_CHUNK", "RECORD_GUESS",
    "TIMEINDEX_SUFFIX", "TRUNCATED", "Segment", "fsync_directory", "parse_segment_name",
    "segment_name", "sync_file", "walk", "write_all", "write_durably",
]

log = logging.getLogger(__name__)

FETCH_CHUNK: Final = 32 * 1024
"""Bytes per read while serving `read` (a few index intervals: most reads want few records)."""
BLOCK_CHUNK: Final = 1024 * 1024
"""Bytes per read while serving `read_block` (bulk readers want many records)."""

_scan_native: Any = load_c_extension(
    "shardgate.storage.journal.scan_native", os.path.dirname(__file__)
)
"""`scan_native.c` when built from the source present: `read_block`'s scan in C, without the
GIL (None: `framing.scan_block` serves)."""


def _native_checksums() -> dict[Checksum, str]:
    """The checksum functions whose records the C scan verifies itself, by its name for them."""
    if _scan_native is None:
        return {}
    names: dict[Checksum, str] = {}
    for name in ("crc32c", "crc32"):
        try:
            names[checksum_function(name)] = name
        except LookupError:  # pragma: no cover - the `crc32c` package is missing
            pass
    return names


_NATIVE_CHECKSUMS: Final = _native_checksums()


def sync_file(fd: int) -> None:
    """fdatasync where the platform has it (size changes included), fsync elsewhere."""
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:  # pragma: no cover - macOS
        os.fsync(fd)


_RWF_DSYNC: Final = getattr(os, "RWF_DSYNC", 0)
_durable_writes = bool(_RWF_DSYNC) and hasattr(os, "pwritev")
"""Whether `write_durably` uses one pwritev2(RWF_DSYNC) call (Linux 4.7+); cleared when the
kernel or file system refuses the flag."""


def write_durably(
    fd: int, data: bytes | bytearray | memoryview, position: int, appending: bool = True
) -> None:
    """Write all of `data` at `position` and make it durable as a write and `sync_file` would,
    where the platform allows in ONE system call per write (pwritev2 with RWF_DSYNC): the
    committer's worker thread then leaves and retakes the GIL once instead of twice, which
    matters while the event loop keeps it busy. `appending`: `fd` is an O_APPEND file and
    `position` its end (the fallback then uses `write_all`, else pwrite). Falls back to
    write + fdatasync."""
    global _durable_writes
    view = memoryview(data)
    if _durable_writes:
        try:
            while view:
                written = os.pwritev(fd, [view], position, _RWF_DSYNC)
                view = view[written:]
                position += written
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            _durable_writes = False  # refused before writing anything: never again
            log.info("pwritev2(RWF_DSYNC) is not supported here (%s); using fdatasync", exc)
    if appending:
        write_all(fd, view)
    else:
        while view:
            written = os.pwrite(fd, view, position)
            view = view[written:]
            position += written
    sync_file(fd)


class Segment(SegmentIndexFiles, KeyedReads):
    """A segment file and its published state (see the module docstring). Its file is open
    only while used or recently used (`handles.py`): `fd` is valid inside `with self.file`."""

    __slots__ = ()

    @classmethod
    def create(
        cls, directory: Path, base_offset: int, crc: Checksum = checksum,
        key_of: KeyFunction | None = None, files: OpenFiles | None = None,
    ) -> Segment:
        """A new, empty segment file (durable in its directory when this returns)."""
        path = directory / f"{segment_name(base_offset)}{LOG_SUFFIX}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        try:
            fsync_directory(directory)
        except BaseException:
            os.close(fd)
            raise
        file = (default_files() if files is None else files).handle(path, os.O_RDWR | os.O_APPEND, fd)
        return cls(directory, base_offset, file, crc, key_of)

    @classmethod
    def open_sealed(
        cls,
        directory: Path,
        base_offset: int,
        next_offset: int,
        index_interval_bytes: int,
        crc: Checksum = checksum,
        key_of: KeyFunction | None = None,
        files: OpenFiles | None = None,
    ) -> Segment:
        """A sealed segment: its indexes come from its index files, rebuilt when missing or
        inconsistent. Its records are not checksummed here (reads do). Its file is opened
        when first read."""
        path = directory / f"{segment_name(base_offset)}{LOG_SUFFIX}"
        file = (default_files() if files is None else files).handle(path, os.O_RDONLY)
        segment = cls(directory, base_offset, file, crc, key_of)
        try:
            segment.size = os.stat(path).st_size
            segment.next_offset = next_offset
            segment.sealed = True
            if not segment._load_indexes():
                log.info("rebuilding indexes of %s", segment.path())
                segment._rebuild_indexes(index_interval_bytes)
                try:
                    segment.write_indexes()
                except OSError as exc:  # the in-memory indexes are enough to serve reads
                    log.warning("could not write indexes of %s: %s", segment.path(), exc)
        except BaseException:
            file.close()
            raise
        return segment

    @classmethod
    def recover_active(
        cls, directory: Path, base_offset: int, index_interval_bytes: int, crc: Checksum = checksum,
        key_of: KeyFunction | None = None, files: OpenFiles | None = None,
    ) -> Segment:
        """The last segment after a restart: every record is checked, a torn or corrupt tail
        is cut off (the file truncated), and the indexes are rebuilt in memory."""
        path = directory / f"{segment_name(base_offset)}{LOG_SUFFIX}"
        file = (default_files() if files is None else files).handle(path, os.O_RDWR | os.O_APPEND)
        segment = cls(directory, base_offset, file, crc, key_of)
        try:
            with file as fd:
                file_size = os.fstat(fd).st_size
                good_end = segment._rebuild_indexes(index_interval_bytes, limit=file_size)
                if good_end < file_size:
                    log.warning(
                        "%s: cutting %d bytes of torn or corrupt tail at byte %d",
                        path,
                        file_size - good_end,
                        good_end,
                    )
                    os.ftruncate(fd, good_end)
                    os.fsync(fd)
            for suffix in (INDEX_SUFFIX, TIMEINDEX_SUFFIX):
                segment.path(suffix).unlink(missing_ok=True)
        except BaseException:
            file.close()
            raise
        return segment

    def seal(self) -> None:
        """Mark the segment sealed and close its time index with its largest timestamp."""
        self.sealed = True
        if self.max_timestamp is not None and (
            not self.time_stamps or self.time_stamps[-1] < self.max_timestamp
        ):
            self.time_stamps.append(self.max_timestamp)
            self.time_offsets.append(self.next_offset - 1 - self.base_offset)

    def close(self) -> None:
        self.file.close()

    def delete_files(self) -> None:
        self.close()
        for suffix in (LOG_SUFFIX, INDEX_SUFFIX, TIMEINDEX_SUFFIX):
            self.path(suffix).unlink(missing_ok=True)

    # -- indexes ------------------------------------------------------------------------

    @pinned
    def _rebuild_indexes(self, interval: int, limit: int | None = None) -> int:
        """Scan the records from byte 0, rebuilding the indexes, size and next offset.

        With `limit` (recovery of the active segment) the scan stops at the first record that
        is torn, fails its checksum or breaks the offset sequence, and returns where it
        stopped. Without it (a sealed segment) the scan covers the whole file but stops
        indexing at such a record; reads will report it as CorruptRecord.
        """
        end = self.size if limit is None else limit
        self.index_offsets, self.index_positions = array("q"), array("q")
        self.time_stamps, self.time_offsets = array("q"), array("q")
        self.max_timestamp = self.first_timestamp = None
        expected = self.base_offset
        good_end = 0
        for status, pos, offset, timestamp_ms, data in walk(self.fd, 0, end, crc=self.crc):
            if status != OK or offset != expected:
                break
            self.note_record(offset - self.base_offset, timestamp_ms, pos, interval)
            expected += 1
            good_end = pos + HEADER_SIZE + len(data)
        if limit is not None:
            self.size = good_end
            self.next_offset = expected
        elif self.sealed:
            self.seal()
        return good_end

    def note_record(self, rel_offset: int, timestamp_ms: int, pos: int, interval: int) -> None:
        """Account one record at `pos` in the indexes (the rule `log.py` also follows when it
        projects index entries for records still in flight)."""
        if self.first_timestamp is None:
            self.first_timestamp = timestamp_ms
        if self.max_timestamp is None or timestamp_ms > self.max_timestamp:
            self.max_timestamp = timestamp_ms
        last_pos = self.index_positions[-1] if self.index_positions else 0
        if pos - last_pos >= interval:
            self.index_offsets.append(rel_offset)
            self.index_positions.append(pos)
            if not self.time_stamps or self.max_timestamp > self.time_stamps[-1]:
                self.time_stamps.append(self.max_timestamp)
                self.time_offsets.append(rel_offset)

    # -- reads --------------------------------------------------------------------------

    def position_for(self, offset: int) -> int:
        """The byte position of the last indexed record at or before `offset`."""
        i = bisect_right(self.index_offsets, offset - self.base_offset) - 1
        return self.index_positions[i] if i >= 0 else 0

    @pinned
    def position_of(self, offset: int) -> int:
        """The byte position where the published record `offset` starts (scanned from the
        index entry before it). Raises CorruptRecord when the file does not hold it there."""
        for status, pos, found, _timestamp, _data in walk(
            self.fd, self.position_for(offset), self.size, FETCH_CHUNK, self.crc
        ):
            if status != OK:
                break
            if found == offset:
                return pos
        raise CorruptRecord(f"{self.path()}: record {offset} not found")

    @pinned
    def read(self, from_offset: int, max_records: int, out: list[StoredRecord]) -> None:
        """Append to `out` the published records from `from_offset` until `max_records` are
        in `out` or the segment ends.

        Raises CorruptRecord, naming the file and byte position, on a returned record that
        fails its checksum, on a record that is torn or breaks the offset sequence inside the
        published region, and when the file ends before the offsets the segment must hold.
        Records skipped on the way (below `from_offset`) have their framing and offsets
        checked, not their checksums. (This is `walk` inlined: it is the consumer hot path.)
        """
        end_offset = self.next_offset
        if from_offset >= end_offset or len(out) >= max_records:
            return
        fd = self.fd
        limit = self.size
        pos = self.position_for(from_offset)
        want = FETCH_CHUNK
        expected = -1
        unpack = HEADER.unpack_from
        crc = self.crc
        append = out.append
        while pos < limit:
            asked = min(want, limit - pos)
            buf = os.pread(fd, asked, pos)
            have = len(buf)
            view = memoryview(buf)
            p = 0
            length = 0
            while p + HEADER_SIZE <= have:
                length, stored_crc, offset, timestamp_ms = unpack(view, p)
                end = p + HEADER_SIZE + length
                if end > have:
                    break
                if offset != expected and expected >= 0:
                    raise CorruptRecord(
                        f"{self.path()}: offset {offset} where {expected} was expected "
                        f"at byte {pos + p}"
                    )
                if offset >= from_offset:
                    if crc(view[p + CRC_START : end]) != stored_crc:
                        raise CorruptRecord(f"{self.path()}: checksum mismatch at byte {pos + p}")
                    append(StoredRecord(offset, timestamp_ms, buf[p + HEADER_SIZE : end]))
                    if len(out) >= max_records or offset + 1 >= end_offset:
                        return
                expected = offset + 1
                p = end
            if p == have and have == asked:
                pos += p
                want = FETCH_CHUNK
                continue
            if have < asked or pos + have >= limit:
                raise CorruptRecord(f"{self.path()}: truncated record at byte {pos + p}")
            if p == 0:  # one record larger than the chunk: read it whole
                want = max(2 * asked, HEADER_SIZE + length)
            pos += p
        raise CorruptRecord(
            f"{self.path()}: no record for offset {from_offset if expected < 0 else expected}"
            f" before the end of the segment (byte {self.size}); offsets up to "
            f"{self.next_offset - 1} belong here"
        )

    @pinned
    def read_block(self, from_offset: int, max_records: int, chunk: int = BLOCK_CHUNK,
                   allocate: Callable[[int], Any] | None = None) -> RecordBlock:
        """The published records from `from_offset` (at most `max_records`) that one read of
        about `chunk` bytes holds (more when a single record is larger), as one buffer and
        arrays of positions: no Python object per record. Checksums are verified; errors
        are raised as `read` raises them. The scan runs in C without the GIL (`scan_native.c`)
        when it is built and knows the segment's checksum, else `framing.scan_block` runs.

        With `allocate` (and the C scan), the bytes are read into `allocate(size)` (a writable
        buffer) instead of a new `bytes`: the block's buffer is then a memoryview of it. Fresh
        memory costs a page fault per 4 KiB page touched (about 3 us each on a virtual machine:
        a tenth of the archiver's time), while an allocator such as Arrow's pool hands a bulk
        reader back the pages it freed."""
        end_offset = self.next_offset
        if from_offset >= end_offset or max_records <= 0:
            return RecordBlock.empty(from_offset)
        lengths: list[int] = []
        crc = self.crc
        native = _NATIVE_CHECKSUMS.get(crc)  # the C scan's name for it, when it knows it
        pos = self.position_for(from_offset)
        # Read no further than the first indexed record after the last one wanted (when the
        # index knows one): a block then holds little besides the records asked for.
        after = bisect_right(self.index_offsets, from_offset + max_records - 1 - self.base_offset)
        if after < len(self.index_positions) and self.index_positions[after] > pos:
            want = min(chunk, self.index_positions[after] - pos)
        else:
            want = chunk
        while True:
            asked = min(want, self.size - pos)
            if asked <= 0:
                break
            buf: bytes | memoryview
            if native is not None and allocate is not None:
                view = memoryview(allocate(asked)).cast("B")
                buf = view[:os.preadv(self.fd, [view], pos)]
            else:
                buf = os.pread(self.fd, asked, pos)
            if native is not None:
                status, p, found, other, starts, ends, stamps = _scan_native.scan_block(
                    buf, from_offset, max_records, end_offset, native
                )
                taken = 0 if starts is None else len(starts)
            else:
                assert isinstance(buf, bytes)
                status, p, found, other = scan_block(
                    buf, from_offset, max_records, end_offset, crc, lengths
                )
                taken = len(lengths)
            if status == SCAN_BAD_OFFSET:
                raise CorruptRecord(
                    f"{self.path()}: offset {found} where {other} was expected at byte {pos + p}"
                )
            if status == SCAN_BAD_CRC:
                raise CorruptRecord(f"{self.path()}: checksum mismatch at byte {pos + p}")
            if taken:
                first = found - taken  # `found`: the offset after the last one taken
                if first != from_offset:
                    raise CorruptRecord(
                        f"{self.path()}: offset {first} where {from_offset} was expected"
                    )
                if native is not None:
                    return RecordBlock(buf, first, starts, ends, stamps)
                assert isinstance(buf, bytes)
                return RecordBlock.from_scan(buf, first, p, lengths)
            if len(buf) < asked or pos + asked >= self.size:
                break  # the published region ends inside a record (its length is corrupt)
            if p == 0:  # one record larger than the chunk: read it whole (`other`: its length)
                want = max(2 * asked, HEADER_SIZE + other)
            else:  # only records before from_offset in this chunk: go on after them
                pos += p
        raise CorruptRecord(
            f"{self.path()}: no record for offset {from_offset} before the end of the segment "
            f"(byte {self.size}); offsets up to {self.next_offset - 1} belong here"
        )

    @pinned
    def offset_for_timestamp(self, timestamp_ms: int) -> int | None:
        """The first published offset in this segment with a timestamp >= `timestamp_ms`."""
        if self.max_timestamp is None or self.max_timestamp < timestamp_ms:
            return None
        i = bisect_right(self.time_stamps, timestamp_ms - 1) - 1
        start = self.base_offset + (self.time_offsets[i] + 1 if i >= 0 else 0)
        position = self.position_for(start)
        for status, pos, offset, stamp, _data in walk(
            self.fd, position, self.size, FETCH_CHUNK, self.crc
        ):
            if status != OK:
                reason = "checksum mismatch" if status == BAD_CRC else "truncated record"
                raise CorruptRecord(f"{self.path()}: {reason} at byte {pos}")
            if offset >= start and stamp >= timestamp_ms:
                return offset
        return None

    def _extend_index(self, index: KeyIndex) -> bool:
        """Add the published records after `index.end` to the index, at most `INDEX_RECORDS`;
        False when a record breaks the framing or the offset sequence, or the index cannot
        hold a key (the index is then dropped: reads scan, and report what is wrong)."""
        key_of = self.key_of
        assert key_of is not None
        fd = self.fd
        limit = self.size
        unpack = HEADER.unpack_from
        pos = index.end
        expected = index.end_offset
        budget = INDEX_RECORDS
        want = READ_CHUNK
        while pos < limit and budget > 0:
            asked = min(want, limit - pos)
            buf = os.pread(fd, asked, pos)
            view = memoryview(buf)
            have = len(buf)
            p = 0
            length = 0
            while p + HEADER_SIZE <= have and budget > 0:
                length, _crc, offset, _timestamp = unpack(view, p)
                end = p + HEADER_SIZE + length
                if end > have:
                    break
                if offset != expected:
                    log.warning("%s: offset %d at byte %d where %d was expected; not indexed",
                                self.path(), offset, pos + p, expected)
                    return False
                if length and not index.add(key_of(view[p + HEADER_SIZE : end]), pos + p):
                    return False
                expected += 1
                budget -= 1
                p = end
            if p == 0:
                if have < asked or asked >= limit - pos:
                    return False  # the published region ends inside a record
                want = max(2 * asked, HEADER_SIZE + length)  # one record larger than the read
                continue
            pos += p
            want = READ_CHUNK
            index.end, index.end_offset = pos, expected
        return True
