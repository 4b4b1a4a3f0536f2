"""A stream's replication settings as the cluster reads them from its definition in etcd
(`streams/<name>`, `attach.stream_definition`): how many replicas each shard of the stream
has, and how many of them must be in sync for a publish to be acknowledged.

One function, `stream_replication`, that the controller (placing replicas, `replica_placement`)
and the data path (acknowledging at the in-sync minimum, `replica_manager`) both use, so the
two never read the settings differently; the defaults are decided here (a stream keeps only
its settings and their bounds, `core/streams.py`), or by the cluster's configuration
(`[cluster] default_replicas`, `default_min_insync_replicas`: give every node the same values,
as Kafka's brokers share `default.replication.factor` and `min.insync.replicas`).
Only reliable streams are replicated: a non-reliable stream lives in memory and has one
replica, its leader.

The controller places more than one replica only on nodes that run the replication data path
(their registration says `replication`, `keys.NodeRegistration`): a node without it never
fetches, so a failover to it would lose the log.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.streams import MAX_REPLICAS

# What a reliable stream without the settings gets in a cluster (`[cluster] default_replicas`,
# `default_min_insync_replicas`): three replicas (capped by the live nodes that may hold them,
# as Kafka's `default.replication.factor` 3), two in sync to acknowledge (capped by the
# replicas the shard has, not counting one still being added), as Kafka's
# `min.insync.replicas`. So a shard placed on two nodes refuses publishes while one of
# them is dead, as a Kafka topic of replication factor 2 and `min.insync.replicas` 2 does: an
# acknowledged message is on two disks or is not acknowledged. A single node (no cluster) keeps one copy and none of this runs.
DEFAULT_REPLICAS = 3
DEFAULT_MIN_INSYNC_REPLICAS = 2

# The definition's keys (the stream settings `replicas` and `min_insync_replicas`).
REPLICAS = "replicas"
MIN_INSYNC = "min_insync_replicas"


@dataclass(frozen=True, slots=True)
class Replication:
    """`replicas`: the nodes that hold each shard's log (capped by the live nodes when the
    controller places them); `min_insync`: how many of them must be in sync to acknowledge
    (never more than `replicas`)."""

    replicas: int
    min_insync: int

    @property
    def replicated(self) -> bool:
        return self.replicas > 1


DEFAULTS = Replication(DEFAULT_REPLICAS, DEFAULT_MIN_INSYNC_REPLICAS)


def stream_replication(definition: Mapping[str, Any],
                       defaults: Replication = DEFAULTS) -> Replication:
    """The replication of the stream with this etcd definition; a setting the stream does not
    have is the cluster's default (`defaults`), and a malformed one counts as unset (the
    definition was checked when it was made: this only guards old values)."""
    if definition.get("mode", "reliable") != "reliable":
        return Replication(1, 1)
    replicas = _positive(definition.get(REPLICAS), defaults.replicas)
    replicas = min(replicas, MAX_REPLICAS)
    min_insync = min(_positive(definition.get(MIN_INSYNC), defaults.min_insync), replicas)
    return Replication(replicas, min_insync)


def _positive(value: Any, default: int) -> int:
    if value is None or isinstance(value, bool):
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        return default
    return number if number >= 1 else default
