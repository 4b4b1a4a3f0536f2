"""`RecordBlock`: consecutive records of one segment as the bytes read from the file plus
arrays of positions, for bulk readers (the archiver) that want no Python object per record.

Record i (offset `first_offset + i`) has its data at `buffer[starts[i]:ends[i]]` and its
timestamp at `timestamps[i]`; the buffer also holds the record headers (and possibly records
before `first_offset`), which bulk readers ignore. Every record's checksum was verified when the
block was read. A block also reads as a sequence of `StoredRecord`s, built on demand.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from ..interfaces import StoredRecord
from .record import HEADER_SIZE


class RecordBlock(Sequence[StoredRecord]):
    __slots__ = ("buffer", "first_offset", "starts", "ends", "timestamps")

    def __init__(
        self,
        buffer: bytes | memoryview,
        first_offset: int,
        starts: array[int],
        ends: array[int],
        timestamps: array[int],
    ) -> None:
        self.buffer = buffer
        self.first_offset = first_offset
        self.starts = starts
        self.ends = ends
        self.timestamps = timestamps

    @classmethod
    def from_scan(
        cls, buffer: bytes, first_offset: int, first_position: int, lengths: list[int]
    ) -> RecordBlock:
        """The block of the consecutive records whose data lengths are `lengths`, the first
        one framed at byte `first_position` of `buffer` (what `scan_block` collects):
        positions and timestamps computed with array kernels, not per record."""
        sizes = np.array(lengths, np.int64)
        ends = np.cumsum(sizes + HEADER_SIZE)
        ends += first_position
        starts = ends - sizes
        # a record's timestamp is the i64 just before its data (unaligned: a strided view)
        at = np.ndarray((len(buffer) - 7,), "<i8", buffer, 0, (1,))
        stamps = at[starts - 8].astype(np.int64)
        return cls(
            buffer, first_offset, array("q", starts.tobytes()), array("q", ends.tobytes()),
            array("q", stamps.tobytes()),
        )

    @classmethod
    def empty(cls, first_offset: int) -> RecordBlock:
        return cls(b"", first_offset, array("q"), array("q"), array("q"))

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def end_offset(self) -> int:
        """One past the last record's offset."""
        return self.first_offset + len(self.starts)

    def data(self, index: int) -> bytes:
        piece = self.buffer[self.starts[index] : self.ends[index]]
        return piece if type(piece) is bytes else bytes(piece)

    def size(self, index: int) -> int:
        return self.ends[index] - self.starts[index]

    @overload
    def __getitem__(self, index: int) -> StoredRecord: ...

    @overload
    def __getitem__(self, index: slice) -> RecordBlock: ...

    def __getitem__(self, index: int | slice) -> StoredRecord | RecordBlock:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self.starts))
            if step != 1:
                raise ValueError("a record block slices with step 1 only")
            return RecordBlock(
                self.buffer, self.first_offset + start, self.starts[start:stop],
                self.ends[start:stop], self.timestamps[start:stop],
            )
        if index < 0:
            index += len(self.starts)
        if not 0 <= index < len(self.starts):
            raise IndexError("record block index out of range")
        return StoredRecord(self.first_offset + index, self.timestamps[index], self.data(index))

    def __iter__(self) -> Iterator[StoredRecord]:
        for index in range(len(self.starts)):
            yield self[index]
