"""Placement: which nodes hold each stream shard and which one leads it. A pure function the
controller runs, and the value it writes to etcd.

A shard's placement is a `ShardPlacement`: its leader, its replicas (in preference order: a
new shard's leader first), the in-sync replicas (those that hold everything the leader
acknowledged) and the leader epoch, bumped on every change of leader (Kafka's partition
state). A shard of a stream with one replica (`replication.py`) has its leader alone, placed
by `place()` here; shards of replicated streams are placed by `replica_placement.py`. The
controller writes the whole placement of a stream as one value, with every changed stream in
one etcd transaction (`controller.py`, written by `control_store.py`).

Rules, in order:
- a shard stays where it is while its node is live (no needless moves);
- a non-reliable shard of a dead or leaving node, or a new one, goes to the live node with
  the fewest shards (ties: the least load, then the node id);
- a reliable shard keeps its node even when that node is dead or leaving: its log lives on
  that node's disk (replication is not there yet), so it is unavailable until the node
  returns rather than silently moved to an empty log; a new reliable shard goes to the
  least-loaded live node like any other. The exception: shards a leaving node `released`
  (their log is empty and it has stopped taking writes for them) move like non-reliable ones;
- then non-reliable shards move from the fullest to the emptiest live node until shard
  counts differ by at most one (a joining node takes its fair share).
Every change of a shard's leader bumps that shard's leader epoch.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from typing import Any

ShardKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class ShardSpec:
    stream: str
    shard: int
    reliable: bool


@dataclass(frozen=True, slots=True)
class ShardPlacement:
    """Who holds a shard: `leader` takes its writes under `leader_epoch`; `replicas` hold its
    log (in preference order); `isr`, a subset of `replicas`, are in sync with the leader;
    `isr_version` counts the controller's changes of `isr` (a leader's proposal names the
    version it was made against, `replica_control.apply_proposal`); `adding`, replicas the
    controller added that have not been in sync yet (KIP-455's adding replicas): they do not
    count towards the replicas that cap `min_insync_replicas` until they caught up.
    `leader_lease`, the etcd lease the leader was registered under when it was named in this
    epoch (0: not known, as in placements written before it was kept): a leader registered
    under another lease since is a new process, named again in a new epoch by any controller
    (`controller.desired_placement`)."""

    leader: str
    replicas: tuple[str, ...]
    isr: tuple[str, ...]
    leader_epoch: int
    isr_version: int = 0
    adding: tuple[str, ...] = ()
    leader_lease: int = 0

    def __post_init__(self) -> None:
        if not self.leader:
            raise ValueError("a shard placement needs a leader")
        if self.leader not in self.replicas:
            raise ValueError(f"leader {self.leader!r} is not one of the replicas {self.replicas}")
        if not set(self.isr) <= set(self.replicas):
            raise ValueError(f"in-sync replicas {self.isr} are not all replicas {self.replicas}")
        if not set(self.adding) <= set(self.replicas) - set(self.isr):
            raise ValueError(f"adding replicas {self.adding} are not all replicas out of sync")
        if self.leader_epoch < 0:
            raise ValueError(f"leader epoch {self.leader_epoch} is negative")

    @classmethod
    def single(cls, leader: str, leader_epoch: int) -> ShardPlacement:
        """One replica, the leader, in sync (every shard today)."""
        return cls(leader, (leader,), (leader,), leader_epoch)

    @property
    def counted(self) -> int:
        """The replicas that cap the in-sync minimum: all but those still being added."""
        return len(self.replicas) - len(self.adding)

    def to_json(self) -> dict[str, Any]:
        value = {"leader": self.leader, "replicas": list(self.replicas), "isr": list(self.isr),
                 "leader_epoch": self.leader_epoch, "isr_version": self.isr_version}
        if self.adding:
            value["adding"] = list(self.adding)
        if self.leader_lease:
            value["leader_lease"] = self.leader_lease
        return value

    @classmethod
    def from_json(cls, value: Any) -> ShardPlacement:
        """From `to_json()`'s form, or the `[node id, epoch]` pair of earlier versions.
        Raises ValueError (or KeyError, TypeError) on anything else."""
        if isinstance(value, list):
            leader, epoch = value
            return cls.single(str(leader), int(epoch))
        return cls(str(value["leader"]), tuple(map(str, value["replicas"])),
                   tuple(map(str, value["isr"])), int(value["leader_epoch"]),
                   int(value.get("isr_version", 0)), tuple(map(str, value.get("adding", ()))),
                   int(value.get("leader_lease", 0)))


def place(
    shards: Iterable[ShardSpec],
    current: Mapping[ShardKey, ShardPlacement],
    live_nodes: Iterable[str],
    load: Mapping[str, float] | None = None,
    released: Set[ShardKey] = frozenset(),
) -> dict[ShardKey, ShardPlacement]:
    """The new assignment of every shard in `shards` (shards not listed are dropped).
    With no live node, non-reliable shards without a live leader are left out (unassigned)."""
    live = sorted(set(live_nodes))
    load = load or {}
    result: dict[ShardKey, ShardPlacement] = {}
    count = dict.fromkeys(live, 0)
    movable: dict[str, list[ShardKey]] = {node: [] for node in live}
    homeless: list[ShardSpec] = []
    for spec in shards:
        key = (spec.stream, spec.shard)
        placed = current.get(key)
        if placed is not None and placed.leader in count:
            result[key] = placed
            count[placed.leader] += 1
            if not spec.reliable:
                movable[placed.leader].append(key)
        elif placed is not None and spec.reliable and key not in released:
            result[key] = placed  # sticky: its log is on that node
        else:
            homeless.append(spec)
    if not live:
        return result
    # least loaded first: (shard count, load, node id)
    heap = [(count[node], load.get(node, 0.0), node) for node in live]
    heapq.heapify(heap)
    for spec in homeless:
        shard_count, node_load, node = heapq.heappop(heap)
        key = (spec.stream, spec.shard)
        previous = current.get(key)
        result[key] = ShardPlacement.single(node, previous.leader_epoch + 1 if previous is not None else 1)
        count[node] = shard_count + 1
        if not spec.reliable:
            movable[node].append(key)
        heapq.heappush(heap, (shard_count + 1, node_load, node))
    _balance(result, count, movable, load)
    return result


def _balance(
    result: dict[ShardKey, ShardPlacement],
    count: dict[str, int],
    movable: dict[str, list[ShardKey]],
    load: Mapping[str, float],
) -> None:
    """Move non-reliable shards from the fullest to the emptiest node while counts differ by
    more than one. Heaps of (count) keep it O(moves · log nodes)."""
    if len(count) < 2:
        return
    low = [(count[n], load.get(n, 0.0), n) for n in count]
    high = [(-count[n], -load.get(n, 0.0), n) for n in count]
    heapq.heapify(low)
    heapq.heapify(high)
    while True:
        # drop stale heap entries (counts changed since they were pushed)
        while low and low[0][0] != count[low[0][2]]:
            heapq.heappop(low)
        while high and -high[0][0] != count[high[0][2]]:
            heapq.heappop(high)
        if not low or not high:
            return
        fullest, emptiest = high[0][2], low[0][2]
        if count[fullest] - count[emptiest] <= 1:
            return
        if not movable[fullest]:
            # nothing movable on the fullest node: it stops competing
            heapq.heappop(high)
            continue
        key = movable[fullest].pop()
        result[key] = ShardPlacement.single(emptiest, result[key].leader_epoch + 1)
        movable[emptiest].append(key)
        count[fullest] -= 1
        count[emptiest] += 1
        heapq.heappush(low, (count[emptiest], load.get(emptiest, 0.0), emptiest))
        heapq.heappush(low, (count[fullest], load.get(fullest, 0.0), fullest))
        heapq.heappush(high, (-count[emptiest], -load.get(emptiest, 0.0), emptiest))
        heapq.heappush(high, (-count[fullest], -load.get(fullest, 0.0), fullest))
