"""Where the replicas of replicated shards go, and who leads them: the controller's rules for
shards of streams with more than one replica (`replication.stream_replication`), as one pure
function it runs at every pass. Every change it makes is written by the controller in one etcd
transaction (`controller.py`, `control_store.py`); the decisions on one record are `replica_control`'s.

Per shard, in order:
- a new shard gets `replicas` nodes (capped by the nodes that may take replicas: live, not
  leaving, not drained), its leader the node leading the fewest shards, the others the nodes
  holding the fewest replicas; all in sync (every log is empty), epoch 1 (or the next one);
- a leader registered again since the last pass (`rejoined`: a new lease) leads again only in
  a new epoch;
- `elect`: a dead leader is replaced by the first live in-sync replica with the next epoch, and
  dead replicas leave the in-sync set; with no live in-sync replica the record stays as it is,
  its dead leader named (the shard is unavailable, as its node is not live), unless
  `unclean` allows the first live replica to lead (it may lack acknowledged records);
- a leader's in-sync set proposal is applied (`apply_proposal`);
- drain: a draining node's replica is first matched by a new replica on another node; once
  every other replica is in sync (the new one caught up), leadership moves off the draining
  node (next epoch) and its replica is removed. With no node to take its place, it is removed
  once the others are in sync. A live leader that is not leaving is moved only once it
  quiesced the shard (`leader_handoff.py`): the placer wants a request for it
  (`ReplicaPlacer.quiesce_wanted`, which the controller keeps in etcd) until the leader
  answered for its epoch (`Nodes.quiesced`), or `quiesce_wait_s` passed (then it moves as
  before, and the new leader may dispatch some messages again). A leaving node quiesced what
  it leads before it said it leaves;
- a replica added by the rules below is `adding` until it is first in sync: until then it does
  not count towards the replicas that cap the in-sync minimum, so a shard that grows from
  one replica to two goes on acknowledging while the new one copies the log;
- re-replication: a shard with fewer live replicas than its setting wants (after a node died
  and stayed away `re_replicate_after_s`, or when it was placed while fewer nodes were live)
  gets a replica on another node in place of a dead one; the new replica is not in sync until
  the leader says it caught up.
- shrink: a shard with more replicas than its setting wants while none drains (a leaving
  node's drain cut short: the node stopped before the copy was in sync, then came back) drops
  the surplus, its leader kept (dead replicas first, then those out of sync).
Nothing here changes a shard whose record is as it should be: the same object is returned, so
the controller writes only what changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass, field
from functools import partial

from .placement import ShardPlacement
from .replica_control import ReplicaSet, apply_proposal, elect, rejoined
from .replica_leader import IsrProposal

log = logging.getLogger(__name__)

ShardKey = tuple[str, int]
# how long the controller waits for a live leader's answer to its request to quiesce a shard
# before it moves the leadership anyway (the leader itself waits at most 3 s for its followers:
# `leader_handoff.QUIESCE_S`)
QUIESCE_WAIT_S = 6.0


@dataclass(frozen=True, slots=True)
class ReplicatedSpec:
    """A shard and how many replicas its stream wants."""

    stream: str
    shard: int
    replicas: int


@dataclass(slots=True)
class Nodes:
    """What the controller knows of the nodes at one pass."""

    alive: frozenset[str]
    """Registered under a live lease (leaving and draining ones included)."""
    placeable: frozenset[str]
    """Alive, not leaving, not draining: may receive new replicas and leaderships."""
    rejoined: frozenset[str] = frozenset()
    """Registered again (a new lease) since the previous pass."""
    draining: frozenset[str] = frozenset()
    """Draining or leaving."""
    leaving: frozenset[str] = frozenset()
    """Leaving (SIGTERM): each quiesced the shards it leads before it said so."""
    quiesced: Mapping[ShardKey, tuple[str, int]] = field(default_factory=dict)
    """The shards whose leader answered a request to quiesce them: (leader, its epoch)."""


@dataclass(slots=True)
class ReplicaPlacer:
    """The controller's state between passes: since when each shard has lacked a live replica
    (kept in memory: a new controller starts counting again)."""

    re_replicate_after_s: float = 30.0
    unclean: bool = False
    under_replicated_since: dict[ShardKey, float] = field(default_factory=dict)
    quiesce_wait_s: float = QUIESCE_WAIT_S
    quiesce_wanted: dict[ShardKey, tuple[str, int]] = field(default_factory=dict)
    """After a pass: the shards whose live leader should quiesce them before the move that
    waits for it: (leader, its epoch); the controller keeps these requests in etcd."""
    quiesce_since: dict[ShardKey, tuple[str, int, float]] = field(default_factory=dict)
    """Since when each such move has waited (leader, epoch, time)."""

    def place(
        self,
        specs: Iterable[ReplicatedSpec],
        current: Mapping[ShardKey, ShardPlacement],
        nodes: Nodes,
        now: float,
        proposals: Mapping[ShardKey, IsrProposal] | None = None,
    ) -> dict[ShardKey, ShardPlacement]:
        """The placement of every shard in `specs` (a shard with no placeable node to go to
        is left out)."""
        specs = list(specs)
        proposals = proposals or {}
        leaders: dict[str, int] = dict.fromkeys(nodes.placeable, 0)
        holding: dict[str, int] = dict.fromkeys(nodes.placeable, 0)
        for held in current.values():
            if held.leader in leaders:
                leaders[held.leader] += 1
            for replica in held.replicas:
                if replica in holding:
                    holding[replica] += 1
        result: dict[ShardKey, ShardPlacement] = {}
        wanted_keys = set()
        quiesce: dict[ShardKey, tuple[str, int]] = {}
        for spec in specs:
            key = (spec.stream, spec.shard)
            wanted_keys.add(key)
            placed = current.get(key)
            if placed is None:
                fresh = _new_shard(spec.replicas, nodes.placeable, leaders, holding)
                if fresh is not None:
                    result[key] = fresh
                continue
            record = _record(placed)
            if record.leader in nodes.rejoined:
                record = rejoined(record, placed.leader)
            record = self._elect(record, nodes)
            proposal = proposals.get(key)
            if proposal is not None:
                record = apply_proposal(record, proposal, nodes.alive) or record
            record = _drain(record, spec.replicas, nodes, holding, partial(
                self._may_move, key, nodes=nodes, now=now, quiesce=quiesce))
            record = self._re_replicate(key, record, spec.replicas, nodes, holding, now)
            record = _shrink(record, spec.replicas, nodes)
            result[key] = _placement(record, placed)
        for key in list(self.under_replicated_since):
            if key not in wanted_keys:
                del self.under_replicated_since[key]
        self.quiesce_wanted = quiesce
        for key in list(self.quiesce_since):
            if key not in quiesce:
                del self.quiesce_since[key]
        return result

    def _may_move(self, key: ShardKey, record: ReplicaSet, nodes: Nodes, now: float,
                  quiesce: dict[ShardKey, tuple[str, int]]) -> bool:
        """Whether the leadership of `record` may move off its leader now (see the module
        docstring); where not, the request that it quiesce the shard goes into `quiesce`."""
        leader = record.leader
        if leader is None or leader not in nodes.alive or leader in nodes.leaving:
            return True
        asked = (leader, record.epoch)
        if nodes.quiesced.get(key) == asked:
            return True
        since = self.quiesce_since.get(key)
        if since is None or since[:2] != asked:
            since = self.quiesce_since[key] = (*asked, now)
        if now - since[2] >= self.quiesce_wait_s:
            log.warning("%s/%d: leader %s did not quiesce the shard within %.1f s; moving it "
                        "anyway (the next leader may dispatch some messages again)",
                        key[0], key[1], leader, self.quiesce_wait_s)
            return True
        quiesce[key] = asked
        return False

    def _elect(self, record: ReplicaSet, nodes: Nodes) -> ReplicaSet:
        elected = elect(record, nodes.alive)
        if elected.leader is not None:
            return elected
        if self.unclean:
            live = [replica for replica in record.replicas if replica in nodes.alive]
            if live:
                return ReplicaSet(live[0], record.replicas, frozenset({live[0]}),
                                  record.epoch + 1, record.isr_version + 1)
        # no live in-sync replica: keep the record (its dead leader named, its in-sync set
        # kept) so that one of them leads when it is back; `elect` then gives a new epoch
        return record

    def _re_replicate(self, key: ShardKey, record: ReplicaSet, wanted: int, nodes: Nodes,
                      holding: dict[str, int], now: float) -> ReplicaSet:
        dead = [replica for replica in record.replicas if replica not in nodes.alive]
        kept = [replica for replica in record.replicas if replica not in nodes.draining]
        missing = wanted - len(kept)
        if not dead and missing <= 0:
            self.under_replicated_since.pop(key, None)
            return record
        if record.leader is None or record.leader not in nodes.alive:
            return record  # unavailable: nothing to copy from until a leader is back
        replicas = list(record.replicas)
        if missing > 0:
            # placed while fewer nodes were live (nothing is dead): grow at once
            for _ in range(missing):
                node = _fewest(nodes.placeable - set(replicas), holding)
                if node is None:
                    break
                replicas.append(node)
                holding[node] += 1
        if dead:
            since = self.under_replicated_since.setdefault(key, now)
            if now - since >= self.re_replicate_after_s:
                for gone in dead:
                    if gone in record.isr:
                        continue  # one of the last in-sync replicas: its data may be needed
                    node = _fewest(nodes.placeable - set(replicas), holding)
                    if node is None:
                        break
                    replicas[replicas.index(gone)] = node
                    holding[node] += 1
        if tuple(replicas) == record.replicas:
            return record
        still_dead = any(replica not in nodes.alive for replica in replicas)
        if not still_dead:
            self.under_replicated_since.pop(key, None)
        return ReplicaSet(record.leader, tuple(replicas), record.isr, record.epoch,
                          record.isr_version)


def _record(placed: ShardPlacement) -> ReplicaSet:
    return ReplicaSet(placed.leader, placed.replicas, frozenset(placed.isr), placed.leader_epoch,
                      placed.isr_version)


def _placement(record: ReplicaSet, placed: ShardPlacement) -> ShardPlacement:
    """The record as a `ShardPlacement`: `placed` itself when nothing changed (no write). A
    change of the replicas under the same leader comes with a new epoch too, so the leader
    leads again knowing its new followers (and fetches of the old set are refused)."""
    leader = record.leader
    if leader is None:
        return placed
    epoch = record.epoch
    if record.replicas != placed.replicas and epoch == placed.leader_epoch:
        epoch += 1
    # the replicas keep their order (the first live in-sync one leads after a failover)
    isr = tuple(r for r in record.replicas if r in record.isr)
    # a replica added now, or added before and not in sync since, is still being added
    added = set(record.replicas) - set(placed.replicas)
    adding = tuple(r for r in record.replicas
                   if (r in added or r in placed.adding) and r not in record.isr)
    new = ShardPlacement(leader, record.replicas, isr, epoch, record.isr_version, adding)
    return placed if new == placed else new


def _fewest(candidates: Set[str], holding: Mapping[str, int]) -> str | None:
    if not candidates:
        return None
    return min(candidates, key=lambda node: (holding.get(node, 0), node))


def _new_shard(wanted: int, placeable: frozenset[str], leaders: dict[str, int],
               holding: dict[str, int]) -> ShardPlacement | None:
    if not placeable:
        return None
    leader = min(placeable, key=lambda node: (leaders[node], holding[node], node))
    replicas = [leader]
    while len(replicas) < wanted:
        node = _fewest(placeable - set(replicas), holding)
        if node is None:
            break
        replicas.append(node)
    leaders[leader] += 1
    for node in replicas:
        holding[node] += 1
    return ShardPlacement(leader, tuple(replicas), tuple(replicas), 1)


def _drain(record: ReplicaSet, wanted: int, nodes: Nodes, holding: dict[str, int],
           may_move: Callable[[ReplicaSet], bool] = lambda _record: True) -> ReplicaSet:
    """Move a draining node's replica (and leadership) off it (see the module docstring);
    `may_move` says whether a draining leader may be moved now."""
    draining = [replica for replica in record.replicas if replica in nodes.draining]
    if not draining or record.leader is None or record.leader not in nodes.alive:
        return record
    replicas = list(record.replicas)
    kept = [replica for replica in replicas if replica not in nodes.draining]
    # first a new replica for each draining one, as far as nodes allow
    while len(kept) < wanted:
        node = _fewest(nodes.placeable - set(replicas), holding)
        if node is None:
            break
        replicas.append(node)
        kept.append(node)
        holding[node] += 1
    if tuple(replicas) != record.replicas:
        return ReplicaSet(record.leader, tuple(replicas), record.isr, record.epoch,
                          record.isr_version)
    # then, once every kept replica is in sync (the new ones caught up), off it goes
    in_sync = [replica for replica in kept if replica in record.isr and replica in nodes.alive]
    if not kept or len(in_sync) < len([r for r in kept if r in nodes.alive]) or not in_sync:
        return record
    leader, epoch = record.leader, record.epoch
    if leader in nodes.draining:
        if not may_move(record):
            return record
        leader, epoch = in_sync[0], epoch + 1
    remaining = tuple(replica for replica in replicas if replica not in nodes.draining)
    isr = frozenset(replica for replica in record.isr if replica in remaining)
    return ReplicaSet(leader, remaining, isr, epoch, record.isr_version + 1)


def _shrink(record: ReplicaSet, wanted: int, nodes: Nodes) -> ReplicaSet:
    """A shard holding more replicas than its stream wants while none of them drains (a
    leaving node's drain cut short: it stopped before the copy was in sync, then came back)
    goes back to `wanted`, its leader kept: dead replicas go first, then those out of sync,
    then the last in order."""
    surplus = len(record.replicas) - wanted
    if (surplus <= 0 or record.leader is None or record.leader not in nodes.alive
            or any(replica in nodes.draining for replica in record.replicas)):
        return record
    others = [replica for replica in record.replicas if replica != record.leader]
    others.sort(key=lambda replica: (replica in nodes.alive, replica in record.isr,
                                     -record.replicas.index(replica)))
    dropped = set(others[:surplus])
    remaining = tuple(replica for replica in record.replicas if replica not in dropped)
    isr = frozenset(replica for replica in record.isr if replica in remaining)
    return ReplicaSet(record.leader, remaining, isr, record.epoch, record.isr_version + 1)


def placed_nodes(placement: Mapping[ShardKey, ShardPlacement], node: str) -> list[ShardKey]:
    """The shards `node` holds a replica of (a drained node holds none)."""
    return sorted(key for key, placed in placement.items() if node in placed.replicas)
