"""A segment's keyed reads: the records whose key a reader wants, found through the key index
(`keyindex.py`, extended over what was published since) and read alone, runs of them close
together in one `pread`, each header and checksum verified. `KeyedReads` is a part of
`Segment` (`segment.py`), over its published state; it never writes.
"""

from __future__ import annotations

import logging
import os
from array import array
from bisect import bisect_right
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from ..interfaces import CorruptRecord
from .keyindex import KeyedBlock, KeyIndex
from .record import CRC_START, HEADER, HEADER_SIZE
from .segment_files import pinned
from .segment_state import SegmentState

# The segment's logger, as before this part had a module of its own.
log = logging.getLogger("shardgate.storage.journal.segment")

MERGE_GAP: Final = 16 * 1024
"""A keyed read reads wanted records at most this many bytes apart in one `pread` (copying a
gap costs less than another system call)."""
MERGE_SPAN: Final = 1024 * 1024
"""At most this many bytes per `pread` of a keyed read."""
RECORD_GUESS: Final = 4096
"""Bytes read past the last wanted record of a run (its length is not known before)."""
DENSE_SHARE: Final = 4
"""A keyed read falls back to a block scan (returns None) when at least one record in this
many of the segment's rest is wanted: reading nearly everything, a scan costs less."""


class KeyedReads(SegmentState):
    """The keyed reads of a `Segment` (over `SegmentState`)."""

    __slots__ = ()

    if TYPE_CHECKING:  # `Segment`'s (`segment.py` assembles the parts; the index's own knobs are there)
        def _extend_index(self, index: KeyIndex) -> bool: ...

    @pinned
    def read_keyed(
        self, from_offset: int, max_records: int, wants: Callable[[bytes], bool]
    ) -> KeyedBlock | None:
        """The published records from `from_offset` whose key `wants` accepts (at most
        `max_records`), read through the key index (extended first over what was published
        since: `keyindex.py`): only those records are read (runs of them close together in one
        `pread`), their headers and checksums verified (errors raised as `read` raises them).
        The block's `end_offset` says how far it covers the segment. None when the journal has
        no keys, the index cannot serve `from_offset`, or so many of the records are wanted that
        a block scan (`read_block`) costs less."""
        end_offset = self.next_offset
        if from_offset >= end_offset or max_records <= 0:
            return KeyedBlock.empty(from_offset)
        base = self.base_offset
        i = bisect_right(self.index_offsets, from_offset - base) - 1
        start_pos = self.index_positions[i] if i >= 0 else 0
        start_offset = base + self.index_offsets[i] if i >= 0 else base
        index = self.key_index
        if index is None:
            if self.key_of is None:
                return None
            index = self.key_index = KeyIndex(start_pos, start_offset)
        if start_pos < index.start:
            return None
        if index.end < self.size and not self._extend_index(index):
            self.key_index = None
            return None
        covered = index.end_offset
        if from_offset >= covered:
            return None  # the index lags this reader by more than one extension: scan
        chosen, count = index.select(wants, start_pos)
        if not count:
            return KeyedBlock.empty(covered)
        if count * DENSE_SHARE > covered - start_offset:
            return None
        # The positions from the sparse index's entry hold at most `from_offset - start_offset`
        # records below `from_offset`, read and dropped.
        positions = index.merged(chosen, max_records + from_offset - start_offset)
        block = self._read_positions(positions, from_offset)
        if count > len(positions) and len(block):
            block.end_offset = block.offsets[-1] + 1  # wanted records remain after these
        else:
            block.end_offset = covered
        return block

    def _read_positions(self, positions: list[int], from_offset: int) -> KeyedBlock:
        """The records framed at `positions` (increasing; of this segment's published part),
        those at or after `from_offset` collected into one block."""
        fd = self.fd
        size = self.size
        crc = self.crc
        unpack = HEADER.unpack_from
        parts: list[memoryview] = []
        offsets: array[int] = array("q")
        starts: array[int] = array("q")
        ends: array[int] = array("q")
        stamps: array[int] = array("q")
        length_so_far = 0
        previous = -1
        count = len(positions)
        k = 0
        while k < count:
            run_start = positions[k]
            j = k
            while (
                j + 1 < count
                and positions[j + 1] - positions[j] <= MERGE_GAP
                and positions[j + 1] - run_start < MERGE_SPAN
            ):
                j += 1
            stop = positions[j + 1] if j + 1 < count else size
            run_end = min(stop, positions[j] + RECORD_GUESS)
            view_start = run_start
            view = memoryview(os.pread(fd, run_end - run_start, run_start))
            for position in positions[k : j + 1]:
                rel = position - view_start
                if rel + HEADER_SIZE > len(view):  # the read ended inside this header
                    view_start, rel = position, 0
                    view = memoryview(os.pread(fd, max(run_end - position, HEADER_SIZE), position))
                    if len(view) < HEADER_SIZE:
                        raise CorruptRecord(f"{self.path()}: truncated record at byte {position}")
                length, stored_crc, offset, timestamp_ms = unpack(view, rel)
                end = rel + HEADER_SIZE + length
                if end > len(view):  # longer than what was read: read it whole
                    if position + HEADER_SIZE + length > size:
                        raise CorruptRecord(f"{self.path()}: truncated record at byte {position}")
                    view_start, rel, end = position, 0, HEADER_SIZE + length
                    view = memoryview(os.pread(fd, max(run_end - position, end), position))
                    if len(view) < end:
                        raise CorruptRecord(f"{self.path()}: truncated record at byte {position}")
                if offset <= previous or not self.base_offset <= offset < self.next_offset:
                    raise CorruptRecord(
                        f"{self.path()}: offset {offset} at byte {position} is out of sequence"
                    )
                if crc(view[rel + CRC_START : end]) != stored_crc:
                    raise CorruptRecord(f"{self.path()}: checksum mismatch at byte {position}")
                previous = offset
                if offset < from_offset:
                    continue
                parts.append(view[rel + HEADER_SIZE : end])
                offsets.append(offset)
                stamps.append(timestamp_ms)
                starts.append(length_so_far)
                length_so_far += length
                ends.append(length_so_far)
            k = j + 1
        return KeyedBlock(b"".join(parts), offsets, starts, ends, stamps, self.next_offset)
