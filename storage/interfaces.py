"""The storage boundary: small typing Protocols that `core` uses and each engine implements.

`core` imports only this module from `storage`; the composition root (`shardgate/`) picks the
engines. A shard log stores opaque record bytes at dense offsets; what the bytes mean (a
message) is the core's business.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class StorageError(Exception):
    """Base of every error an engine raises through this interface."""


class StorageFull(StorageError):
    """The engine could not write: disk full, quota, I/O error. Nothing was accepted."""


class CorruptRecord(StorageError):
    """A record failed its checksum in the middle of a segment (not a torn tail)."""


@dataclass(slots=True, frozen=True)
class StoredRecord:
    offset: int
    timestamp_ms: int
    data: bytes


class ShardLog(Protocol):
    """One shard: an ordered, append-only log with dense offsets starting at 0."""

    @property
    def low_watermark(self) -> int:
        """The first offset still held (0 until retention deletes something)."""

    @property
    def next_offset(self) -> int:
        """The offset the next appended record will get."""

    def append(self, records: Sequence[tuple[int, bytes]]) -> int:
        """Append (timestamp_ms, data) records; returns the offset of the first one.

        Never blocks on the disk: the records are buffered and become durable with the next
        commit (see `commit_waiter`). Raises StorageFull when the engine cannot accept them.
        """

    def commit_waiter(self) -> asyncio.Future[None] | None:
        """A future that resolves once every record appended so far is durable under the
        configured fsync policy, shared by every caller of the same commit group; None when
        they already are (memory engine, or nothing pending)."""

    def read(self, from_offset: int, max_records: int = 1000) -> list[StoredRecord]:
        """Records from `from_offset` (clamped to the low watermark) in offset order."""

    def offset_for_timestamp(self, timestamp_ms: int) -> int:
        """The first offset whose timestamp is >= timestamp_ms (next_offset if none)."""

    def delete_before(self, offset: int) -> int:
        """Drop records below `offset` where the engine can (whole segments); returns the new
        low watermark."""

    def close(self) -> None: ...


class ShardStorage(Protocol):
    """An engine: opens shard logs by (stream, shard index)."""

    def open_shard(self, stream: str, shard: int) -> ShardLog: ...

    def list_shards(self) -> list[tuple[str, int]]: ...

    def delete_shard(self, stream: str, shard: int) -> None: ...

    async def flush(self) -> None:
        """Make everything appended so far durable."""

    def close(self) -> None: ...


class ArchiveSource(Protocol):
    """Records that left the journal for the archive, read back for tiered replay."""

    async def read_async(
        self, stream: str, shard: int, from_offset: int, max_records: int = 1000
    ) -> list[StoredRecord]:
        """Archived records of a shard from `from_offset` in offset order (empty when the
        archive holds nothing there)."""
