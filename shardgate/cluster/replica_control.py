"""The controller's decisions on one replicated shard: who leads, in which epoch, and which
replicas are in sync. Pure functions; the controller writes each result in one etcd
transaction that compares the shard's previous record, so a deposed controller, or a proposal
made against an older in-sync set, changes nothing.

As Kafka's controller does: a leader that is live stays; a dead leader is replaced by the
first live replica (in the shard's replica order) of the in-sync set, with the next epoch,
and dead replicas leave the in-sync set; with no live in-sync replica the shard has no
leader (no unclean election: a replica that was not in sync never leads, so nothing
acknowledged is lost), and its in-sync set is kept so that one of them leads when it is back.
A leader whose node registers again (a restarted process) leads again only in a new epoch:
what its previous life appended but had not made durable may be on followers, and it would
otherwise write other records at those offsets in the same epoch.
A leader's proposal to change the in-sync set is written only if it was made in the current
epoch against the current in-sync set version, keeps the leader, stays within the replicas
and adds only live ones. A leader may also give the shard up (`gives_up`: its journal could
not write, a full disk; Kafka moves leaders off a failed log directory so): the first live
replica of the in-sync set it proposes (the current one without it) leads in the next epoch,
and the old leader leaves the in-sync set; with no such replica the same leader leads again in
a new epoch (it holds every acknowledged record, and it tries its disk again).
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, replace

from .replica_leader import IsrProposal


@dataclass(frozen=True, slots=True)
class ReplicaSet:
    """One shard's replication record as the controller writes it."""

    leader: str | None
    replicas: tuple[str, ...]
    isr: frozenset[str]
    epoch: int
    isr_version: int = 0


def elect(current: ReplicaSet, live: Set[str]) -> ReplicaSet:
    """The record after the controller saw which nodes are live (the same object when
    nothing changes)."""
    if current.leader is not None and current.leader in live:
        isr = frozenset(r for r in current.isr if r in live) | {current.leader}
        if isr == current.isr:
            return current
        return replace(current, isr=isr, isr_version=current.isr_version + 1)
    candidates = [r for r in current.replicas if r in current.isr and r in live]
    if not candidates:
        if current.leader is None:
            return current
        return replace(current, leader=None, epoch=current.epoch + 1)
    leader = candidates[0]
    isr = frozenset(candidates)
    return ReplicaSet(leader, current.replicas, isr, current.epoch + 1,
                      current.isr_version + (isr != current.isr))


def rejoined(current: ReplicaSet, node: str) -> ReplicaSet:
    """The record after `node` registered again (a new process, a new lease)."""
    if current.leader != node:
        return current
    return replace(current, epoch=current.epoch + 1)


def apply_proposal(current: ReplicaSet, proposal: IsrProposal, live: Set[str]) -> ReplicaSet | None:
    """The record with the leader's proposed in-sync set, or None when it is refused."""
    if (proposal.leader != current.leader or proposal.leader_epoch != current.epoch
            or proposal.isr_version != current.isr_version):
        return None
    new = proposal.isr
    if proposal.gives_up:
        candidates = [r for r in current.replicas if r in new and r in current.isr and r in live]
        if not candidates:
            return replace(current, epoch=current.epoch + 1)
        return ReplicaSet(candidates[0], current.replicas, frozenset(candidates),
                          current.epoch + 1, current.isr_version + 1)
    if proposal.leader not in new or not new <= set(current.replicas):
        return None
    if not (new - current.isr) <= live:
        return None
    if new == current.isr:
        return None
    return replace(current, isr=new, isr_version=current.isr_version + 1)
