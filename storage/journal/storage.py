"""`JournalStorage`: the local journal engine (implements `ShardStorage`) for reliable streams.

The journal root holds `journal.version` (the on-disk format and the record checksum),
`journal.lock` (an exclusive flock held while the journal is open, so that two brokers never
write the same files) and one directory per shard, `<root>/<stream>/<shard>/`, where the stream name is percent-encoded so
that any name maps to one directory level. All shard logs share one group committer, so one
worker-thread pass writes and fsyncs every dirty shard. With `index_key` (the key of a
record's data: the broker gives a topic prefix) each segment keeps a key index in memory
(`keyindex.py`) for readers that want the records of a few keys (`JournalShardLog.read_keyed`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, unquote

from .commit import CommitStats, GroupCommitter
from .config import (
    MIB,
    FsyncPolicy,
    JournalClosed,
    JournalConfig,
    JournalLocked,
    JournalVersionError,
)
from .handles import DEFAULT_OPEN_FILES
from .log import JournalShardLog
from .record import DEFAULT_CHECKSUM, checksum_function
from .segment import fsync_directory, write_all

FORMAT_VERSION = 1
VERSION_FILE = "journal.version"
LOCK_FILE = "journal.lock"


def lock_directory(root: Path) -> int:
    """Take the journal's exclusive lock; returns the lock file's descriptor (closing it, or the
    process dying, releases the lock)."""
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise JournalLocked(
            f"the journal at {root} is already open in another process or JournalStorage"
        ) from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_version(root: Path) -> str:
    """Refuse a journal written by a newer format or with a checksum this installation cannot
    compute; stamp a new journal. Returns the journal's record checksum."""
    path = root / VERSION_FILE
    try:
        lines = path.read_text(encoding="ascii").split()
    except FileNotFoundError:
        temp = path.with_name(VERSION_FILE + ".tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, f"{FORMAT_VERSION}\n{DEFAULT_CHECKSUM}\n".encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
        fsync_directory(root)
        return DEFAULT_CHECKSUM
    except (UnicodeDecodeError, OSError) as exc:
        raise JournalVersionError(f"{path}: unreadable journal version file: {exc}") from exc
    if not lines or not lines[0].isdigit():
        raise JournalVersionError(f"{path}: not a journal version file")
    version = int(lines[0])
    if version > FORMAT_VERSION:
        raise JournalVersionError(
            f"{path}: the journal at {root} was written in format version {version}; this "
            f"Shardgate reads format {FORMAT_VERSION} and older. Upgrade Shardgate to open it."
        )
    checksum = lines[1] if len(lines) > 1 else "crc32c"
    try:
        checksum_function(checksum)
    except LookupError as exc:
        raise JournalVersionError(f"{path}: cannot verify the journal at {root}: {exc}") from exc
    return checksum


def _stream_dir_name(stream: str) -> str:
    if not stream:
        raise ValueError("a stream name must not be empty")
    name = quote(stream, safe="-_")
    return name.replace(".", "%2E") if name.startswith(".") else name


class JournalStorage:
    """The journal engine: shard logs on local disk under one root directory."""

    def __init__(
        self,
        directory: Path | str,
        *,
        fsync: FsyncPolicy | str = FsyncPolicy.ALWAYS,
        fsync_interval_ms: int = 50,
        segment_bytes: int = 64 * MIB,
        segment_ms: int = 3_600_000,
        index_interval_bytes: int = 4096,
        retention_bytes: int | None = None,
        retention_ms: int | None = None,
        max_pending_bytes: int = 256 * MIB,
        max_open_files: int = DEFAULT_OPEN_FILES,
        index_key: Callable[[bytes | memoryview], bytes] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_directory(self.directory)
        try:
            self.config = JournalConfig(
                fsync=FsyncPolicy(fsync),
                fsync_interval_ms=fsync_interval_ms,
                segment_bytes=segment_bytes,
                segment_ms=segment_ms,
                index_interval_bytes=index_interval_bytes,
                retention_bytes=retention_bytes,
                retention_ms=retention_ms,
                max_pending_bytes=max_pending_bytes,
                max_open_files=max_open_files,
                checksum=check_version(self.directory),
                index_key=index_key,
            )
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._committer = GroupCommitter(self.config)
        self._shards: dict[tuple[str, int], JournalShardLog] = {}
        self._closed = False

    def shard_directory(self, stream: str, shard: int) -> Path:
        if shard < 0:
            raise ValueError(f"shard index must not be negative: {shard}")
        return self.directory / _stream_dir_name(stream) / str(shard)

    def open_shard(self, stream: str, shard: int) -> JournalShardLog:
        if self._closed:
            raise JournalClosed(f"the journal at {self.directory} is closed")
        key = (stream, shard)
        shard_log = self._shards.get(key)
        if shard_log is None:
            directory = self.shard_directory(stream, shard)
            created = not directory.exists()
            shard_log = JournalShardLog(directory, self.config, self._committer)
            if created:
                fsync_directory(directory.parent)
                fsync_directory(self.directory)
            self._shards[key] = shard_log
        return shard_log

    def list_shards(self) -> list[tuple[str, int]]:
        found = set(self._shards)
        for stream_entry in os.scandir(self.directory):
            if not stream_entry.is_dir():
                continue
            for shard_entry in os.scandir(stream_entry.path):
                if shard_entry.is_dir() and shard_entry.name.isdigit():
                    found.add((unquote(stream_entry.name), int(shard_entry.name)))
        return sorted(found)

    def delete_shard(self, stream: str, shard: int) -> None:
        """Delete a shard and its files; its unwritten appends fail with JournalClosed."""
        shard_log = self._shards.pop((stream, shard), None)
        if shard_log is not None:
            shard_log.discard()
        directory = self.shard_directory(stream, shard)
        if directory.exists():
            shutil.rmtree(directory)
            fsync_directory(directory.parent)

    async def flush(self) -> None:
        """Wait until everything appended to any shard so far is durable."""
        await self._committer.flush()

    def refuse_appends(self, reason: str | None) -> None:
        """Refuse every append (StorageFull with `reason`) until called with None: the node's
        disk is nearly full (`shardgate.resources`)."""
        self._committer.refusing = reason

    def flush_sync(self) -> None:
        """Write and fsync everything appended so far, synchronously (no event loop needed)."""
        self._committer.flush_sync()

    def apply_retention(self, min_needed: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """Apply retention to every open shard, keeping each shard's `min_needed` offset
        (a shard missing from the mapping keeps everything). Returns the low watermarks."""
        return {
            key: shard_log.apply_retention(min_needed.get(key, shard_log.low_watermark))
            for key, shard_log in self._shards.items()
        }

    @property
    def stats(self) -> CommitStats:
        return self._committer.stats

    def close(self) -> None:
        """Flush, then close every shard. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._committer.close()
        finally:
            try:
                for shard_log in self._shards.values():
                    shard_log.close()
                self._shards.clear()
            finally:
                os.close(self._lock_fd)
