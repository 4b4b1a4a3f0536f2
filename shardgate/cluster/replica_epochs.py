"""Leader epochs of one shard's log, and the requests replicas send each other, after Kafka.

`EpochHistory` is KIP-101's leader-epoch cache: for every leader epoch in which a shard's log
received records, the offset of the epoch's first record. A leader records its epoch at its
log end when it takes the shard; a follower records the epochs the leader sends beside the
records it fetches. "Where does epoch E end in your log?" (`end_offset_for`, Kafka's
OffsetsForLeaderEpoch, refined by KIP-279) is what a follower asks a new leader before it
fetches, so that it cuts off what only it holds instead of keeping a diverging tail.

The dataclasses below are what a follower and its leader say to each other (`replica_leader`,
`replica_follower`); the data plane carries them over the peer link. Nothing here touches a
file or a socket: where the history is kept on disk is the journal's concern.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

UNDEFINED = -1
"""An epoch or offset nobody knows (Kafka's UNDEFINED_EPOCH and UNDEFINED_EPOCH_OFFSET)."""


@dataclass(frozen=True, slots=True)
class EpochStart:
    """The first offset written in a leader epoch."""

    epoch: int
    start_offset: int


class EpochMark(Protocol):
    """An entry of an epoch cache: `epoch` wrote its first record at `start_offset`."""

    @property
    def epoch(self) -> int: ...

    @property
    def start_offset(self) -> int: ...


class EpochCache(Protocol):
    """What the replica state machines need of a log's epoch history: `EpochHistory` here,
    or the journal's checkpoint file, which keeps it on disk."""

    @property
    def latest_epoch(self) -> int: ...

    @property
    def entries(self) -> Sequence[EpochMark]: ...

    def assign(self, epoch: int, start_offset: int) -> bool: ...

    def end_offset_for(self, epoch: int, log_end: int) -> tuple[int, int]: ...

    def truncate_from(self, offset: int) -> bool: ...

    def truncate_until(self, offset: int) -> bool: ...


def epochs_in(cache: EpochCache, start: int, end: int) -> tuple[EpochStart, ...]:
    """The epochs of the records in [`start`, `end`): each as (epoch, its first offset in
    that range). What a leader sends beside the records a follower fetched."""
    if start >= end:
        return ()
    out: list[EpochStart] = []
    for entry in cache.entries:
        if entry.start_offset >= end:
            break
        if entry.start_offset <= start:
            out[:] = [EpochStart(entry.epoch, start)]
        else:
            out.append(EpochStart(entry.epoch, entry.start_offset))
    return tuple(out)


class EpochHistory:
    """The leader epochs of one log, each with its start offset (epochs and start offsets
    increase together), in memory: for tests and logs kept in memory."""

    def __init__(self, entries: Iterable[EpochStart] = ()) -> None:
        self._epochs: list[int] = []
        self._starts: list[int] = []
        for entry in entries:
            self.assign(entry.epoch, entry.start_offset)

    @property
    def entries(self) -> tuple[EpochStart, ...]:
        return tuple(EpochStart(e, s) for e, s in zip(self._epochs, self._starts, strict=True))

    @property
    def latest_epoch(self) -> int:
        return self._epochs[-1] if self._epochs else UNDEFINED

    def __len__(self) -> int:
        return len(self._epochs)

    def assign(self, epoch: int, start_offset: int) -> bool:
        """Record that `epoch` starts at `start_offset`. The latest epoch again is a no-op
        (False). Entries that conflict with the new one (an epoch at least as high, or a start
        at least as far: an epoch that holds no record) are dropped first, as Kafka's cache
        does, so the history stays monotonic in both."""
        if epoch < 0 or start_offset < 0:
            raise ValueError(f"a leader epoch and its start offset are not negative: {epoch}, {start_offset}")
        if self._epochs and self._epochs[-1] == epoch and self._starts[-1] <= start_offset:
            return False
        while self._epochs and (self._epochs[-1] >= epoch or self._starts[-1] >= start_offset):
            self._epochs.pop()
            self._starts.pop()
        self._epochs.append(epoch)
        self._starts.append(start_offset)
        return True

    def end_offset_for(self, epoch: int, log_end: int) -> tuple[int, int]:
        """KIP-101/KIP-279: (the largest epoch ≤ `epoch` this log knows, the offset where it
        ends: the start of the next epoch, or `log_end` for the latest). An epoch below every
        known one answers (`epoch`, the first known start); one above every known epoch, or
        an empty history, answers (UNDEFINED, UNDEFINED)."""
        if epoch == UNDEFINED or not self._epochs:
            return UNDEFINED, UNDEFINED
        if epoch == self._epochs[-1]:
            return epoch, log_end
        higher = bisect.bisect_right(self._epochs, epoch)
        if higher == len(self._epochs):
            return UNDEFINED, UNDEFINED
        if higher == 0:
            return epoch, self._starts[0]
        return self._epochs[higher - 1], self._starts[higher]

    def epoch_at(self, offset: int) -> int:
        """The epoch in which the record at `offset` was written (UNDEFINED before the first)."""
        index = bisect.bisect_right(self._starts, offset)
        return self._epochs[index - 1] if index else UNDEFINED

    def truncate_from(self, end_offset: int) -> bool:
        """Forget the epochs that start at or after `end_offset` (the log was cut there)."""
        cut = bisect.bisect_left(self._starts, end_offset)
        changed = cut < len(self._epochs)
        del self._epochs[cut:]
        del self._starts[cut:]
        return changed

    def truncate_until(self, start_offset: int) -> bool:
        """The log now starts at `start_offset` (retention): the epoch holding it starts there."""
        keep = bisect.bisect_right(self._starts, start_offset) - 1
        if keep < 0 or (keep == 0 and self._starts[0] == start_offset):
            return False
        del self._epochs[:keep]
        del self._starts[:keep]
        self._starts[0] = start_offset
        return True


class ReplicaError(enum.Enum):
    """Why a leader refused a follower's request, or a publish (all retryable)."""

    NOT_LEADER = "not_leader"
    """This node does not lead the shard in that epoch (never did, or was superseded)."""
    FENCED_EPOCH = "fenced_epoch"
    """The requester's epoch is older than the leader's: it must learn the new placement."""
    UNKNOWN_LEADER_EPOCH = "unknown_leader_epoch"
    """The requester names a newer epoch than this leader's: its view of the placement is
    ahead (it names this node the leader of that epoch, or it would not ask here); retry
    once this node has seen it too (Kafka's UNKNOWN_LEADER_EPOCH)."""
    UNKNOWN_REPLICA = "unknown_replica"
    """The requester is not one of the shard's replicas."""
    OUT_OF_RANGE = "out_of_range"
    """The follower asked past the leader's log end: it must find its truncation point."""
    BEHIND_LOG_START = "behind_log_start"
    """The follower's next offset is no longer in the leader's log (retention)."""
    NOT_ENOUGH_REPLICAS = "not_enough_replicas"
    """Fewer replicas than `min_insync_replicas` are in sync: the publish is not taken."""


@dataclass(frozen=True, slots=True)
class Refused:
    """A leader's refusal; `log_start` is set with BEHIND_LOG_START."""

    error: ReplicaError
    log_start: int = UNDEFINED


@dataclass(frozen=True, slots=True)
class FetchRequest:
    """A follower's fetch: it has appended every record below `fetch_offset` and holds every
    record below `durable_end` under its fsync policy; `high_watermark` is the one it knows
    (from the leader's earlier answers; 0 from a node that does not say)."""

    replica: str
    leader_epoch: int
    fetch_offset: int
    durable_end: int
    high_watermark: int = 0


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """A leader's decision on a fetch: send the records in [`start`, `end`) (the reader may
    send fewer, from `start`), with their `epochs` and the leader's high watermark. An empty
    range may be held until records arrive (long poll)."""

    start: int
    end: int
    high_watermark: int
    epochs: tuple[EpochStart, ...]


@dataclass(frozen=True, slots=True)
class FetchResponse:
    """What a follower receives: the records in [`start`, `end`) (carried beside it), their
    epochs and the leader's high watermark, from the leader of `leader_epoch`; and its
    dispatched mark (`dispatch_marks.py`; None: not known)."""

    leader_epoch: int
    start: int
    end: int
    high_watermark: int
    epochs: tuple[EpochStart, ...]
    dispatched_end: int | None = None


@dataclass(frozen=True, slots=True)
class EpochEndRequest:
    """"Where does `epoch` end in your log?", asked of the leader of `leader_epoch`."""

    replica: str
    leader_epoch: int
    epoch: int


@dataclass(frozen=True, slots=True)
class EpochEndAnswer:
    """The largest epoch ≤ the one asked that the leader knows, and where it ends there."""

    epoch: int
    end_offset: int
