"""Settings of the journal engine and the errors it adds to the storage error hierarchy."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from ..interfaces import StorageError
from .handles import DEFAULT_OPEN_FILES
from .record import DEFAULT_CHECKSUM

MIB = 1024 * 1024


class FsyncPolicy(enum.StrEnum):
    """When an appended record counts as durable (and its commit waiter resolves)."""

    ALWAYS = "always"
    """After the group's os.write and an fsync of the segment file."""
    INTERVAL = "interval"
    """After the group's os.write and the next periodic fsync (every fsync_interval_ms)."""
    OS = "os"
    """After the group's os.write: survives a crash of the process, not of the machine."""


@dataclass(slots=True, frozen=True)
class JournalConfig:
    fsync: FsyncPolicy = FsyncPolicy.ALWAYS
    fsync_interval_ms: int = 50
    segment_bytes: int = 64 * MIB
    segment_ms: int = 3_600_000
    index_interval_bytes: int = 4096
    retention_bytes: int | None = None
    retention_ms: int | None = None
    max_pending_bytes: int = 256 * MIB
    max_open_files: int = DEFAULT_OPEN_FILES
    """Segment and reservation files open at once, every shard together (`handles.py`)."""
    """Appends beyond this many buffered, not yet written bytes per shard get StorageFull."""
    checksum: str = DEFAULT_CHECKSUM
    """The record checksum (`crc32c`, or `crc32`): set by the journal's version file."""
    index_key: Callable[[bytes | memoryview], bytes] | None = field(default=None, compare=False)
    """The key of a record's data for the segments' key indexes (`keyindex.py`); None: no key
    index, readers scan."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fsync", FsyncPolicy(self.fsync))
        if self.segment_bytes <= 0 or self.index_interval_bytes <= 0:
            raise ValueError("segment_bytes and index_interval_bytes must be positive")
        if self.fsync_interval_ms <= 0 or self.segment_ms <= 0:
            raise ValueError("fsync_interval_ms and segment_ms must be positive")
        if self.max_open_files < 1:
            raise ValueError("max_open_files must be at least 1")


class JournalVersionError(StorageError):
    """The journal directory was written by another (newer) format or another checksum."""


class JournalLocked(StorageError):
    """Another process (or another JournalStorage) has the journal directory open."""


class JournalClosed(StorageError):
    """The shard log or the journal was closed."""


class JournalBusy(StorageError):
    """The shard log cannot do this while appended records wait for the disk (flush first)."""
