"""The follower side of one replicated shard, as a state machine with no I/O (after Kafka's
replica fetcher and KIP-101/KIP-279 truncation).

A follower of a leader epoch first finds where its log stops agreeing with the leader's: it
asks the leader where its own latest epoch ends there (`EpochEndRequest`) and cuts its log to
that point, or to its own end of the epoch the leader answered with when the leader never had
its latest epoch, asking again until both name the same epoch (KIP-279). A log with records
but no epoch history (written before replication) is cut to its high watermark, Kafka's rule
before KIP-101. Then it fetches: one request in flight at a time, each from its log end and
saying how far it holds the log durably; it sends the next only once what it appended is
durable, so the leader always learns its durable end. Every answer names what the I/O side
must do (`Truncate`, `ResetLog`) or is applied here (records appended, epochs recorded).

A refusal names why: an older epoch than the leader's (`FENCED_EPOCH`: wait for the new
placement), a leader that no longer leads (`NOT_LEADER`: wait, then retry) or has not seen
this follower's newer epoch yet (`UNKNOWN_LEADER_EPOCH`: the same), a fetch past the
leader's end (`OUT_OF_RANGE`: find the truncation point again), a log the leader's retention
has passed (`BEHIND_LOG_START`: start the log again at the leader's first offset).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .replica_epochs import (
    UNDEFINED,
    EpochCache,
    EpochEndAnswer,
    EpochEndRequest,
    FetchRequest,
    FetchResponse,
    Refused,
    ReplicaError,
)


class FollowerState(enum.Enum):
    TRUNCATING = "truncating"
    """Finding where its log diverges from the leader's (asks `EpochEndRequest`)."""
    FETCHING = "fetching"
    """Fetching the leader's records."""
    WAITING = "waiting"
    """The leader refused (not leading, or an epoch this follower does not know yet): wait
    for placement, or `retry` after a pause."""


@dataclass(frozen=True, slots=True)
class Truncate:
    """Cut the local log (and its epoch history) at `end_offset`."""

    end_offset: int


@dataclass(frozen=True, slots=True)
class ResetLog:
    """Drop the local log: it starts again, empty, at `start_offset` (the leader's start)."""

    start_offset: int


