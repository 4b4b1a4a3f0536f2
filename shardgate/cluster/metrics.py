"""Prometheus metric families of the cluster data plane, read from its counters at scrape time.

`shardgate.admin.metrics` yields these when the node runs in a cluster (`app.data_plane` is set);
nothing here runs on the message path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

PREFIX = "shardgate_cluster"


def data_plane_metrics(plane: Any) -> Iterator[Metric]:
    stats = plane.stats
    forwarded = CounterMetricFamily(
        f"{PREFIX}_forwarded_messages",
        "Publishes forwarded to the node owning their shard (out), or from other nodes to this "
        "owner (in)", labels=["direction"],
    )
    forwarded.add_metric(["out"], stats.forwarded)
    forwarded.add_metric(["in"], stats.forwarded_in)
    yield forwarded
    yield CounterMetricFamily(
        f"{PREFIX}_forward_failures",
        "Forwarded publishes refused or lost (their clients got a retryable error)",
        value=stats.forward_failures,
    )
    pushed = CounterMetricFamily(
        f"{PREFIX}_pushed_messages",
        "Stored messages pushed to the nodes of their subscribers (out, once per node), or "
        "pushed here by their shard's owner (in)", labels=["direction"],
    )
    pushed.add_metric(["out"], stats.pushed)
    pushed.add_metric(["in"], stats.pushed_in)
    yield pushed
    yield CounterMetricFamily(
        f"{PREFIX}_pushes_dropped", "Pushes dropped on a full or broken link to a node, or given up while its routes were unknown",
        value=stats.pushes_dropped,
    )
    frames = CounterMetricFamily(
        f"{PREFIX}_link_frames",
        "Frames (batches of forwards, pushes, routes) written to peers (out) or applied from "
        "them (in); messages over frames is the batching", labels=["direction"],
    )
    frames.add_metric(["out"], stats.frames_out)
    frames.add_metric(["in"], stats.frames_in)
    yield frames
    buckets, total = stats.forward_latency.snapshot()
    yield HistogramMetricFamily(
        f"{PREFIX}_forward_latency_seconds",
        "Seconds from writing a batch of forwarded publishes to the owner's answer (the owner "
        "holds them under the stream's durability policy); one observation per batch",
        buckets=[(floatToGoString(bound), count)  # type: ignore[no-untyped-call]
                 for bound, count in buckets], sum_value=total,
    )
    up = GaugeMetricFamily(f"{PREFIX}_link_up", "1 while this node's link to a peer is up",
                           labels=["peer"])
    routes = GaugeMetricFamily(
        f"{PREFIX}_peer_routes", "Topic filters a peer's clients hold, as this node knows them",
        labels=["peer"],
    )
    for peer, link in sorted(plane.links.items()):
        up.add_metric([peer], 1 if link.connected else 0)
        routes.add_metric([peer], len(plane.remote.routes_of(peer)))
    yield up
    yield routes


def control_plane_metrics(node: Any) -> Iterator[Metric]:
    """Membership as this node sees it; every series carries this node's id as `node`."""
    view = node.view
    me = node.node_id
    nodes = GaugeMetricFamily(f"{PREFIX}_nodes", "Live nodes of the cluster, as this node sees them",
                              labels=["node"])
    nodes.add_metric([me], len(view.registrations))
    yield nodes
    controller = GaugeMetricFamily(f"{PREFIX}_controller", "1 when this node is the controller",
                                   labels=["node"])
    controller.add_metric([me], 1 if view.controller_id == me else 0)
    yield controller
    lease = GaugeMetricFamily(
        f"{PREFIX}_lease_alive",
        "1 while this node's etcd lease is known to be alive (it acts for its shards only then)",
        labels=["node"])
    lease.add_metric([me], 1 if view.lease_alive() else 0)
    yield lease
    shards = GaugeMetricFamily(f"{PREFIX}_shards", "Shards led by each node (the placement)",
                               labels=["node", "owner"])
    for owner, count in sorted(view.shard_counts().items()):
        shards.add_metric([me, owner], count)
    yield shards
    unavailable = sum(
        1 for placed in (p for shards_ in view.placement.values() for p in shards_)
        if placed.leader not in view.registrations
    )
    yield GaugeMetricFamily(f"{PREFIX}_unavailable_shards",
                            "Shards whose node is not live (reliable shards of a dead node)",
                            value=unavailable)
    yield from replication_metrics(node)


def replication_metrics(node: Any) -> Iterator[Metric]:
    """Replicated shards as this node sees them: the followers' lag of the shards it leads
    (only the leader knows it), and how many of the shards it leads are under-replicated (in
    sync fewer than their replicas, or fewer replicas than wanted), as Kafka's
    UnderReplicatedPartitions: summed over the nodes, each shard is counted once."""
    from .replica_status import shard_status

    view = node.view
    me = node.node_id
    status = shard_status(view.placement, view.streams, view.registrations, node.replica_leading,
                          node.settings.replication_defaults)
    lag = GaugeMetricFamily(
        "shardgate_replica_lag_records",
        "Records a follower lacks of its leader's log, per replicated shard this node leads",
        labels=["node", "stream", "shard", "replica"])
    under = 0
    for name, shard in sorted(status.items()):
        stream, _, index = name.rpartition("/")
        for replica, records in sorted(shard.get("lag", {}).items()):
            lag.add_metric([me, stream, index, replica], records)
        if shard["leader"] == me and shard["under_replicated"]:
            under += 1
    yield lag
    under_replicated = GaugeMetricFamily(
        "shardgate_under_replicated_shards",
        "Replicated shards this node leads with fewer in-sync replicas than replicas, or fewer "
        "replicas than their stream wants", labels=["node"])
    under_replicated.add_metric([me], under)
    yield under_replicated
