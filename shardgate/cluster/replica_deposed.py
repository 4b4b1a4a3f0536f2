"""What a leader that lost its epoch still owes its publishers, as a state machine with no I/O:
the publishes it appended and had not acknowledged when it stopped leading.

A record is known by (leader epoch, offset): only the leader of an epoch writes records in it,
once per offset. A leader that loses its epoch after appending (frozen past its lease, moved
by a drain whose quiesce got no answer, superseded by the controller's placement) cannot
tell whether the next leader kept those records: if a follower fetched them, the new leader
holds them and will deliver them. Refusing them then would make their clients send them
again, and the shard would hold them twice. So this node keeps them here while it follows:

- its log is cut where it stops agreeing with the new leader (KIP-101: at the new leader's
  end of the lost epoch; `cut`). A publish with a record at or above the cut is refused
  (NOT_LEADER, retryable): its record is gone, so a resend is right;
- a fetch answer from the leader of a newer epoch tells its high watermark (`learned`).
  Below it the follower's log, never cut below a waiting publish's end since it was
  appended, is the new leader's log record for record (log matching), so that publish is in
  the shard for good: it is acknowledged. Only such a high watermark settles one: this node
  never acknowledges what the new leader does not hold (fencing stays intact);
- what is not settled by `deadline` (a few seconds: a failover's time) is refused, as is
  everything when this node stops following the shard (`refuse_all`), or carried into a new
  leadership of this node over the same log (`take_all`: its high watermark settles it then).

Time is given by the caller (`now`, monotonic seconds); outcomes are handed back as (waiter,
error or None) pairs by `take_completed`, as `replica_leader` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .replica_epochs import ReplicaError

W = TypeVar("W")


@dataclass(slots=True)
class _Owed(Generic[W]):
    epoch: int  # the leader epoch it was appended under (or carried into)
    end: int  # every record below this offset must be held
    deadline: float
    waiter: W


class DeposedWaiters(Generic[W]):
    """The publishes a deposed leader still owes an answer (see the module docstring)."""

    def __init__(self) -> None:
        self._owed: list[_Owed[W]] = []
        self._done: list[tuple[W, ReplicaError | None]] = []

    def __len__(self) -> int:
        return len(self._owed)

    def add(self, epoch: int, waiting: Iterable[tuple[int, W]], deadline: float) -> None:
        """The leadership of `epoch` ended with `waiting` ((log end it waits for, waiter))
        not acknowledged: keep them until `deadline`."""
        self._owed.extend(_Owed(epoch, end, deadline, waiter) for end, waiter in waiting)

    def cut(self, end_offset: int) -> None:
        """The log was cut at `end_offset`: what waits for a record at or above it is refused."""
        self._settle(lambda owed: owed.end > end_offset, ReplicaError.NOT_LEADER)

    def learned(self, leader_epoch: int, high_watermark: int) -> None:
        """A fetch answer from the leader of `leader_epoch` said its high watermark (bounded
        by this log's end): what waits below it, appended in an older epoch, is acknowledged."""
        self._settle(lambda owed: owed.epoch < leader_epoch and owed.end <= high_watermark, None)

    def expire(self, now: float) -> None:
        """Refuse what was not settled by its deadline."""
        self._settle(lambda owed: owed.deadline <= now, ReplicaError.NOT_LEADER)

    def refuse_all(self) -> None:
        """This node stops following the shard: nothing will settle what waits."""
        self._settle(lambda _owed: True, ReplicaError.NOT_LEADER)

    def take_all(self) -> list[tuple[int, W]]:
        """Everything that waits, as (log end, waiter) in the order it was kept, for a new
        leadership of this node over the same log to acknowledge."""
        owed, self._owed = self._owed, []
        return [(entry.end, entry.waiter) for entry in owed]

    def take_completed(self) -> list[tuple[W, ReplicaError | None]]:
        done, self._done = self._done, []
        return done

    def _settle(self, which: Callable[[_Owed[W]], bool], outcome: ReplicaError | None) -> None:
        kept: list[_Owed[W]] = []
        for owed in self._owed:
            if which(owed):
                self._done.append((owed.waiter, outcome))
            else:
                kept.append(owed)
        self._owed = kept