class FollowerReplica:
    """One shard followed by this node, in one leader epoch (see the module docstring)."""

    def __init__(
        self,
        node_id: str,
        leader: str,
        epoch: int,
        *,
        history: EpochCache,
        log_end: int,
        durable_end: int,
        high_watermark: int,
    ) -> None:
        if not 0 <= durable_end <= log_end:
            raise ValueError(f"durable end {durable_end} outside the log (end {log_end})")
        self.node_id = node_id
        self.leader = leader
        self.epoch = epoch
        self.history = history
        self._log_end = log_end
        self._durable_end = durable_end
        self._hw = min(max(high_watermark, 0), log_end)
        self._in_flight = False
        self._retry_state = FollowerState.TRUNCATING
        self.state = FollowerState.TRUNCATING
        self.last_refusal: ReplicaError | None = None

    @property
    def log_end(self) -> int:
        return self._log_end

    @property
    def durable_end(self) -> int:
        return self._durable_end

    @property
    def high_watermark(self) -> int:
        return self._hw

    @property
    def in_flight(self) -> bool:
        return self._in_flight

    def next_request(self) -> EpochEndRequest | FetchRequest | Truncate | None:
        """What to do next: a request for the leader, a truncation the follower decided
        alone (a log without epochs), or None (a request is in flight, the last append is
        not durable yet, or it waits)."""
        if self._in_flight or self.state is FollowerState.WAITING:
            return None
        if self.state is FollowerState.TRUNCATING:
            latest = self.history.latest_epoch
            if latest == UNDEFINED:
                self.state = FollowerState.FETCHING
                if self._log_end > self._hw:
                    return self._truncate(self._hw)
            else:
                self._in_flight = True
                return EpochEndRequest(self.node_id, self.epoch, latest)
        if self._durable_end < self._log_end:
            return None
        self._in_flight = True
        return FetchRequest(self.node_id, self.epoch, self._log_end, self._durable_end, self._hw)

    def on_epoch_end(self, answer: EpochEndAnswer | Refused) -> Truncate | ResetLog | None:
        """The leader's answer to `EpochEndRequest`: the truncation to make, if any."""
        self._in_flight = False
        if self.state is not FollowerState.TRUNCATING:
            return None
        if isinstance(answer, Refused):
            return self._refused(answer)
        asked = self.history.latest_epoch
        if answer.epoch == UNDEFINED:
            # the leader knows no epoch at or below ours: keep only what was committed
            self.state = FollowerState.FETCHING
            return self._truncate(min(self._hw, self._log_end))
        if answer.epoch == asked:
            self.state = FollowerState.FETCHING
            return self._truncate(min(answer.end_offset, self._log_end))
        # the leader never had our latest epoch (KIP-279): cut to where the epoch it did have
        # ends here (where our first later epoch starts: computed from the entries, whatever
        # the cache answers for an epoch below its first), and ask again about what is left
        own_end = next((entry.start_offset for entry in self.history.entries
                        if entry.epoch > answer.epoch), self._log_end)
        cut = min(answer.end_offset, own_end)
        action = self._truncate(cut)
        if action is None:
            # no record to cut (the later epochs began at this log's end and hold nothing),
            # but those epochs go all the same: else the same question would come back with
            # the same answer forever, and this follower never fetch again
            self.history.truncate_from(cut)
        if self.history.latest_epoch in (answer.epoch, UNDEFINED):
            self.state = FollowerState.FETCHING
        return action

    def on_fetch(self, response: FetchResponse | Refused) -> Truncate | ResetLog | None:
        """The leader's answer to a fetch. For a `FetchResponse` whose records the I/O side
        appends to the log (it calls this when they are appended, not yet durable), the log
        end, the epochs and the high watermark move here; a stale response is ignored."""
        self._in_flight = False
        if self.state is not FollowerState.FETCHING:
            return None
        if isinstance(response, Refused):
            return self._refused(response)
        if response.leader_epoch != self.epoch or response.start != self._log_end:
            return None
        for entry in response.epochs:
            if entry.start_offset < response.end:
                self.history.assign(entry.epoch, entry.start_offset)
        self._log_end = response.end
        self._hw = min(max(self._hw, response.high_watermark), self._log_end)
        return None

    def accepts(self, response: FetchResponse) -> bool:
        """Whether the records of `response` are to be appended (checked before appending)."""
        return (self.state is FollowerState.FETCHING and response.leader_epoch == self.epoch
                and response.start == self._log_end and response.end >= response.start)

    def durable(self, end_offset: int) -> None:
        """The local log holds every record below `end_offset` under its fsync policy."""
        if end_offset > self._durable_end:
            self._durable_end = min(end_offset, self._log_end)

    def rewind(self, end_offset: int) -> None:
        """The local log could not keep what was fetched (a write failed: a full disk) and
        now ends at `end_offset`, its durable end: find where it agrees with the leader's
        again and fetch from there (whatever request was in flight is forgotten)."""
        self._in_flight = False
        self._truncate(end_offset)
        self.state = FollowerState.TRUNCATING

    def retry(self) -> None:
        """After a refusal's pause: ask the leader again, from the step it refused."""
        if self.state is FollowerState.WAITING:
            self.state = self._retry_state

    def _refused(self, refused: Refused) -> Truncate | ResetLog | None:
        self.last_refusal = refused.error
        if refused.error is ReplicaError.OUT_OF_RANGE:
            self.state = FollowerState.TRUNCATING
            return None
        if refused.error is ReplicaError.BEHIND_LOG_START and refused.log_start >= 0:
            self.state = FollowerState.FETCHING
            self.history.truncate_from(0)
            self._log_end = self._durable_end = self._hw = refused.log_start
            return ResetLog(refused.log_start)
        self._retry_state = self.state
        self.state = FollowerState.WAITING
        return None

    def _truncate(self, end_offset: int) -> Truncate | None:
        if end_offset >= self._log_end:
            return None
        end_offset = max(end_offset, 0)
        self.history.truncate_from(end_offset)
        self._log_end = end_offset
        self._durable_end = min(self._durable_end, end_offset)
        self._hw = min(self._hw, end_offset)
        return Truncate(end_offset)
