"""What a node received of shards other nodes own: the messages pushed to it, per shard.

A durable subscription here (an MQTT persistent session, a durable AMQP queue, a durable gRPC
subscription) whose client is away falls behind the live pushes and later replays; the shard's
log lives on its owner, so it replays from a `ReceivedLog` instead: a bounded window, in memory,
of the records pushed here, at the owner's offsets (sparse: only messages some subscription of
this node matched). What slid out of the window is read from the archive when one is
configured, as for a journal's deleted segments; otherwise the subscription resumes at the
window's start (logged), as it would past retention.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Sequence

from ..storage.interfaces import StoredRecord

MAX_RECORDS = 10_000
MAX_BYTES = 16 << 20


class ReceivedLog:
    """A ShardLog over the records pushed here of one shard (read-only for the core)."""

    __slots__ = ("_offsets", "_records", "_bytes", "_low", "_next", "max_records", "max_bytes")

    def __init__(self, max_records: int = MAX_RECORDS, max_bytes: int = MAX_BYTES) -> None:
        self._offsets: list[int] = []
        self._records: list[StoredRecord] = []
        self._bytes = 0
        self._low = -1  # no record yet: every offset counts as "not before the window"
        self._next = 0
        self.max_records = max_records
        self.max_bytes = max_bytes

    def __len__(self) -> int:
        return len(self._records)

    def add(self, offset: int, timestamp_ms: int, data: bytes) -> None:
        """A record pushed by the owner (offsets rise: the owner pushes a shard in order)."""
        if offset < self._next:
            return
        if self._low < 0:
            self._low = offset
        self._offsets.append(offset)
        self._records.append(StoredRecord(offset, timestamp_ms, data))
        self._bytes += len(data)
        self._next = offset + 1
        excess = 0
        count = len(self._records)
        size = self._bytes
        while count - excess > self.max_records or (size > self.max_bytes and count - excess > 1):
            size -= len(self._records[excess].data)
            excess += 1
        if excess:
            self._low = self._offsets[excess - 1] + 1
            del self._offsets[:excess]
            del self._records[:excess]
            self._bytes = size

    # ------------------------------------------------------------ ShardLog
    @property
    def low_watermark(self) -> int:
        return max(self._low, 0)

    @property
    def next_offset(self) -> int:
        return self._next

    @property
    def deliverable_end(self) -> int:
        """Everything here was stored by the shard's owner before it was pushed."""
        return self._next

    def append(self, records: Sequence[tuple[int, bytes]]) -> int:
        raise NotImplementedError("a received log only takes what the shard's owner pushes")

    def commit_waiter(self) -> asyncio.Future[None] | None:
        return None

    def read(self, from_offset: int, max_records: int = 1000) -> list[StoredRecord]:
        start = bisect_left(self._offsets, from_offset)
        return self._records[start:start + max_records]

    def offset_for_timestamp(self, timestamp_ms: int) -> int:
        for record in self._records:
            if record.timestamp_ms >= timestamp_ms:
                return record.offset
        return self._next

    def delete_before(self, offset: int) -> int:
        return self.low_watermark

    def close(self) -> None:
        self._offsets.clear()
        self._records.clear()
        self._bytes = 0
