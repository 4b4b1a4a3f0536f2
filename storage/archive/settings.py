"""Settings of the Parquet archive and the errors it adds to the storage error hierarchy.

Plain values only: the composition root maps its configuration section onto `ArchiveSettings`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..interfaces import StorageError

MIB = 1024 * 1024


class ArchiveError(StorageError):
    """Base of the archive's errors."""


class ArchiveConfigError(ArchiveError):
    """The archive cannot be used as configured: unknown URL scheme, missing filesystem
    package, bad credentials, a bucket that does not exist."""


class ArchiveUnavailable(ArchiveError):
    """The object store could not be reached (the archiver retries; the journal keeps the data)."""


@dataclass(slots=True, frozen=True)
class ArchiveSettings:
    target_rows: int = 100_000
    """Seal a file once it holds this many records..."""
    target_bytes: int = 32 * MIB
    """...or this many bytes of journal records (the Parquet file is smaller: zstd)."""
    max_delay_s: float = 60.0
    """Seal a partial file once its oldest record is this old."""
    poll_interval_s: float = 1.0
    """How often the background task looks for new committed records."""
    read_batch: int = 4096
    """Records read from the journal per call (the event loop gets a turn between calls)."""
    compression_level: int = 3
    """zstd level."""
    row_group_rows: int = 64 * 1024
    keep_typed_payload: bool = False
    """A stream with a registered schema is archived as typed columns; also keep each
    payload's bytes (tiered replay then gives the exact bytes back; without them it rebuilds
    them: exact for Avro, the same JSON document, compact, for JSON Schema)."""
    compaction: bool = True
    """Merge a shard's small files of an hour into files of `file_target_bytes` (local disks
    and object stores; see `compaction.py`)."""
    file_target_bytes: int = 128 * MIB
    """The Parquet file size compaction aims at (the size of the written files, zstd)."""
    compact_after_s: float = 3600.0
    """Compact an hour's files once the hour ended this long ago (a Spark Structured Streaming
    query over the archive must run at least this often: it reads files as they appear)."""
    compact_interval_s: float = 60.0
    """How often the archiver looks for files to compact."""
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    stop_timeout_s: float = 30.0
    """How long `stop(flush=True)` keeps retrying an unreachable store before giving up (the
    journal still holds whatever was not uploaded)."""
    endpoint_url: str | None = None
    """S3: the endpoint (MinIO, moto, another region's host); default from AWS_ENDPOINT_URL."""
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the fsspec filesystem (override the fields above)."""

    def __post_init__(self) -> None:
        if self.target_rows <= 0 or self.target_bytes <= 0 or self.read_batch <= 0:
            raise ValueError("target_rows, target_bytes and read_batch must be positive")
        if self.max_delay_s < 0 or self.poll_interval_s <= 0:
            raise ValueError("max_delay_s must not be negative and poll_interval_s positive")
        if self.file_target_bytes <= 0 or self.compact_after_s < 0 or self.compact_interval_s <= 0:
            raise ValueError("file_target_bytes and compact_interval_s must be positive and "
                             "compact_after_s not negative")
        if self.retry_initial_s <= 0 or self.retry_max_s < self.retry_initial_s:
            raise ValueError("retry_initial_s must be positive and at most retry_max_s")
