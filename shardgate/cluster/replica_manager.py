"""Which replicated shards this node leads or follows, kept in step with the placement (after
Kafka's `ReplicaManager`).

For every shard with more than one replica that names this node, the placement (leader,
replicas, in-sync set, leader epoch; `membership.ShardAssignment`) says what this node is:
- the leader: its `ReplicatedShardLog` leads under that epoch (a `LeaderReplica` built from the
  journal: its end, what is durable, the high watermark it knew as a follower); a changed
  in-sync set of the same epoch is applied to it;
- a follower: the log gives up any leadership (`depose`: waiting publishes are kept, and
  acknowledged once the new leader's high watermark passes them, or refused, retryable, if
  the truncation cuts them or after `deposed_wait_s`) and a `follow` task fetches from the
  leader, first cutting what diverged (KIP-101);
- neither (no longer a replica): it stops both (waiting publishes are refused).
A node leads only in an epoch its log has not seen, or that this process itself led: a
placement naming it leader in an epoch its log already holds was made for an earlier run of
this node (only a leader starts an epoch), whose followers may hold records that run sent
them before they were durable on its disk and lost with it. Leading that epoch again could
give one offset two records in one epoch, which truncation by epochs cannot see; so it waits,
neither leading nor following, for the controller, which names a node registered again in a
new epoch (`placement.ShardPlacement.leader_lease`).

A change of role waits for the journal to have written what it holds, then cuts the tail a
crash left unwritten (offsets reserved but never written: nobody saw them, readers stay
below the high watermark), so the log ends at its last durable record. Changes of one shard
run one after the other, the latest placement winning.

Every `tick_s` the leaders look at their followers' lag; an in-sync set change they propose
goes to `propose` (the controller writes it in etcd; the leader applies it when the placement
shows it; one the placement has not shown after `proposal_timeout_s` counts as refused, and
the leader may propose again). A leader whose journal failed a commit resigned
(`ReplicatedShardLog`) and gives the shard up: it proposes the in-sync set without itself
(`gives_up`), again every `proposal_timeout_s` until the placement moves on, and the
controller elects another in-sync replica in a new epoch. The lease deadline
(`lease_deadline`) fences leaders that cannot prove their lease is alive. Nothing here opens
a socket: followers reach leaders through a `ReplicaTransport`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..storage.interfaces import StorageUnavailable
from ..storage.journal import JournalStorage
from .membership import ClusterView, ShardAssignment
from .replica_follow import FollowerLog, ReplicaTransport, follow
from .replica_follower import FollowerReplica
from .replica_leader import IsrProposal, LeaderReplica
from .replica_log import DEPOSED_WAIT_S, ReplicatedShardLog

log = logging.getLogger(__name__)

ShardKey = tuple[str, int]
Propose = Callable[[str, int, IsrProposal], None]


@dataclass(frozen=True, slots=True)
class Role:
    """What this node is for one shard under one placement."""

    leader: str
    epoch: int
    replicas: tuple[str, ...]
    isr: tuple[str, ...]
    isr_version: int = 0
    adding: tuple[str, ...] = ()

    @property
    def counted(self) -> int:
        """The replicas that cap the in-sync minimum (those still being added do not)."""
        return max(1, len(self.replicas) - len(self.adding))


class _Shard:
    __slots__ = ("log", "role", "wanted", "task", "follower_task", "changing", "proposed_at",
                 "led_epoch", "gave_up")

    def __init__(self, shard_log: ReplicatedShardLog) -> None:
        self.log = shard_log
        self.role: Role | None = None
        self.wanted: Role | None = None
        self.task: asyncio.Task[None] | None = None
        self.follower_task: asyncio.Task[None] | None = None
        self.changing = False
        self.proposed_at = math.inf
        # the last epoch this process led the shard in (-1: none)
        self.led_epoch = -1
        # the epoch whose leadership this node gave up after a failed journal write (-1: none)
        self.gave_up = -1


class ReplicaManager:
    """This node's replicated shards (see the module docstring)."""

    def __init__(
        self,
        node_id: str,
        view: ClusterView,
        journal: JournalStorage,
        transport: Callable[[str, int], ReplicaTransport],
        *,
        min_insync: Callable[[str], int],
        lag_time_max_s: float = 10.0,
        tick_s: float = 0.5,
        proposal_timeout_s: float = 5.0,
        propose: Propose | None = None,
        lease_deadline: Callable[[], float] = lambda: math.inf,
        clock: Callable[[], float] = time.monotonic,
        on_role: Callable[[str, int], None] | None = None,
        deposed_wait_s: float = DEPOSED_WAIT_S,
        hand_off: Callable[[list[asyncio.Future[None]]], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.view = view
        self.journal = journal
        # makes a shard's transport (its requests name the shard:
        # `replica_rpc.ReplicaService.transport`)
        self.transport = transport
        self.min_insync = min_insync
        self.lag_time_max_s = lag_time_max_s
        self.tick_s = tick_s
        self.proposal_timeout_s = proposal_timeout_s
        self.propose = propose
        self.lease_deadline = lease_deadline
        self.clock = clock
        # told after each change of a shard's role took effect (the log is cut and led or
        # followed from then on)
        self.on_role = on_role
        # how long a deposed leader keeps what waited (`ReplicatedShardLog.depose`), and whom
        # it tells that those publishes are not dispatched here (the core)
        self.deposed_wait_s = deposed_wait_s
        self.hand_off = hand_off
        self._shards: dict[ShardKey, _Shard] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._closed = False

    # -- what the core and the peer link use ------------------------------------------------

    def shard_log(self, stream: str, shard: int) -> ReplicatedShardLog:
        """The replicated log of a shard (the core's `ShardLog` for it on this node)."""
        entry = self._shards.get((stream, shard))
        if entry is None:
            journal_log = self.journal.open_shard(stream, shard)
            replicated = ReplicatedShardLog(journal_log, self.clock, f"{stream}/{shard}")
            replicated.deposed_wait_s = self.deposed_wait_s
            replicated.hand_off = self.hand_off
            entry = self._shards[(stream, shard)] = _Shard(replicated)
            replicated.gave_up = lambda leader, entry=entry: self._gave_up(
                stream, shard, entry, leader.epoch)
        return entry.log

    def leading(self, stream: str, shard: int) -> ReplicatedShardLog | None:
        """The shard's log when this node leads it now (answers fetches), else None."""
        entry = self._shards.get((stream, shard))
        return entry.log if entry is not None and entry.log.leader is not None else None

    def replicated(self, stream: str, shard: int) -> bool:
        """True when the placement makes this node a replica of a shard of several replicas
        (the core's log of it is then `shard_log`, even while its role is changing)."""
        entry = self._shards.get((stream, shard))
        return entry is not None and entry.wanted is not None

    def knows(self, stream: str, shard: int) -> bool:
        return (stream, shard) in self._shards

    def role(self, stream: str, shard: int) -> Role | None:
        entry = self._shards.get((stream, shard))
        return entry.role if entry is not None else None

    # -- following the placement -------------------------------------------------------------

    def start(self) -> None:
        self.view.on_change(self.apply_view)
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    def watch(self, stream: str, shard: int) -> None:
        """Take `stream`/`shard` into account (a stream's shards, when it is known)."""
        self.shard_log(stream, shard)
        self._apply(stream, shard)

    def apply_view(self) -> None:
        """Bring every known shard in step with the view (called on every view change)."""
        if self._closed:
            return
        for stream, shard in list(self._shards):
            self._apply(stream, shard)

    def _apply(self, stream: str, shard: int) -> None:
        entry = self._shards[(stream, shard)]
        assignment = self.view.leader(stream, shard)
        entry.wanted = self._role_of(assignment)
        if entry.wanted == entry.role or entry.changing:
            return
        if (entry.role is not None and entry.wanted is not None
                and entry.role.leader == entry.wanted.leader == self.node_id
                and entry.role.epoch == entry.wanted.epoch
                and entry.role.replicas == entry.wanted.replicas):
            # the same leadership, a new in-sync set
            self._isr_changed(stream, entry, entry.wanted)
            return
        wanted = entry.wanted
        if self._leading_live(entry) and (
                (wanted is not None and wanted.leader == self.node_id
                 and entry.role is not None and wanted.epoch > entry.role.epoch)
                or (wanted is None and assignment is not None
                    and assignment.replicas == (self.node_id,))):
            # This node leads and goes on holding the log it leads (its replicas changed: it
            # leads again in a newer epoch, or holds the shard alone): no role to stop and
            # nothing to cut, so at once, and what waits for its commit carries over instead
            # of being refused (its record is in the log and would be delivered all the same).
            if wanted is None:
                entry.log.hold_alone()
            else:
                self._lead(stream, shard, entry, wanted, again=True)
            entry.role = wanted
            if self.on_role is not None:
                self.on_role(stream, shard)
            return
        if (entry.role is None and wanted is not None and wanted.leader == self.node_id
                and self._may_lead(entry, wanted)
                and entry.log.leader is None and entry.follower_task is None
                and (entry.log.log.next_offset == entry.log.log.committed_offset
                     or entry.log.log.commit_waiter() is not None)):
            # a first leadership with nothing to stop and nothing unwritten to cut: a new
            # shard, or one this node held alone (what it appended is on its way to the
            # disk, not a tail a crash left): lead at once, so a publish right after the
            # placement is not refused
            self._lead(stream, shard, entry, wanted)
            entry.role = wanted
            if self.on_role is not None:
                self.on_role(stream, shard)
            return
        entry.changing = True
        entry.task = asyncio.get_running_loop().create_task(self._converge(stream, shard, entry))

    def _role_of(self, assignment: ShardAssignment | None) -> Role | None:
        if assignment is None or len(assignment.replicas) < 2 or self.node_id not in assignment.replicas:
            return None
        return Role(assignment.leader, assignment.leader_epoch, assignment.replicas, assignment.isr,
                    assignment.isr_version, assignment.adding)

    def _isr_changed(self, stream: str, entry: _Shard, role: Role) -> None:
        leader = entry.log.leader
        if leader is not None:
            # the controller's version (`ShardPlacement.isr_version`), which proposals name
            leader.min_insync = min(self.min_insync(stream), role.counted)
            leader.isr_changed(role.isr, role.isr_version, self.clock())
            entry.log.tick()
        entry.role = role

    async def _converge(self, stream: str, shard: int, entry: _Shard) -> None:
        try:
            while not self._closed and entry.wanted != entry.role:
                wanted = entry.wanted
                await self._stop_role(entry, keep=wanted is not None)
                if wanted is not None:
                    await self._cut_unwritten(entry)
                    if wanted.leader != self.node_id:
                        self._follow(stream, shard, entry, wanted)
                    elif self._may_lead(entry, wanted):
                        self._lead(stream, shard, entry, wanted)
                    else:
                        log.info("%s/%d: placed as leader in epoch %d, which an earlier run "
                                 "of this node led; waiting for a new epoch", stream, shard,
                                 wanted.epoch)
                entry.role = wanted
                if self.on_role is not None:
                    self.on_role(stream, shard)
        except Exception:
            log.exception("%s/%d: changing its replica role failed; retried at the next "
                          "placement change", stream, shard)
            entry.role = None
        finally:
            entry.changing = False

    async def _stop_role(self, entry: _Shard, *, keep: bool) -> None:
        """End this node's role; with `keep` (it stays a replica), what a leadership here
        had not acknowledged waits for the next leader's high watermark (`depose`)."""
        if keep:
            entry.log.depose()
        else:
            entry.log.resign()
        task, entry.follower_task = entry.follower_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _cut_unwritten(self, entry: _Shard) -> None:
        journal_log = entry.log.log
        await journal_log.flush()
        if journal_log.next_offset > journal_log.committed_offset:
            entry.log.truncate_to(journal_log.committed_offset)

    def _leading_live(self, entry: _Shard) -> bool:
        """This node leads the shard now, in the role it was given, and may acknowledge."""
        leader = entry.log.leader
        return (entry.role is not None and entry.role.leader == self.node_id
                and leader is not None and not leader.fenced
                and leader.lease_alive(self.clock()) and entry.follower_task is None)

    @staticmethod
    def _may_lead(entry: _Shard, role: Role) -> bool:
        """Whether this process may lead in `role.epoch` (see the module docstring)."""
        return (role.epoch > entry.log.log.leader_epochs.latest_epoch
                or role.epoch == entry.led_epoch)

    def _lead(self, stream: str, shard: int, entry: _Shard, role: Role, *,
              again: bool = False) -> None:
        journal_log = entry.log.log
        now = self.clock()
        leader: LeaderReplica[asyncio.Future[None]] = LeaderReplica(
            self.node_id, role.epoch, role.replicas, role.isr,
            min_insync=min(self.min_insync(stream), role.counted),
            lag_time_max_s=self.lag_time_max_s, history=journal_log.leader_epochs,
            log_end=journal_log.next_offset, durable_end=journal_log.committed_offset,
            high_watermark=entry.log.high_watermark, now=now,
            isr_version=role.isr_version, lease_deadline=self.lease_deadline())
        if again:
            entry.log.lead_again(leader)
        else:
            entry.log.lead(leader)
        entry.led_epoch = role.epoch
        log.info("%s/%d: leading in epoch %d (in sync: %s)", stream, shard, role.epoch,
                 ", ".join(role.isr))

    def _follow(self, stream: str, shard: int, entry: _Shard, role: Role) -> None:
        journal_log = entry.log.log
        follower = FollowerReplica(
            self.node_id, role.leader, role.epoch, history=journal_log.leader_epochs,
            log_end=journal_log.next_offset, durable_end=journal_log.committed_offset,
            high_watermark=entry.log.high_watermark)
        # having just given the leadership up for a failed write, it fetches only once its
        # disk takes a write again (`FollowerLog.recover`), not at once into the in-sync set
        gave_up = entry.gave_up >= 0 and entry.gave_up == entry.led_epoch
        follower_log = FollowerLog(journal_log, follower, entry.log, failed=StorageUnavailable(
            f"{journal_log.directory}: the journal failed a write in epoch {entry.gave_up}")
            if gave_up else None)
        entry.follower_task = asyncio.get_running_loop().create_task(
            follow(follower_log, self.transport(stream, shard)))

    def _gave_up(self, stream: str, shard: int, entry: _Shard, epoch: int) -> None:
        """The journal failed a commit while this node led in `epoch`, and it resigned: ask
        the controller to move the leadership to another in-sync replica (`replica_control.
        apply_proposal`); asked again at the ticks until the placement moves on."""
        entry.gave_up = epoch
        entry.proposed_at = -math.inf
        self._propose_give_up(stream, shard, entry, self.clock())

    def _propose_give_up(self, stream: str, shard: int, entry: _Shard, now: float) -> None:
        role = entry.role
        if (self.propose is None or role is None or role.leader != self.node_id
                or role.epoch != entry.gave_up or entry.log.leader is not None
                or now - entry.proposed_at <= self.proposal_timeout_s):
            return
        entry.proposed_at = now
        log.warning("%s/%d: giving up the leadership of epoch %d (its journal cannot write)",
                    stream, shard, role.epoch)
        self.propose(stream, shard, IsrProposal(self.node_id, role.epoch, role.isr_version,
                                                frozenset(role.isr) - {self.node_id},
                                                gives_up=True))

    # -- time ---------------------------------------------------------------------------------

    async def _tick(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.tick_s)
            self.tick()

    def tick(self) -> None:
        """Renew the leaders' lease deadline, let them check their followers' lag and send
        what they propose to the controller."""
        deadline = self.lease_deadline()
        now = self.clock()
        for (stream, shard), entry in self._shards.items():
            leader = entry.log.leader
            if leader is None:
                self._propose_give_up(stream, shard, entry, now)
                entry.log.tick()  # what a deposed leadership kept expires
                continue
            leader.renew_lease(deadline, now)
            if leader.pending_proposal is None:
                entry.proposed_at = math.inf
            elif now - entry.proposed_at > self.proposal_timeout_s:
                leader.proposal_failed()  # the controller did not write it
                entry.proposed_at = math.inf
            entry.log.tick()
            proposal = leader.take_proposal()
            if proposal is not None and self.propose is not None:
                entry.proposed_at = now
                self.propose(stream, shard, proposal)

    async def close(self) -> None:
        self._closed = True
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for entry in self._shards.values():
            if entry.task is not None:
                entry.task.cancel()
                await asyncio.gather(entry.task, return_exceptions=True)
            await self._stop_role(entry, keep=False)
