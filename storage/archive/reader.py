"""`ArchiveReader`: reads a shard's records back from the archive, for tiered replay.

A consumer whose cursor lies below the journal's low watermark reads here first, then from
the journal, then the live tail. The reader answers with the same `StoredRecord`s (offset,
timestamp, message bytes) the journal would have, rebuilt from the Parquet columns. It finds
files by their names (see `layout`), so it needs no state from the archiver; it keeps a
listing per stream (refreshed when asked for offsets beyond it) and the last decoded files.

Calls block on the object store: call `read` from a worker thread, or use `read_async`.
"""

from __future__ import annotations

import asyncio
import threading
from bisect import bisect_left
from collections import OrderedDict

import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from ..interfaces import StoredRecord
from . import layout
from .columns import records_from_table
from .settings import ArchiveSettings


class ArchiveReader:
    """Reads archived records by (stream, shard, offset)."""

    def __init__(
        self,
        url: str,
        settings: ArchiveSettings | None = None,
        *,
        filesystem: AbstractFileSystem | None = None,
        cached_files: int = 4,
    ) -> None:
        self.url = url
        fs, root = layout.open_filesystem(url, settings)
        self.fs: AbstractFileSystem = filesystem if filesystem is not None else fs
        self.root = root
        self._listing: dict[str, dict[int, list[layout.ArchiveFile]]] = {}
        self._decoded: OrderedDict[str, list[StoredRecord]] = OrderedDict()
        self._cached_files = max(1, cached_files)
        self._lock = threading.Lock()

    def files(self, stream: str, shard: int, refresh: bool = False) -> list[layout.ArchiveFile]:
        """The shard's archive files in offset order."""
        with self._lock:
            if refresh or stream not in self._listing:
                by_shard: dict[int, list[layout.ArchiveFile]] = {}
                for entry in layout.list_stream_files(self.fs, self.root, stream):
                    by_shard.setdefault(entry.shard, []).append(entry)
                self._listing[stream] = by_shard
            return list(self._listing[stream].get(shard, []))

    def offset_range(self, stream: str, shard: int, refresh: bool = True) -> tuple[int, int]:
        """(first archived offset, first offset after the archive); (0, 0) when empty."""
        files = self.files(stream, shard, refresh)
        if not files:
            return (0, 0)
        return (files[0].first_offset, files[-1].last_offset + 1)

    def read(self, stream: str, shard: int, from_offset: int, max_records: int = 1000
             ) -> list[StoredRecord]:
        """Archived records with offsets >= `from_offset`, in order, at most `max_records`.
        An empty list when the archive holds nothing at or after `from_offset`."""
        if max_records <= 0:
            return []
        files = self.files(stream, shard)
        if not files or files[-1].last_offset < from_offset:
            files = self.files(stream, shard, refresh=True)
        try:
            return self._read(files, from_offset, max_records)
        except FileNotFoundError:  # compaction replaced files since the listing
            return self._read(self.files(stream, shard, refresh=True), from_offset, max_records)

    def _read(self, files: list[layout.ArchiveFile], from_offset: int, max_records: int
              ) -> list[StoredRecord]:
        lasts = [entry.last_offset for entry in files]
        out: list[StoredRecord] = []
        for entry in files[bisect_left(lasts, from_offset):]:
            records = self._records(entry)
            start = from_offset - entry.first_offset
            if start > 0 and start < len(records) and records[start].offset == from_offset:
                chunk = records[start:]
            else:
                chunk = [record for record in records if record.offset >= from_offset]
            out += chunk[: max_records - len(out)]
            if len(out) >= max_records:
                break
        return out

    async def read_async(
        self, stream: str, shard: int, from_offset: int, max_records: int = 1000
    ) -> list[StoredRecord]:
        return await asyncio.to_thread(self.read, stream, shard, from_offset, max_records)

    def _records(self, entry: layout.ArchiveFile) -> list[StoredRecord]:
        with self._lock:
            cached = self._decoded.get(entry.path)
            if cached is not None:
                self._decoded.move_to_end(entry.path)
                return cached
        with self.fs.open(entry.path, "rb") as handle:
            table = pq.read_table(handle)
        records = records_from_table(table)
        with self._lock:
            self._decoded[entry.path] = records
            while len(self._decoded) > self._cached_files:
                self._decoded.popitem(last=False)
        return records
