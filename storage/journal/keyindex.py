"""A segment's key index: for each record key, the byte positions of its records, so that a
reader wanting the records of a few keys reads those records and not the whole segment.

The journal stores opaque records; the key of a record is whatever the function the engine was
given (`JournalStorage(index_key=...)`) returns for its data: the broker's is a prefix of the
message's topic (`core/index_keys.py`), so a durable subscription resuming behind a busy shard
reads only the records of the topics its filters can match. Empty records (offsets the journal
skipped) have no key and are in no list.

The index is built by its readers, not by the appends (the publish path does not pay for it):
it covers a contiguous region of the segment's published records, from where its first reader
started (an entry of the sparse offset index) to `end`, and each keyed read first extends it
over what was published since, at most `INDEX_RECORDS` records per read, from the file. It
lives in memory only and is never trusted over the data: it is made from the records on disk
(their framing and offsets checked as it goes: a record that breaks them ends the index), and
every record read through it has its header and checksum verified. A reader starting before
its region, a segment with more than `MAX_KEYS` distinct keys, and the shard's older sealed
segments are read by scanning blocks instead, as without an index.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from heapq import merge
from itertools import islice
from typing import Final, overload

from ..interfaces import StoredRecord

KeyFunction = Callable[[bytes | memoryview], bytes]
"""The key of a (non-empty) record's data."""

MAX_KEYS: Final = 4096
"""Distinct keys a segment's index holds; past it the segment is read by scanning."""
INDEX_RECORDS: Final = 4096
"""Records a keyed read adds to the index at most (then it serves what is indexed): one read
never makes the event loop index a whole segment at once."""
_MAX_POSITION: Final = 2**32 - 1


class KeyIndex:
    """The positions of the records of a region of one segment, per key (see the module
    docstring): the region starts at byte `start` (offset `start_offset`) and ends at byte
    `end` (offset `end_offset`), both at record boundaries."""

    __slots__ = ("postings", "start", "start_offset", "end", "end_offset")

    def __init__(self, start: int, start_offset: int) -> None:
        self.postings: dict[bytes, array[int]] = {}
        self.start = self.end = start
        self.start_offset = self.end_offset = start_offset

    def add(self, key: bytes, position: int) -> bool:
        """Note the record at byte `position` (after every record already noted). False when
        the index can no longer serve (too many keys, or a position past 4 GiB): drop it."""
        positions = self.postings.get(key)
        if positions is None:
            if len(self.postings) >= MAX_KEYS:
                return False
            positions = self.postings[key] = array("I")
        if position > _MAX_POSITION:
            return False
        positions.append(position)
        return True

    def select(
        self, wants: Callable[[bytes], bool], from_position: int
    ) -> tuple[list[Iterator[int]], int]:
        """Iterators over the positions at or after `from_position` of the keys `wants`
        accepts, and how many positions they hold together."""
        chosen: list[Iterator[int]] = []
        count = 0
        for key, positions in self.postings.items():
            if not wants(key):
                continue
            first = bisect_left(positions, from_position) if from_position else 0
            if first < len(positions):
                chosen.append(islice(positions, first, None))
                count += len(positions) - first
        return chosen, count

    @staticmethod
    def merged(chosen: list[Iterator[int]], limit: int) -> list[int]:
        """The first `limit` positions of the iterators together, in file order."""
        if len(chosen) == 1:
            return list(islice(chosen[0], limit))
        return list(islice(merge(*chosen), limit))


class KeyedBlock(Sequence[StoredRecord]):
    """Records of one segment read through its key index: not consecutive, so each has its
    offset (`offsets[i]`); its data is at `buffer[starts[i]:ends[i]]`, its timestamp
    `timestamps[i]`. Every offset below `end_offset` that is not in `offsets` holds a record
    the reader did not want (or an empty one): a reader that went through the block has gone
    through the shard up to `end_offset`."""

    __slots__ = ("buffer", "offsets", "starts", "ends", "timestamps", "end_offset")

    def __init__(
        self,
        buffer: bytes,
        offsets: array[int],
        starts: array[int],
        ends: array[int],
        timestamps: array[int],
        end_offset: int,
    ) -> None:
        self.buffer = buffer
        self.offsets = offsets
        self.starts = starts
        self.ends = ends
        self.timestamps = timestamps
        self.end_offset = end_offset

    @classmethod
    def empty(cls, end_offset: int) -> KeyedBlock:
        """Nothing wanted before `end_offset`."""
        return cls(b"", array("q"), array("q"), array("q"), array("q"), end_offset)

    @property
    def first_offset(self) -> int:
        return self.offsets[0] if self.offsets else self.end_offset

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, index: int) -> StoredRecord: ...

    @overload
    def __getitem__(self, index: slice) -> KeyedBlock: ...

    def __getitem__(self, index: int | slice) -> StoredRecord | KeyedBlock:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self.offsets))
            if step != 1:
                raise ValueError("a keyed block slices with step 1 only")
            return KeyedBlock(
                self.buffer, self.offsets[start:stop], self.starts[start:stop],
                self.ends[start:stop], self.timestamps[start:stop], self.end_offset,
            )
        if index < 0:
            index += len(self.offsets)
        if not 0 <= index < len(self.offsets):
            raise IndexError("keyed block index out of range")
        return StoredRecord(
            self.offsets[index], self.timestamps[index],
            self.buffer[self.starts[index] : self.ends[index]],
        )
