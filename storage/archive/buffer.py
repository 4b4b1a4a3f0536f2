"""`RecordBuffer`: the records of one archive file being assembled, held as the journal's
record blocks (buffers plus position arrays) rather than one object per record.

It reads as a sequence of records where the archiver needs one (`buffer[0]`, `buffer[-1]`,
`len`), `parts` gives the blocks as they are to the C decoder of `build_table`, and `joined`
the Arrow view that its Python path decodes in bulk. It also carries what the archiver built
ahead from its first records (`ahead`) and the file it began encoding from them
(`encoding`), which live and die with it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..interfaces import StoredRecord
from ..journal import RecordBlock

_I64 = pa.int64()


def int64_array(values: array[int]) -> pa.Array:
    """An int64 Arrow array over an `array('q')` (no conversion per value)."""
    return pa.Array.from_buffers(_I64, len(values), [None, pa.py_buffer(values)])


class RecordBuffer:
    """Record blocks in offset order (see the module docstring)."""

    __slots__ = ("ahead", "blocks", "count", "encoding")

    def __init__(self, blocks: list[RecordBlock] | None = None) -> None:
        self.blocks: list[RecordBlock] = blocks or []
        self.count = sum(len(block) for block in self.blocks)
        self.ahead: list[Any] = []
        """The archiver's tables of this buffer's first row groups, built while it filled
        (`archiver.Ahead`): a buffer only grows at its end, so they stay its first rows."""
        self.encoding: Any = None
        """The Parquet encoding of those tables, in order, as they are built
        (`shard_state.EncodingAhead`): the file is begun before its last records are read."""

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def __getitem__(self, index: int) -> StoredRecord:
        if index < 0:
            index += self.count
        if 0 <= index < self.count:
            for block in self.blocks:
                if index < len(block):
                    return block[index]
                index -= len(block)
        raise IndexError("record buffer index out of range")

    def __iter__(self) -> Iterator[StoredRecord]:
        for block in self.blocks:
            yield from block

    def extend(self, block: RecordBlock) -> None:
        if len(block):
            self.blocks.append(block)
            self.count += len(block)

    def split(self, rows: int) -> list[RecordBuffer]:
        """The records in consecutive buffers of `rows` records (the last one may hold fewer),
        sharing this buffer's blocks (a block cut in two is sliced, not copied)."""
        parts: list[RecordBuffer] = []
        current: list[RecordBlock] = []
        room = rows
        for block in self.blocks:
            while len(block):
                piece = block if len(block) <= room else block[:room]
                current.append(piece)
                room -= len(piece)
                block = block[len(piece):] if piece is not block else block[:0]
                if room == 0:
                    parts.append(RecordBuffer(current))
                    current, room = [], rows
        if current:
            parts.append(RecordBuffer(current))
        return parts

    def parts(self) -> list[tuple[bytes | memoryview, array[int], array[int], array[int], int]]:
        """(buffer, starts, ends, timestamps, first_offset) of each block: what the C decoder
        (`decode.decode_blocks`) reads in place, without `joined`'s copy."""
        return [(block.buffer, block.starts, block.ends, block.timestamps, block.first_offset)
                for block in self.blocks]

    def joined(self, pad: int = 0) -> tuple[bytes, pa.Array, pa.Array, pa.Array, pa.Array]:
        """(buffer, starts, ends, offsets, timestamps): record i is buffer[starts[i]:ends[i]]
        (int64 arrays), the blocks' buffers joined into one (one copy), followed by `pad`
        zero bytes."""
        parts: list[bytes | memoryview] = []
        starts: list[pa.Array] = []
        ends: list[pa.Array] = []
        offsets: list[pa.Array] = []
        stamps: list[pa.Array] = []
        base = 0
        for block in self.blocks:
            parts.append(block.buffer)
            shift = pa.scalar(base, _I64)
            starts.append(pc.add(int64_array(block.starts), shift))
            ends.append(pc.add(int64_array(block.ends), shift))
            offsets.append(_arange(block.first_offset, len(block)))
            stamps.append(int64_array(block.timestamps))
            base += len(block.buffer)
        if not parts:
            empty = pa.array([], _I64)
            return bytes(pad), empty, empty, empty, empty
        if pad:
            parts.append(bytes(pad))
        return (
            bytes(parts[0]) if len(parts) == 1 else b"".join(parts),
            pa.concat_arrays(starts),
            pa.concat_arrays(ends),
            pa.concat_arrays(offsets),
            pa.concat_arrays(stamps),
        )


def _arange(first: int, n: int) -> pa.Array:
    """first, first + 1, ... (n values) as an int64 array."""
    return pa.array(np.arange(first, first + n, dtype=np.int64), _I64)
