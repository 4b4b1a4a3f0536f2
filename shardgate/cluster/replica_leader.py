"""The leader side of one replicated shard, as a state machine with no I/O (after Kafka's
`Partition` on its leader).

The leader appends publishes to its own log; its followers fetch from it over the peer link,
each fetch saying how far the follower holds the log durably. From that the leader keeps:

- per follower, its durable end and the last time it was caught up (Kafka's
  `lastCaughtUpTimeMs`: a fetch that reached the leader's log end, or the end the leader had
  at the follower's previous fetch);
- the **high watermark**: the lowest durable end over the in-sync set (the leader's own
  included). Everything below it is held by every in-sync replica; readers see only that;
- the acknowledgement of each publish: once the high watermark passes it, and only while at
  least `min_insync_replicas` replicas are in sync. A publish is refused (retryable) before it
  is appended when fewer are in sync, never after: one the mark passed while the set was below
  the minimum is in the shard for good (readers see it), so a refusal would only make its
  client send it again and the shard hold it twice (Kafka's NOT_ENOUGH_REPLICAS_AFTER_APPEND
  without an idempotent producer). It waits instead, and is acknowledged once the set is back
  at the minimum (a follower returns to it only holding everything below the mark), or
  refused (NOT_LEADER) when this leadership ends first;
- **in-sync set changes**, proposed, never made: a follower not caught up for
  `lag_time_max_s` is proposed for removal, a follower that reached the high watermark
  (fetching in this epoch) for return. The controller writes the change in etcd and the
  leader applies it when it reads it back (`isr_changed`). While a change is in flight the
  high watermark counts the larger set (Kafka's "maximal ISR"), so it never counts a follower
  out before the controller did;
- **fencing**: the controller's placement ends this leadership: nothing more is acknowledged
  by it. What waits is refused (NOT_LEADER, `supersede`) where this node stops holding the
  shard; where it stays a replica and follows, it is handed back (`hand_over`) and kept
  (`replica_deposed`): a publish this leader appended may have reached the new leader, and a
  refusal would then make its client store it twice. Only a fetch answer of the new leader
  settles it: acknowledged once that leader's high watermark passes it on a log never cut
  below it, refused if its records were cut or after a few seconds. While this node's etcd
  lease is not known to be alive (`renew_lease`), it acknowledges nothing and takes no publish.
  A request naming a newer epoch does not fence: a follower asks only the leader its own view
  names, so such a request means this node leads that epoch too and the follower saw the
  placement first. It is refused, retryable (UNKNOWN_LEADER_EPOCH), and the placement, once
  seen here, makes this node lead again (`hand_over`: what waits carries over). Nothing is
  acknowledged meanwhile that the newer epoch's followers do not hold: only fetches naming
  this leader's own epoch move its high watermark.
- **a graceful leave** (SIGTERM): the leaving leader, before the controller moves its
  leadership, takes no more publishes (`close`: NOT_LEADER, retryable) and lets what it holds
  commit; once the high watermark can move no further (it reached the log end, or `freeze`
  stopped it) and every in-sync follower's fetch says it knows that mark
  (`final_mark_known`), the follower the controller elects knows exactly where this leader's
  dispatching ended, and hands on only what lies above it. A drain does the same for one
  shard before the controller moves it; if the move is called off, `reopen` ends it.

Time is given by the caller (`now`, monotonic seconds); acknowledgements are handed back as
(waiter, error or None) pairs by `take_completed`, so the I/O side resolves its own futures.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from .replica_epochs import (
    EpochCache,
    EpochEndAnswer,
    EpochEndRequest,
    FetchPlan,
    FetchRequest,
    Refused,
    ReplicaError,
    epochs_in,
)

W = TypeVar("W")


@dataclass(slots=True)
class FollowerProgress:
    """What the leader knows of one follower in this epoch."""

    durable_end: int | None
    """The end of what it holds durably, from its last fetch (None: no fetch this epoch)."""
    last_caught_up: float
    last_fetch_time: float = -math.inf
    leader_end_at_last_fetch: int = 0
    known_high_watermark: int = -1
    """The high watermark its last fetch said it knew (-1: no fetch this epoch)."""


@dataclass(frozen=True, slots=True)
class IsrProposal:
    """An in-sync set the leader asks the controller to write: valid only for the leader
    epoch and the in-sync set version it was made against (the controller compares both)."""

    leader: str
    leader_epoch: int
    isr_version: int
    isr: frozenset[str]
    # the leader gives the shard up (its journal cannot write): `isr` is the set without it
    gives_up: bool = False


class LeaderReplica(Generic[W]):
    """One shard's leadership on this node, for one leader epoch (see the module docstring)."""

    def __init__(
        self,
        node_id: str,
        epoch: int,
        replicas: Sequence[str],
        isr: Iterable[str],
        *,
        min_insync: int,
        lag_time_max_s: float,
        history: EpochCache,
        log_end: int,
        durable_end: int,
        high_watermark: int,
        now: float,
        isr_version: int = 0,
        lease_deadline: float = math.inf,
    ) -> None:
        in_sync = frozenset(isr)
        if node_id not in replicas or node_id not in in_sync:
            raise ValueError(f"the leader {node_id!r} must be a replica and in sync")
        if not in_sync <= set(replicas):
            raise ValueError(f"in-sync set {sorted(in_sync)} is not within replicas {list(replicas)}")
        if min_insync < 1:
            raise ValueError("min_insync_replicas must be at least 1")
        if not 0 <= durable_end <= log_end:
            raise ValueError(f"durable end {durable_end} outside the log (end {log_end})")
        if history.latest_epoch > epoch:
            raise ValueError(f"the log already has epoch {history.latest_epoch} > {epoch}")
        self.node_id = node_id
        self.epoch = epoch
        self.replicas = tuple(replicas)
        self.min_insync = min_insync
        self.lag_time_max_s = lag_time_max_s
        self.history = history
        history.assign(epoch, log_end)
        self.epoch_start = log_end
        self._isr = in_sync
        self._isr_version = isr_version
        self._log_start = 0
        self._log_end = log_end
        self._durable_end = durable_end
        self._hw = min(max(high_watermark, 0), durable_end)
        self._lease_deadline = lease_deadline
        self._fenced = False
        self._closed = False  # a graceful leave: no more publishes
        self._frozen = False  # ... and the high watermark stays where it is
        self._followers = {
            replica: FollowerProgress(None, now if replica in in_sync else -math.inf)
            for replica in self.replicas if replica != node_id
        }
        self._waiting: list[tuple[int, int, W]] = []
        self._sequence = itertools.count()
        self._done: list[tuple[W, ReplicaError | None]] = []
        self._proposal: IsrProposal | None = None
        self._proposal_sent = False
        self._advance(now)

    # -- what the leader knows ------------------------------------------------------------

    @property
    def high_watermark(self) -> int:
        return self._hw

    @property
    def isr(self) -> frozenset[str]:
        return self._isr

    @property
    def isr_version(self) -> int:
        return self._isr_version

    @property
    def log_end(self) -> int:
        return self._log_end

    @property
    def durable_end(self) -> int:
        return self._durable_end

    @property
    def fenced(self) -> bool:
        return self._fenced

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def pending_proposal(self) -> IsrProposal | None:
        return self._proposal

    def follower(self, replica: str) -> FollowerProgress:
        return self._followers[replica]

    def lag(self, replica: str) -> int:
        """Records the follower lacks of the leader's log (all of it before its first fetch)."""
        progress = self._followers.get(replica)
        end = progress.durable_end if progress is not None else None
        return self._log_end - (end if end is not None else 0)

    def lease_alive(self, now: float) -> bool:
        return now < self._lease_deadline

    # -- publishes --------------------------------------------------------------------------

    def check_append(self, now: float) -> ReplicaError | None:
        """None when a publish may be appended now; else why not (both retryable)."""
        if self._fenced or self._closed or not self.lease_alive(now):
            return ReplicaError.NOT_LEADER
        if len(self._isr) < self.min_insync:
            return ReplicaError.NOT_ENOUGH_REPLICAS
        return None

    def appended(self, end_offset: int) -> None:
        """The local log now ends at `end_offset` (records buffered, maybe not yet durable)."""
        if end_offset < self._log_end:
            raise ValueError(f"a leader's log does not shrink: {end_offset} < {self._log_end}")
        self._log_end = end_offset

    def retained_from(self, log_start: int) -> None:
        """Retention deleted the records below `log_start`: a follower that needs them
        starts its log again there (BEHIND_LOG_START)."""
        if log_start > self._log_start:
            self._log_start = log_start
            self.history.truncate_until(log_start)

    def durable(self, end_offset: int, now: float) -> None:
        """The local log holds every record below `end_offset` under its fsync policy."""
        if end_offset > self._log_end:
            raise ValueError(f"durable end {end_offset} past the log end {self._log_end}")
        if end_offset > self._durable_end:
            self._durable_end = end_offset
            self._advance(now)

    def await_commit(self, end_offset: int, waiter: W, now: float) -> None:
        """Hand `waiter` back from `take_completed` once every record below `end_offset` is
        committed (acknowledge it: None) or cannot be acknowledged by this leader (an error)."""
        if self._fenced:
            self._done.append((waiter, ReplicaError.NOT_LEADER))
            return
        heapq.heappush(self._waiting, (end_offset, next(self._sequence), waiter))
        self._advance(now)

    def take_completed(self) -> list[tuple[W, ReplicaError | None]]:
        done, self._done = self._done, []
        return done

    # -- followers --------------------------------------------------------------------------

    def on_fetch(self, request: FetchRequest, now: float) -> FetchPlan | Refused:
        """A follower's fetch: note how far it holds the log, move the high watermark, maybe
        propose it back into the in-sync set, and say which records to send it."""
        refused = self._check_request(request.replica, request.leader_epoch)
        if refused is not None:
            return refused
        if request.fetch_offset > self._log_end:
            return Refused(ReplicaError.OUT_OF_RANGE)
        if request.fetch_offset < self._log_start:
            return Refused(ReplicaError.BEHIND_LOG_START, self._log_start)
        if not 0 <= request.durable_end <= request.fetch_offset:
            return Refused(ReplicaError.OUT_OF_RANGE)
        progress = self._followers[request.replica]
        end = request.durable_end
        if end >= self._log_end:
            progress.last_caught_up = now
        elif end >= progress.leader_end_at_last_fetch:
            progress.last_caught_up = max(progress.last_caught_up, progress.last_fetch_time)
        progress.leader_end_at_last_fetch = self._log_end
        progress.last_fetch_time = now
        progress.durable_end = end
        progress.known_high_watermark = request.high_watermark
        if (request.replica not in self._isr and self._proposal is None
                and end >= self._hw and end >= self.epoch_start):
            self._propose(self._isr | {request.replica})
        self._advance(now)
        start = request.fetch_offset
        return FetchPlan(start, self._log_end, self._hw, epochs_in(self.history, start, self._log_end))

    def on_epoch_end(self, request: EpochEndRequest) -> EpochEndAnswer | Refused:
        """KIP-101: where `request.epoch` ends in this leader's log."""
        refused = self._check_request(request.replica, request.leader_epoch)
        if refused is not None:
            return refused
        epoch, end = self.history.end_offset_for(request.epoch, self._log_end)
        return EpochEndAnswer(epoch, end)

    def _check_request(self, replica: str, leader_epoch: int) -> Refused | None:
        if self._fenced:
            return Refused(ReplicaError.NOT_LEADER)
        if leader_epoch > self.epoch:
            # the requester's view names this node the leader of a newer epoch, which this
            # node has not seen yet: not a newer leader elsewhere (see the module docstring)
            return Refused(ReplicaError.UNKNOWN_LEADER_EPOCH)
        if leader_epoch < self.epoch:
            return Refused(ReplicaError.FENCED_EPOCH)
        if replica not in self._followers:
            return Refused(ReplicaError.UNKNOWN_REPLICA)
        return None

    # -- time, the in-sync set, the lease -----------------------------------------------------

    def tick(self, now: float) -> None:
        """Propose removing the in-sync followers not caught up for `lag_time_max_s`."""
        self._advance(now)
        if self._fenced or self._proposal is not None:
            return
        lagging = {
            replica for replica in self._isr if replica != self.node_id
            and now - self._followers[replica].last_caught_up > self.lag_time_max_s
        }
        if lagging:
            self._propose(self._isr - lagging)

    def take_proposal(self) -> IsrProposal | None:
        """The in-sync set change to send to the controller, once."""
        if self._proposal is None or self._proposal_sent:
            return None
        self._proposal_sent = True
        return self._proposal

    def proposal_failed(self) -> None:
        """The controller did not write the proposal (refused, or unreachable): it may be
        made again."""
        self._proposal = None
        self._proposal_sent = False

    def isr_changed(self, isr: Iterable[str], version: int, now: float) -> None:
        """The controller wrote this in-sync set for this leader epoch (read back from etcd)."""
        if version < self._isr_version:
            return
        new = frozenset(isr)
        if self.node_id not in new:
            self.supersede()
            return
        for replica in new - self._isr:
            if replica in self._followers:
                self._followers[replica].last_caught_up = now
        self._isr = new & (set(self._followers) | {self.node_id})
        self._isr_version = version
        self._proposal = None
        self._proposal_sent = False
        self._advance(now)

    def renew_lease(self, deadline: float, now: float) -> None:
        """This node's lease is known alive until `deadline` (the last keep-alive's send time
        plus its TTL). A new lease is not a renewal: its node lost the old one, so the
        controller names leaders again; call `supersede` instead."""
        self._lease_deadline = deadline
        self._advance(now)

    def supersede(self) -> None:
        """A newer epoch exists (or this node must stop leading): refuse what waits."""
        if self._fenced:
            return
        self._fenced = True
        self._proposal = None
        self._proposal_sent = False
        while self._waiting:
            _end, _seq, waiter = heapq.heappop(self._waiting)
            self._done.append((waiter, ReplicaError.NOT_LEADER))

    def hand_over(self) -> list[tuple[int, W]]:
        """This leadership ends while this node keeps the shard's log (the controller changed
        the replicas: this node leads again in a newer epoch, or holds the shard alone; or
        another node leads now and this one follows it): fenced as by `supersede`, but what
        waits is handed back, not refused, as (log end it waits for, waiter), for what comes
        next to acknowledge (as Kafka's delayed produce outlives a leader epoch bump on the
        same broker), or, for a follower, to settle by the new leader's high watermark
        (`replica_deposed`)."""
        if self._fenced:
            return []
        self._fenced = True
        self._proposal = None
        self._proposal_sent = False
        waiting = [(end, waiter) for end, _seq, waiter in sorted(self._waiting, key=lambda w: w[:2])]
        self._waiting = []
        return waiting

    # -- a graceful leave ---------------------------------------------------------------------

    def close(self) -> None:
        """This node leaves (see the module docstring): it takes no more publishes, and what
        it holds goes on committing."""
        self._closed = True

    def freeze(self) -> None:
        """Acknowledge nothing more: the high watermark stays where it is, so that the mark
        the followers know is the one this leader ends at (what waits is refused when the
        leadership ends, and the next leader hands it on)."""
        self._frozen = True

    def reopen(self) -> None:
        """A drain's quiesce given up while this leadership stands: publishes are taken,
        and commits made, again."""
        self._closed = self._frozen = False

    def final_mark_known(self) -> bool:
        """Whether this closed leader's high watermark can move no further (it reached the
        log end, or it is frozen) and every in-sync follower said in a fetch that it knows it:
        then it is the offset this leader dispatched to, and the follower the controller elects
        knows it."""
        if not self._closed or (not self._frozen and self._hw < self._log_end):
            return False
        return all(self._followers[replica].known_high_watermark >= self._hw
                   for replica in self._maximal_isr() if replica != self.node_id)

    # -- the high watermark -----------------------------------------------------------------

    def _maximal_isr(self) -> frozenset[str]:
        if self._proposal is None:
            return self._isr
        return self._isr | self._proposal.isr

    def _propose(self, isr: frozenset[str]) -> None:
        self._proposal = IsrProposal(self.node_id, self.epoch, self._isr_version, isr)
        self._proposal_sent = False

    def _advance(self, now: float) -> None:
        if self._fenced or self._frozen or not self.lease_alive(now):
            return
        candidate = self._durable_end
        for replica in self._maximal_isr():
            if replica == self.node_id:
                continue
            end = self._followers[replica].durable_end
            if end is None:
                return  # not heard from in this epoch: the mark stays
            candidate = min(candidate, end)
        if candidate > self._hw:
            self._hw = candidate
        waiting = self._waiting
        if not waiting or waiting[0][0] > self._hw or len(self._isr) < self.min_insync:
            # below the minimum, what the mark passed waits (see the module docstring)
            return
        while waiting and waiting[0][0] <= self._hw:
            _end, _seq, waiter = heapq.heappop(waiting)
            self._done.append((waiter, None))
