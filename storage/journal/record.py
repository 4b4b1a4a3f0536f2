"""Record framing of journal segment files: how one record is laid out on disk and checked.

A record is a 24-byte little-endian header followed by the data:

    length u32 | crc u32 | offset u64 | timestamp_ms i64 | data (length bytes)

`crc` is a CRC-32C (Castagnoli) of everything after it: offset, timestamp and data. The
`crc32c` package computes it (hardware accelerated where the CPU allows); without that package
the module falls back to zlib's CRC-32, a different polynomial, so a journal records in its
version file which checksum wrote it (`CHECKSUM_NAME`) and refuses to open with the other.

This module knows bytes only: no files, no offsets policy, no indexes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final

try:  # pragma: no cover - which branch runs depends on the environment
    from crc32c import crc32c as _crc

    CHECKSUM_NAME: Final = "crc32c"
except ImportError:  # pragma: no cover
    from zlib import crc32 as _crc

    CHECKSUM_NAME: Final = "crc32"  # type: ignore[misc]

HEADER: Final = struct.Struct("<IIqq")
"""length, crc, offset, timestamp_ms."""
HEADER_SIZE: Final = HEADER.size
OFFSET_TS: Final = struct.Struct("<qq")
LENGTH_CRC: Final = struct.Struct("<II")
MAX_DATA: Final = 0xFFFF_FFFF - HEADER_SIZE


def checksum(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """The record checksum of `data`, continuing from `value`."""
    return _crc(data, value)


def encode_into(buf: bytearray, offset: int, timestamp_ms: int, data: bytes) -> int:
    """Append one framed record to `buf`; returns its size in bytes."""
    tail = OFFSET_TS.pack(offset, timestamp_ms)
    buf += LENGTH_CRC.pack(len(data), _crc(data, _crc(tail)))
    buf += tail
    buf += data
    return HEADER_SIZE + len(data)


def encode(offset: int, timestamp_ms: int, data: bytes) -> bytes:
    """One framed record as bytes."""
    buf = bytearray()
    encode_into(buf, offset, timestamp_ms, data)
    return bytes(buf)


class FrameStatus:
    """Why a scan stopped (as plain ints: cheap to compare on the read path)."""

    OK = 0
    TRUNCATED = 1
    """The buffer ends inside a record (a torn tail, or simply the end of what was read)."""
    BAD_CRC = 2
    """A complete record whose checksum does not match its bytes."""


def scan(
    view: memoryview, start: int = 0, end: int | None = None
) -> Iterator[tuple[int, int, int, int, int]]:
    """Walk the complete records of `view[start:end]`.

    Yields (status, position, offset, timestamp_ms, length) for each record whose header is
    complete; a record whose data runs past `end` yields TRUNCATED and stops the walk, a record
    whose checksum fails yields BAD_CRC and stops the walk. The data of a good record is
    `view[position + HEADER_SIZE : position + HEADER_SIZE + length]`.
    """
    limit = len(view) if end is None else end
    pos = start
    unpack = HEADER.unpack_from
    while pos + HEADER_SIZE <= limit:
        length, crc, offset, timestamp_ms = unpack(view, pos)
        data_end = pos + HEADER_SIZE + length
        if data_end > limit:
            yield FrameStatus.TRUNCATED, pos, offset, timestamp_ms, length
            return
        if _crc(view[pos + HEADER_SIZE : data_end], _crc(view[pos + 8 : pos + HEADER_SIZE])) != crc:
            yield FrameStatus.BAD_CRC, pos, offset, timestamp_ms, length
            return
        yield FrameStatus.OK, pos, offset, timestamp_ms, length
        pos = data_end
