"""What a journal segment is on disk, read without a `Segment`: the names of its files (the
base offset zero-padded to 20 digits, `.log`, `.index`, `.timeindex`), the walk over the framed
records of a `.log` file (each checked against its checksum, in chunked `pread`s) and the
pinning of a segment's open file around a method, and the two plain writes every journal file
uses (`write_all`, `fsync_directory`); the durable write of the commit path is `segment.py`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from functools import wraps
from pathlib import Path
from typing import Any, Final, TypeVar

from .record import CRC_START, HEADER, HEADER_SIZE, Checksum, checksum

OFFSET_DIGITS: Final = 20
LOG_SUFFIX: Final = ".log"
INDEX_SUFFIX: Final = ".index"
TIMEINDEX_SUFFIX: Final = ".timeindex"
READ_CHUNK: Final = 256 * 1024
"""Bytes per read while scanning a whole segment (recovery, index rebuild)."""

OK: Final = 0
TRUNCATED: Final = 1
BAD_CRC: Final = 2

_EMPTY: Final = memoryview(b"")


def segment_name(base_offset: int) -> str:
    return f"{base_offset:0{OFFSET_DIGITS}d}"


def parse_segment_name(filename: str) -> int | None:
    """The base offset of a `.log` file name, or None if it is not a segment file."""
    if not filename.endswith(LOG_SUFFIX):
        return None
    stem = filename[: -len(LOG_SUFFIX)]
    if len(stem) != OFFSET_DIGITS or not stem.isdigit():
        return None
    return int(stem)


def fsync_directory(directory: Path) -> None:
    """Make a file creation, rename or removal in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """os.write until every byte is written (a short write is retried, an error raised)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]



def walk(
    fd: int, start: int, limit: int, chunk: int = READ_CHUNK, crc: Checksum = checksum
) -> Iterator[tuple[int, int, int, int, memoryview]]:
    """The records of the file between byte `start` and `limit`, in order.

    Yields (status, position, offset, timestamp_ms, data). Status OK for a record whose
    checksum holds; the walk ends after yielding TRUNCATED (the file or `limit` ends inside a
    record) or BAD_CRC (a complete record whose checksum fails). `data` is a view into a read
    buffer, valid until the walk is resumed.
    """
    pos = start
    want = chunk
    unpack = HEADER.unpack_from
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
            if crc(view[p + CRC_START : end]) != stored_crc:
                yield BAD_CRC, pos + p, offset, timestamp_ms, _EMPTY
                return
            yield OK, pos + p, offset, timestamp_ms, view[p + HEADER_SIZE : end]
            p = end
        if p == have and have == asked:
            pos += p
            want = chunk
            continue
        if have < asked or pos + have >= limit:
            # The file, or the region asked for, ends inside this record.
            yield TRUNCATED, pos + p, -1, 0, _EMPTY
            return
        # A record straddles the chunk: read again from its start, large enough to hold it.
        if p == 0:
            want = max(2 * asked, HEADER_SIZE + length)
        pos += p

_F = TypeVar("_F", bound=Callable[..., Any])


def pinned(method: _F) -> _F:
    """Run `method` with the segment's file open and pinned (`handles.py`): `self.fd` is
    valid inside it."""
    @wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.file:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]
