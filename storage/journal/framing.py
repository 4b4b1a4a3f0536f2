"""The per-record loops of the journal: framing appended records into a commit group's buffer,
and scanning a read buffer of framed records for a bulk read.

These two loops run once per record on the write path and the archiver's read path, so they
live here, typed, in a module that `pip install` compiles with mypyc (see `core/native.py`;
the journal package loads the compiled build only when it matches this source). Everything
else about records (the layout, `record.py`; offsets, groups and indexes, `log.py`; files and
errors, `segment.py`) stays in plain Python. The record layout is the one `record.py`
documents: `length u32 | crc u32 | offset u64 | timestamp_ms i64 | data`, the checksum over
everything after the crc. Only the standard library is imported, as the compiled build needs.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from types import FunctionType
from typing import Final

_HEADER_SIZE: Final = 24
_CRC_START: Final = 8
_OFFSET_TS: Final = struct.Struct("<qq")
_LENGTH_CRC: Final = struct.Struct("<II")
_LENGTH_CRC_OFFSET: Final = struct.Struct("<IIq")

SCAN_OK: Final = 0
"""`scan_block` ended normally (the buffer, the records wanted or the segment's end)."""
SCAN_BAD_OFFSET: Final = 1
"""`scan_block` found a record whose offset breaks the sequence."""
SCAN_BAD_CRC: Final = 2
"""`scan_block` found a wanted record whose checksum fails."""


def frame_records(
    buf: bytearray,
    records: Sequence[tuple[int, bytes]],
    offset: int,
    base: int,
    pos: int,
    last_index_pos: int,
    interval: int,
    max_ts: int,
    last_time_ts: int,
    index_offsets: list[int],
    index_positions: list[int],
    time_stamps: list[int],
    time_offsets: list[int],
    crc: Callable[[bytes], int],
) -> tuple[int, int, int, int]:
    """Frame `records` ((timestamp_ms, data) pairs) at offsets `offset`, `offset + 1`, ...
    onto the end of `buf`, the first at byte `pos` of the segment whose base offset is `base`.

    Follows the sparse-index rule of `Segment.note_record`: an index entry (and a time-index
    entry when the largest timestamp grew) for the record at the first position at least
    `interval` bytes after the last indexed one, appended to the four lists. Returns the new
    (pos, last_index_pos, max_ts, last_time_ts). Raises struct.error for a value the layout
    cannot hold (the caller then cuts `buf` and the lists back).
    """
    pack_tail = _OFFSET_TS.pack
    pack_head = _LENGTH_CRC.pack
    for timestamp_ms, data in records:
        size = len(data)
        framed = pack_tail(offset, timestamp_ms) + data
        buf += pack_head(size, crc(framed))
        buf += framed
        if timestamp_ms > max_ts:
            max_ts = timestamp_ms
        if pos - last_index_pos >= interval:
            last_index_pos = pos
            index_offsets.append(offset - base)
            index_positions.append(pos)
            if max_ts > last_time_ts:
                last_time_ts = max_ts
                time_stamps.append(max_ts)
                time_offsets.append(offset - base)
        pos += _HEADER_SIZE + size
        offset += 1
    return pos, last_index_pos, max_ts, last_time_ts


def scan_block(
    buf: bytes,
    from_offset: int,
    want: int,
    end_offset: int,
    crc: Callable[[bytes], int],
    lengths: list[int],
) -> tuple[int, int, int, int]:
    """Walk the framed records at the start of `buf` (a read from a segment file), collecting
    the data length of each record at or after `from_offset` (its checksum verified) until
    `want` are collected, the record before `end_offset` is, or `buf` ends inside a record.
    The records collected are consecutive, so their positions and timestamps follow from the
    lengths and the first one's position (`RecordBlock.from_scan`, with array kernels): the
    loop boxes no position and no timestamp, and a length under 257 is a cached int.

    Returns (status, p, a, b):
    - SCAN_OK: `p` is where the first record collected starts, or when none was, where the
      walk stopped (the start of the first record `buf` does not hold whole); `a` the offset
      expected next (-1 if none was seen), `b` the length of the record where the walk
      stopped when `buf` ends inside it;
    - SCAN_BAD_OFFSET: the record at byte `p` has offset `a` where `b` was expected;
    - SCAN_BAD_CRC: the record at byte `p` (offset `a`) fails its checksum.
    """
    if _COMPILED:
        return _scan_indexed(buf, from_offset, want, end_offset, crc, lengths)
    return _scan_unpacked(buf, from_offset, want, end_offset, crc, lengths)


# Two versions of one loop: compiled, reading the header's integers byte by byte is several
# times cheaper than a struct call; interpreted, one struct call per header is. `scan_block`
# runs the one that suits how this module was loaded; the tests run both.


def _u32(buf: bytes, p: int) -> int:
    return buf[p] | (buf[p + 1] << 8) | (buf[p + 2] << 16) | (buf[p + 3] << 24)


def _i64(buf: bytes, p: int) -> int:
    value = _u32(buf, p) | (_u32(buf, p + 4) << 32)
    return value - (1 << 64) if value >= (1 << 63) else value


def _scan_indexed(
    buf: bytes,
    from_offset: int,
    want: int,
    end_offset: int,
    crc: Callable[[bytes], int],
    lengths: list[int],
) -> tuple[int, int, int, int]:
    have = len(buf)
    p = 0
    length = 0
    expected = -1
    first = -1
    while p + _HEADER_SIZE <= have:
        length = _u32(buf, p)
        end = p + _HEADER_SIZE + length
        if end > have:
            break
        offset = _i64(buf, p + 8)
        if offset != expected and expected >= 0:
            return SCAN_BAD_OFFSET, p, offset, expected
        expected = offset + 1
        if offset >= from_offset:
            if crc(buf[p + _CRC_START : end]) != _u32(buf, p + 4):
                return SCAN_BAD_CRC, p, offset, 0
            if first < 0:
                first = p
            lengths.append(length)
            if len(lengths) >= want or expected >= end_offset:
                return SCAN_OK, first, expected, 0
        p = end
    return SCAN_OK, p if first < 0 else first, expected, length


def _scan_unpacked(
    buf: bytes,
    from_offset: int,
    want: int,
    end_offset: int,
    crc: Callable[[bytes], int],
    lengths: list[int],
) -> tuple[int, int, int, int]:
    unpack = _LENGTH_CRC_OFFSET.unpack_from
    have = len(buf)
    p = 0
    length = 0
    expected = -1
    first = -1
    while p + _HEADER_SIZE <= have:
        length, stored_crc, offset = unpack(buf, p)
        end = p + _HEADER_SIZE + length
        if end > have:
            break
        if offset != expected and expected >= 0:
            return SCAN_BAD_OFFSET, p, offset, expected
        expected = offset + 1
        if offset >= from_offset:
            if crc(buf[p + _CRC_START : end]) != stored_crc:
                return SCAN_BAD_CRC, p, offset, 0
            if first < 0:
                first = p
            lengths.append(length)
            if len(lengths) >= want or expected >= end_offset:
                return SCAN_OK, first, expected, 0
        p = end
    return SCAN_OK, p if first < 0 else first, expected, length


_COMPILED: Final = not isinstance(_u32, FunctionType)
"""Whether this module runs compiled (its functions are then not Python functions)."""
