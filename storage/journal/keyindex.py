"""A segment's key index: for each record key, the byte positions of its records, so that a
reader wanting the records of a few keys reads those records and not the whole segment.

The journal stores opaque records; the key of a record is whatever the function the engine was
given (`JournalStorage(index_key=...)`) returns for its data: the broker's is a prefix of the
message's topic (`core/index_keys.py`), so a durable subscription resuming behind a busy shard
reads only the records of the topics its filters can match. Empty records (offsets the journal
skipped) have no key and are in no list.

The index lives in memory only and is never trusted over the data: it is built from the
records as they are published (the event-loop side of the shard log, with the segment's
size), rebuilt from the file when the active segment is recovered after a restart (the scan
that checks every record builds it), and every record read through it has its header and
checksum verified. Segments opened sealed at start, and sealed segments beyond the newest few,
have none: readers then scan blocks as before (`read_block`). A segment whose records have
more than `MAX_KEYS` distinct keys drops its index for the same fallback.
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
_MAX_POSITION: Final = 2**32 - 1


class KeyIndex:
    """The positions of one segment's published records, per key (see the module docstring)."""

    __slots__ = ("postings", "records")

    def __init__(self) -> None:
        self.postings: dict[bytes, array[int]] = {}
        self.records = 0

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
        self.records += 1
        return True

    def add_all(self, keys: Sequence[bytes], positions: Sequence[int]) -> bool:
        for key, position in zip(keys, positions, strict=True):
            if not self.add(key, position):
                return False
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
