"""What operators see of replicated shards: per shard its leader, replicas, in-sync set, epoch,
whether it is under-replicated and, on the node that leads it, its high watermark, log end and
each follower's lag in records. Read by `cluster status` (`attach.cluster_status`, hence the
admin API and `Admin.GetClusterStatus`) and by the metrics (`metrics.py`).

Only nodes that run the replication data path hold replicas: a stream that wants three
replicas on a cluster with no such node is not counted under-replicated. The placement comes
from the node's view of etcd; the high watermark and lag only the leader
knows (`ReplicaManager.leading`), so each node reports them for the shards it leads: its
metrics carry them (`shardgate_replica_lag_records`), and `cluster status` asked of a node
shows them for that node's leaderships.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from .placement import ShardPlacement
from .replication import DEFAULTS, Replication, stream_replication


class LeaderFigures(Protocol):
    """What a leading replica tells (`replica_leader.LeaderReplica`)."""

    @property
    def high_watermark(self) -> int: ...

    @property
    def log_end(self) -> int: ...

    def lag(self, replica: str) -> int: ...


# (stream, shard) -> the shard's leadership on this node, or None (`ReplicaManager.leading`
# then `.leader`); wired by the data path
Leading = Callable[[str, int], LeaderFigures | None]


def under_replicated(placed: ShardPlacement, wanted: int, live: Mapping[str, object],
                     capacity: int) -> bool:
    """Fewer in-sync replicas than replicas, fewer replicas than wanted (as far as the
    `capacity` nodes that may hold replicas allow), or a replica whose node is not live."""
    return (len(placed.isr) < len(placed.replicas)
            or len(placed.replicas) < min(wanted, capacity)
            or any(replica not in live for replica in placed.replicas))


def replica_capacity(live: Mapping[str, object]) -> int:
    """How many live nodes may hold replicas: those that run the replication data path
    (their registration says `replication`)."""
    return sum(1 for registration in live.values() if getattr(registration, "replication", False))


def replicated_shards(placement: Mapping[str, list[ShardPlacement]],
                      streams: Mapping[str, Mapping[str, Any]], capacity: int,
                      defaults: Replication = DEFAULTS,
                      ) -> Iterator[tuple[str, int, ShardPlacement, int]]:
    """(stream, shard, placement, wanted replicas) of every shard of a replicated stream (when
    nodes may hold its replicas), or with more than one replica."""
    for stream, shards in sorted(placement.items()):
        wanted = stream_replication(streams.get(stream, {}), defaults).replicas
        for index, placed in enumerate(shards):
            if (wanted > 1 and capacity > 1) or len(placed.replicas) > 1:
                yield stream, index, placed, wanted


def shard_status(placement: Mapping[str, list[ShardPlacement]],
                 streams: Mapping[str, Mapping[str, Any]], live: Mapping[str, object],
                 leading: Leading | None,
                 defaults: Replication = DEFAULTS) -> dict[str, dict[str, Any]]:
    """Per replicated shard ("stream/shard"): its placement, `under_replicated`, and where this
    node leads it, `high_watermark`, `log_end` and `lag` (records behind the leader's end, per
    follower)."""
    status: dict[str, dict[str, Any]] = {}
    capacity = replica_capacity(live)
    for stream, index, placed, wanted in replicated_shards(placement, streams, capacity,
                                                           defaults):
        entry: dict[str, Any] = {
            "leader": placed.leader, "leader_live": placed.leader in live,
            "replicas": list(placed.replicas), "isr": list(placed.isr),
            "leader_epoch": placed.leader_epoch, "wanted_replicas": wanted,
            "adding": list(placed.adding),
            "under_replicated": under_replicated(placed, wanted, live, capacity),
        }
        figures = leading(stream, index) if leading is not None else None
        if figures is not None:
            entry["high_watermark"] = figures.high_watermark
            entry["log_end"] = figures.log_end
            entry["lag"] = lag = {}
            for replica in placed.replicas:
                if replica == placed.leader:
                    continue
                try:
                    lag[replica] = figures.lag(replica)
                except KeyError:
                    pass  # not (yet) one of this leadership's followers: the placement moved on
        status[f"{stream}/{index}"] = entry
    return status
