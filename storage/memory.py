"""The memory engine: shard logs for non-reliable streams (Danube's non-reliable dispatch).

Nothing touches a disk. Each shard keeps a bounded window of its newest records so that
offsets stay dense and a consumer that is only slightly behind can still read; older records
are dropped as new ones arrive.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

from .interfaces import StoredRecord


class MemoryShardLog:
    """A shard log held in memory, keeping at most `max_records` of the newest records."""

    __slots__ = ("_records", "_low", "_next", "_max")

    def __init__(self, max_records: int = 0) -> None:
        self._records: deque[tuple[int, bytes]] = deque()
        self._low = 0
        self._next = 0
        self._max = max_records

    @property
    def low_watermark(self) -> int:
        return self._low

    @property
    def next_offset(self) -> int:
        return self._next

    def append(self, records: Sequence[tuple[int, bytes]]) -> int:
        first = self._next
        self._next += len(records)
        if self._max:
            self._records.extend(records)
            overflow = len(self._records) - self._max
            for _ in range(max(0, overflow)):
                self._records.popleft()
            self._low = self._next - len(self._records)
        else:
            self._low = self._next
        return first

    @property
    def deliverable_end(self) -> int:
        return self._next

    def commit_waiter(self) -> asyncio.Future[None] | None:
        return None

    def read(self, from_offset: int, max_records: int = 1000) -> list[StoredRecord]:
        start = max(from_offset, self._low)
        out: list[StoredRecord] = []
        index = start - self._low
        while index < len(self._records) and len(out) < max_records:
            ts, data = self._records[index]
            out.append(StoredRecord(self._low + index, ts, data))
            index += 1
        return out

    def offset_for_timestamp(self, timestamp_ms: int) -> int:
        for index, (ts, _) in enumerate(self._records):
            if ts >= timestamp_ms:
                return self._low + index
        return self._next

    def delete_before(self, offset: int) -> int:
        while self._records and self._low < offset:
            self._records.popleft()
            self._low += 1
        if not self._records:
            self._low = self._next if offset >= self._next else max(self._low, offset)
        return self._low

    def close(self) -> None:
        self._records.clear()


class MemoryStorage:
    """The memory engine: every shard is a MemoryShardLog."""

    def __init__(self, max_records_per_shard: int = 0) -> None:
        self._shards: dict[tuple[str, int], MemoryShardLog] = {}
        self._max = max_records_per_shard

    def open_shard(self, stream: str, shard: int) -> MemoryShardLog:
        log = self._shards.get((stream, shard))
        if log is None:
            log = self._shards[(stream, shard)] = MemoryShardLog(self._max)
        return log

    def list_shards(self) -> list[tuple[str, int]]:
        return sorted(self._shards)

    def delete_shard(self, stream: str, shard: int) -> None:
        log = self._shards.pop((stream, shard), None)
        if log is not None:
            log.close()

    async def flush(self) -> None:
        return None

    def close(self) -> None:
        for log in self._shards.values():
            log.close()
        self._shards.clear()
