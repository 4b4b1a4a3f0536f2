"""The offset reservation of a shard log: a small durable file naming an offset that the log
will never hand out again, even after a crash.

Subscribers get a reliable message as soon as it is appended, before its commit group is
durable (the publisher's acknowledgement still waits for the fsync). An offset a subscriber has
seen must never name another message later; the log keeps that promise for offsets below its
durable reservation:
- a failed commit does not hand its offsets out again (the log fills them with empty records);
- after a crash, the log's next offset is at least the reservation, so offsets that were seen
  but never made durable are skipped (and filled with empty records) rather than reused.

The file `offsets.reserved` holds two 16-byte slots, each `value u64 | crc32 u32 | 4 zero
bytes`, written alternately, so a write torn by a crash always leaves the other slot intact;
the reservation is the largest valid slot. A clean close lowers both slots to the log's end, so
a restart after a clean stop leaves no gap.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Final

from .handles import FileHandle, OpenFiles, default_files
from .segment import fsync_directory, sync_file, write_durably

RESERVATION_FILE: Final = "offsets.reserved"
_SLOT: Final = struct.Struct("<QI4x")


def _slot(value: int) -> bytes:
    return _SLOT.pack(value, zlib.crc32(value.to_bytes(8, "little")))


def read_reservation(directory: Path) -> int:
    """The durable reservation of the shard log in `directory` (0 when there is none)."""
    try:
        data = (directory / RESERVATION_FILE).read_bytes()
    except FileNotFoundError:
        return 0
    best = 0
    for start in (0, _SLOT.size):
        chunk = data[start : start + _SLOT.size]
        if len(chunk) < _SLOT.size:
            continue
        value, crc = _SLOT.unpack(chunk)
        if crc == zlib.crc32(value.to_bytes(8, "little")) and value > best:
            best = value
    return best


class OffsetReservation:
    """Writes the reservation file of one shard log (from the committer's worker thread, or
    its synchronous caller)."""

    __slots__ = ("directory", "_file", "_files", "_writes")

    def __init__(self, directory: Path, files: OpenFiles | None = None) -> None:
        self.directory = directory
        self._files = files if files is not None else default_files()
        # open while used or recently used (`handles.py`); None until the file exists
        self._file: FileHandle | None = None
        self._writes = 0

    def _open(self) -> FileHandle:
        if self._file is None:
            path = self.directory / RESERVATION_FILE
            created = not path.exists()
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if created:
                    fsync_directory(self.directory)
            except BaseException:
                os.close(fd)
                raise
            self._file = self._files.handle(path, os.O_RDWR, fd)
        return self._file

    def write(self, value: int) -> None:
        """Make `value` the durable reservation (one slot, then fdatasync)."""
        with self._open() as fd:
            slot = self._writes & 1
            write_durably(fd, _slot(value), slot * _SLOT.size, appending=False)
        self._writes += 1

    def lower(self, value: int) -> None:
        """Set both slots to `value`: only when every offset below it is durable and nothing
        at or above it was handed out (a clean close)."""
        with self._open() as fd:
            os.pwrite(fd, _slot(value) * 2, 0)
            sync_file(fd)

    @property
    def exists(self) -> bool:
        return self._file is not None or (self.directory / RESERVATION_FILE).exists()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
