"""The state every part of a journal segment shares: `SegmentState` (its slots and their first
values, its file and the names of its files). `Segment` (`segment.py`) is assembled from parts
over it: `segment_indexes.py` (the index files) and `segment_keyed.py` (keyed reads); the parts
are base classes, so a read or an append costs no extra call.
"""

from __future__ import annotations

from array import array
from pathlib import Path

from .handles import FileHandle
from .keyindex import KeyFunction, KeyIndex
from .record import Checksum, checksum
from .segment_files import LOG_SUFFIX, segment_name


class SegmentState:
    """A segment file and its published state (see `segment.py`'s docstring). Its file is open
    only while used or recently used (`handles.py`): `fd` is valid inside `with self.file`."""

    __slots__ = (
        "directory",
        "base_offset",
        "file",
        "size",
        "next_offset",
        "index_offsets",
        "index_positions",
        "time_stamps",
        "time_offsets",
        "max_timestamp",
        "first_timestamp",
        "sealed",
        "crc",
        "key_of",
        "key_index",
    )

    def __init__(
        self, directory: Path, base_offset: int, file: FileHandle, crc: Checksum = checksum,
        key_of: KeyFunction | None = None,
    ) -> None:
        self.directory = directory
        self.crc = crc
        # The key index (`keyindex.py`) of what is published, when the journal keys records;
        # None for a segment opened sealed, or one whose index was dropped.
        self.key_of = key_of
        self.key_index: KeyIndex | None = None
        self.base_offset = base_offset
        self.file = file
        self.size = 0
        self.next_offset = base_offset
        # The sparse indexes as arrays of machine integers: a segment keeps them while it
        # exists, and an int object per entry (tens of thousands, made one by one among a
        # load's short-lived objects) would keep pages of Python's small-object heap, and
        # their arenas, once the load has gone.
        self.index_offsets: array[int] = array("q")
        self.index_positions: array[int] = array("q")
        self.time_stamps: array[int] = array("q")
        self.time_offsets: array[int] = array("q")
        self.max_timestamp: int | None = None
        self.first_timestamp: int | None = None
        self.sealed = False

    # -- files --------------------------------------------------------------------------

    @property
    def fd(self) -> int:
        """The file's descriptor: valid while the file is pinned (`with self.file`)."""
        return self.file.fd

    def path(self, suffix: str = LOG_SUFFIX) -> Path:
        return self.directory / f"{segment_name(self.base_offset)}{suffix}"
