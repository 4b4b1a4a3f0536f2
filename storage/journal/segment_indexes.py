"""A sealed segment's index files: the `.index` of (offset - base, byte position) pairs and
the `.timeindex` of (largest timestamp so far, offset - base) pairs, written once, atomically,
when the segment is sealed, and loaded (checked for order and bounds) when it is opened again.
`SegmentIndexFiles` is a part of `Segment` (`segment.py`), over the index arrays it keeps;
building the entries record by record is `Segment.note_record`'s.
"""

from __future__ import annotations

import os
import struct
from array import array
from typing import Final

from .segment_files import INDEX_SUFFIX, TIMEINDEX_SUFFIX, fsync_directory, write_all
from .segment_state import SegmentState

_INDEX_ENTRY: Final = struct.Struct("<II")
_TIME_ENTRY: Final = struct.Struct("<qI")


class SegmentIndexFiles(SegmentState):
    """The index files of a `Segment` (over `SegmentState`)."""

    __slots__ = ()

    def write_indexes(self) -> None:
        """Write the `.index` and `.timeindex` files atomically (temp file, fsync, rename)."""
        index = b"".join(
            _INDEX_ENTRY.pack(o, p)
            for o, p in zip(self.index_offsets, self.index_positions, strict=True)
        )
        times = b"".join(
            _TIME_ENTRY.pack(t, o) for t, o in zip(self.time_stamps, self.time_offsets, strict=True)
        )
        for suffix, content in ((INDEX_SUFFIX, index), (TIMEINDEX_SUFFIX, times)):
            final = self.path(suffix)
            temp = final.with_name(final.name + ".tmp")
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_all(fd, content)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, final)
        fsync_directory(self.directory)

    def _load_indexes(self) -> bool:
        try:
            index = self.path(INDEX_SUFFIX).read_bytes()
            times = self.path(TIMEINDEX_SUFFIX).read_bytes()
        except FileNotFoundError:
            return False
        if len(index) % _INDEX_ENTRY.size or len(times) % _TIME_ENTRY.size:
            return False
        offsets: list[int] = []
        positions: list[int] = []
        span = self.next_offset - self.base_offset
        for rel, pos in _INDEX_ENTRY.iter_unpack(index):
            if (
                (offsets and (rel <= offsets[-1] or pos <= positions[-1]))
                or rel >= span
                or pos >= self.size
            ):
                return False
            offsets.append(rel)
            positions.append(pos)
        stamps: list[int] = []
        time_offsets: list[int] = []
        for stamp, rel in _TIME_ENTRY.iter_unpack(times):
            if (stamps and stamp <= stamps[-1]) or rel >= span:
                return False
            stamps.append(stamp)
            time_offsets.append(rel)
        if span > 0 and not stamps:
            return False
        self.index_offsets, self.index_positions = array("q", offsets), array("q", positions)
        self.time_stamps, self.time_offsets = array("q", stamps), array("q", time_offsets)
        self.max_timestamp = stamps[-1] if stamps else None
        return True
