"""What the admin API and the metrics read off a node's composition root: the open
connections per protocol, the queue that holds a subscription's waiting messages, the
archiver's totals. Where each protocol service hangs on the root (`app.mqtt`, `app.amqp`,
`app.grpc`) is known here and nowhere else in `admin/`. Nothing here changes broker state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..app import Shardgate
    from ..protocols.grpc.server import GrpcServer


def grpc_server(app: Shardgate) -> GrpcServer | None:
    """The node's `GrpcServer`, or None when no gRPC listener runs."""
    return app.grpc


def connection_counts(app: Shardgate) -> dict[str, int]:
    """Open client connections (or client streams, for gRPC) by protocol."""
    counts: dict[str, int] = {}
    if app.mqtt is not None:
        counts["mqtt"] = len(app.mqtt.connections)
    if app.amqp is not None:
        counts["amqp"] = len(app.amqp.connections)
    if app.grpc is not None:
        counts["grpc"] = len(app.grpc.consumers) + len(app.grpc.producers)
    return counts


def subscription_queue(sub: Any) -> Any:
    """What holds a subscription's waiting messages, if anything: an MQTT session's queue or an
    AMQP queue's ready messages (both belong to the subscription's owner)."""
    owner = sub.owner
    queue = getattr(owner, "queue", None)
    if queue is None:
        queue = getattr(owner, "messages", None)
    return queue if hasattr(queue, "__len__") else None


def archive_status(app: Shardgate) -> dict[str, Any] | None:
    """The archiver's status, totals for the gauges and the shards as they are for the API;
    None when no archiver runs."""
    if app.archiver is None:
        return None
    status: Any = app.archiver.status()  # one entry per stream and shard
    if isinstance(status, dict):  # an archiver that reports totals itself
        return dict(status)
    totals: dict[str, Any] = {}
    for shard in status:
        for key in ("lag_records", "files", "bytes", "buffered", "failures", "skipped"):
            value = shard.get(key)
            if isinstance(value, int | float):
                totals[key] = totals.get(key, 0) + value
    lag_ms = [lag for s in status if isinstance(lag := s.get("lag_ms"), int | float)]
    totals["lag_ms"] = max(lag_ms, default=0)
    totals["shards"] = status
    return totals
