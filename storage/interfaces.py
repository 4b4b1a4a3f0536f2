"""The storage boundary: small typing Protocols that `core` uses and each engine implements.

`core` imports only this module from `storage`; the composition root (`shardgate/`) picks the
engines. `LatencyHistogram` is the one measurement both sides share: an engine reports its fsync
latency in one, the core its append-to-durable latency. A shard log stores opaque record bytes at dense offsets; what the bytes mean (a
message) is the core's business.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


class StorageError(Exception):
    """Base of every error an engine raises through this interface."""


class StorageFull(StorageError):
    """The engine could not write: disk full, quota, I/O error. Nothing was accepted."""


class StorageUnavailable(StorageError):
    """The log cannot take writes now, and may soon: a replicated shard whose leadership is
    changing or whose in-sync replicas are below the minimum. Nothing was accepted; retry."""


class CorruptRecord(StorageError):
    """A record failed its checksum in the middle of a segment (not a torn tail)."""


@dataclass(slots=True, frozen=True)
class StoredRecord:
    offset: int
    timestamp_ms: int
    data: bytes


class ShardLog(Protocol):
    """One shard: an ordered, append-only log with dense offsets starting at 0. An offset the
    engine had to skip (its record was lost before it was durable, after it may have been
    seen) holds an empty record: readers skip records whose data is empty."""

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

    @property
    def deliverable_end(self) -> int:
        """Records at offsets below this may be shown to readers before they are durable: the
        engine never gives any of these offsets to another record (not after a failed commit,
        not after a crash). Records at or above it are shown once their commit is durable."""

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


@runtime_checkable
class ReplicatedLog(Protocol):
    """A shard log kept on several nodes (a cluster's replicated shard, led from this node): a
    record counts once it is below `committed_offset` (on enough replicas), and `log` is this
    node's own copy, read past that mark too. `settled`: this node leads the shard and every
    record an earlier leader may have acknowledged is readable here. `acknowledging`: it
    acknowledges what passes `committed_offset` now (enough replicas in sync)."""

    @property
    def settled(self) -> bool: ...

    @property
    def acknowledging(self) -> bool: ...

    @property
    def committed_offset(self) -> int: ...

    @property
    def log(self) -> ShardLog: ...


@runtime_checkable
class IdleReleasable(Protocol):
    """An engine object that keeps caches it can rebuild from its data (a shard log's key
    indexes): the broker has it drop them once idle, so that what a load made does not outlive
    it in memory."""

    def forget_caches(self) -> None: ...


class RecordSpans(Protocol):
    """Consecutive records (offsets `first_offset`, `first_offset + 1`, ...) as one buffer and
    arrays of positions, no Python object per record (the journal's `RecordBlock`): record i
    has its data at `buffer[starts[i]:ends[i]]` (empty: an offset the engine skipped) and its
    timestamp at `timestamps[i]`."""

    @property
    def buffer(self) -> bytes: ...

    @property
    def first_offset(self) -> int: ...

    @property
    def starts(self) -> Sequence[int]: ...

    @property
    def ends(self) -> Sequence[int]: ...

    @property
    def timestamps(self) -> Sequence[int]: ...

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice) -> RecordSpans: ...


@runtime_checkable
class BlockReadable(Protocol):
    """A shard log that can also read in bulk (the journal): readers that go through many
    records and keep few (durable replay, the archiver) read blocks instead of `read`."""

    def read_block(self, from_offset: int, max_records: int = 10_000,
                   allocate: Callable[[int], Any] | None = None) -> RecordSpans:
        """Published records from `from_offset` (clamped to the low watermark), possibly fewer
        than `max_records` even when more are published; empty at the committed end. With
        `allocate` (size -> a writable buffer, such as Arrow's `allocate_buffer`), the bytes may
        be read into a buffer it gives instead of a new `bytes` (a reader that reads much and
        soon frees it, the archiver, so reuses memory its allocator keeps)."""


@runtime_checkable
class KeyedSpans(RecordSpans, Protocol):
    """Records of a shard that are not consecutive (the ones a reader wanted, the journal's
    `KeyedBlock`): record i is at offset `offsets[i]`; every other offset below `end_offset`
    holds a record the reader did not want."""

    @property
    def offsets(self) -> Sequence[int]: ...

    @property
    def end_offset(self) -> int: ...


@runtime_checkable
class KeyedReadable(Protocol):
    """A shard log that keeps a key per record (the journal given an `index_key`: a prefix of
    the message's topic) and reads only the records of the keys a reader wants."""

    def read_keyed(
        self, from_offset: int, max_records: int, wants: Callable[[bytes], bool]
    ) -> KeyedSpans | None:
        """Published records from `from_offset` whose key `wants` accepts (at most
        `max_records`); None when the log cannot serve this from an index (read blocks)."""


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


# Upper bounds (seconds) of the latency histograms' buckets, from 100 µs to 10 s.
LATENCY_BUCKETS: tuple[float, ...] = tuple(
    scale * step for scale in (0.0001, 0.001, 0.01, 0.1, 1.0) for step in (1, 2.5, 5)
) + (10.0,)


class LatencyHistogram:
    """Counts of observed durations (seconds) in fixed buckets, for metrics.

    `observe` is a bisect and two additions, meant for events that happen once per commit group
    or per fsync, not per message. One thread observes; exporters read `snapshot()` from
    another, which at worst misses an observation in progress."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one counts what exceeds every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> tuple[list[tuple[float, int]], float]:
        """Cumulative counts per upper bound (the last bound being +inf), and the sum."""
        counts = list(self.counts)
        total = 0
        buckets = []
        for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
            total += count
            buckets.append((bound, total))
        return buckets, self.sum
