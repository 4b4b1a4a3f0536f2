"""What the admin surfaces show, as JSON-ready dicts: the broker's info and this node's
resources, streams and their shards, subscriptions and their consumers, connected clients, MQTT
sessions, retained messages and the archive's status.

Each view reads the application's state when asked (between awaits on the event loop); nothing
here runs per message, changes anything or knows HTTP. The admin HTTP API (`admin_http.py`) and
the cluster's listings (`local_listings.py`) answer with them.
"""

from __future__ import annotations

import base64
import os
import shutil
import time
from typing import Any

from .. import __version__
from .node_readings import archive_status, connection_counts, subscription_queue

RETAINED_LIMIT = 1000
PREVIEW_BYTES = 256


def _protocol_of(thing: object) -> str:
    """The protocol a subscription owner or a consumer belongs to, from its module."""
    if thing is None:
        return "core"
    module = type(thing).__module__
    for protocol in ("mqtt", "amqp", "grpc"):
        if f".{protocol}." in module:
            return protocol
    return "core"


def info_view(app: Any) -> dict[str, Any]:
    edge = app.edge
    stats = edge.stats
    now = time.time()
    mqtt = getattr(app, "mqtt", None)
    journal = getattr(app, "journal", None)
    commit = getattr(journal, "stats", None)
    return {
        "version": __version__,
        "now": now,
        "started_at": stats.started_at,
        "uptime_s": max(0.0, now - stats.started_at),
        "listeners": [
            {"name": listener.name, "host": listener.host, "port": listener.port}
            for listener in (getattr(app, "listeners", None) or {}).values()
        ],
        "messages_in": stats.messages_in,
        "bytes_in": stats.bytes_in,
        "messages_out": stats.messages_out,
        "bytes_out": stats.bytes_out,
        "messages_dropped": stats.messages_dropped,
        "messages_without_subscriber": stats.messages_without_subscriber,
        "connections": connection_counts(app),
        "streams": len(edge.streams),
        "subscriptions": len(edge.subscriptions),
        "sessions": len(mqtt.sessions) if mqtt is not None else 0,
        "retained": edge.retained_count,
        # cluster mode: this node's id (its cluster is at /api/cluster); None on a single node
        "cluster_node": getattr(getattr(app, "cluster", None), "node_id", None),
        "journal": None if commit is None else {
            name: getattr(commit, name)
            for name in ("passes", "groups", "records", "bytes", "fsyncs", "failures")
        },
        "archive": getattr(app, "archiver", None) is not None,
        # where CONNECTs wait inside the broker, and the event loop's lateness (ms)
        "mqtt_connect_timing": mqtt.connect_timing.summary() if mqtt is not None else None,
        "node": node_view(app),
    }


def _open_descriptors() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def node_view(app: Any) -> dict[str, Any]:
    """This process's resources, as RabbitMQ's node overview: resident memory against the
    memory watermark, open file descriptors against their limit, free disk of the data
    directory against `disk_free_limit`, and the resource alarms in force (`resources.py`).
    Read when asked (a stat, a directory listing), never per message."""
    from ..resources import resident_bytes

    alarms = getattr(app, "alarms", None)
    data_dir = getattr(getattr(app, "config", None), "data_dir", None)
    try:
        disk_free = shutil.disk_usage(data_dir).free if data_dir is not None else None
    except OSError:
        disk_free = None
    try:
        import resource

        descriptor_limit: int | None = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        descriptor_limit = None
    active = []
    if alarms is not None and alarms.memory_alarm:
        active.append("memory")
    if alarms is not None and alarms.disk_alarm:
        active.append("disk")
    return {
        "pid": os.getpid(),
        "rss_bytes": resident_bytes(),
        "memory_limit_bytes": alarms.memory_limit if alarms is not None else None,
        "open_descriptors": _open_descriptors(),
        "descriptor_limit": descriptor_limit,
        "data_dir": None if data_dir is None else str(data_dir),
        "disk_free_bytes": disk_free,
        "disk_free_limit_bytes": alarms.disk_free_limit if alarms is not None else None,
        "alarms": active,
    }


def _shard_view(shard: Any) -> dict[str, Any]:
    shard_log = shard.log
    view: dict[str, Any] = {"index": shard.index, "next_offset": shard.next_offset}
    if shard_log is not None:
        segments = list(getattr(shard_log, "segments", ()) or ())
        view.update(
            low_watermark=shard_log.low_watermark,
            committed_offset=getattr(shard_log, "committed_offset", shard_log.next_offset),
            segments=len(segments),
            size_bytes=sum(int(getattr(segment, "size", 0)) for segment in segments),
        )
    return view


def stream_view(app: Any, stream: Any, *, detail: bool = False) -> dict[str, Any]:
    edge = app.edge
    config = stream.config
    view: dict[str, Any] = {
        "name": config.name,
        "mode": str(config.mode),
        "partitions": config.partitions,
        "schema": str(config.schema),
        "retention_ms": config.retention_ms,
        "retention_bytes": config.retention_bytes,
        "replicas": config.replicas,
        "min_insync_replicas": config.min_insync_replicas,
        "default": config.name == edge.default_stream,
        "routes": [rule.topic_filter for rule in edge.routes if rule.stream == config.name],
        "messages": sum(shard.next_offset for shard in stream.shards),
        "shards": [_shard_view(shard) for shard in stream.shards],
    }
    if detail:
        by_shard: dict[int, list[dict[str, Any]]] = {shard.index: [] for shard in stream.shards}
        ends = {shard.index: shard.next_offset for shard in stream.shards}
        for sub in list(edge.subscriptions.values()):
            for (name, index), cursor in list(getattr(sub, "cursors", {}).items()):
                if name != config.name or index not in by_shard:
                    continue
                by_shard[index].append({
                    "subscription": sub.name,
                    "position": cursor.position,
                    "floor": cursor.floor,
                    "unacked": len(cursor.unacked),
                    "lag": max(0, ends[index] - cursor.floor),
                })
        for shard in view["shards"]:
            shard["cursors"] = by_shard[shard["index"]]
    return view


def streams_view(app: Any) -> list[dict[str, Any]]:
    return [stream_view(app, stream) for _, stream in sorted(app.edge.streams.items())]


def subscription_view(sub: Any) -> dict[str, Any]:
    owner = sub.owner
    active = sub.active_consumer
    durable = callable(getattr(sub, "lag", None))
    if durable:
        inflight = sub.inflight_count()
    else:
        inflight = len(getattr(owner, "inflight", ()) or ())
    queued = subscription_queue(sub)
    return {
        "name": sub.name,
        "type": str(sub.type),
        "durable": bool(sub.durable),
        "protocol": _protocol_of(owner),
        "filters": list(sub.filters),
        "consumers": _consumers_view(sub, active),
        "lag": sub.lag() if durable else 0,
        "inflight": inflight,
        "queued": len(queued) if queued is not None else 0,
    }


def _consumers_view(sub: Any, active: Any) -> list[dict[str, Any]]:
    """Who consumes `sub`. An AMQP queue is the subscription's core consumer itself: what is
    listed are its basic.consume registrations (none: the queue has no consumer)."""
    out: list[dict[str, Any]] = []
    for consumer in list(sub.consumers):
        registrations = getattr(consumer, "consumers", None)
        if str(getattr(consumer, "consumer_id", "")) == sub.name and isinstance(registrations, list):
            out.extend({"id": f"{getattr(c, 'tag', '?')}", "protocol": "amqp", "active": True}
                       for c in registrations)
            continue
        out.append({"id": str(consumer.consumer_id), "protocol": _protocol_of(consumer),
                    "active": str(sub.type) == "shared" or consumer is active})
    return out


def subscriptions_view(app: Any) -> list[dict[str, Any]]:
    subs = sorted(app.edge.subscriptions.values(), key=lambda sub: sub.name)
    return [subscription_view(sub) for sub in subs]


def clients_view(app: Any) -> list[dict[str, Any]]:
    """Every connected client, whatever its protocol (the front door's registry); `client_id`
    is what a kick names."""
    edge = getattr(app, "edge", None)
    if edge is None:
        return []
    return [
        {
            "protocol": client.protocol,
            "client_id": client.client_id,
            "username": client.username,
            "remote": client.remote,
            "transport": client.transport,
            "connected_at": client.connected_at,
            "messages_in": client.messages_in,
            "messages_out": client.messages_out,
            "detail": client.detail,
            "kickable": client.kickable,
        }
        for client in edge.clients.list()
    ]



def nodes_view(app: Any) -> list[dict[str, Any]]:
    """This node's row of the node-resource table: its resources (`node_view`), its open
    connections by protocol, and its cluster node id (None on a single node)."""
    node_id = getattr(getattr(app, "cluster", None), "node_id", None)
    return [dict(node_view(app), node=node_id, connections=connection_counts(app))]


def sessions_view(app: Any) -> list[dict[str, Any]]:
    mqtt = getattr(app, "mqtt", None)
    sessions = sorted((getattr(mqtt, "sessions", None) or {}).values(), key=lambda s: s.client_id)
    out = []
    for session in sessions:
        disconnected_ms = session.disconnected_at_ms
        out.append({
            "protocol": "mqtt",
            "client_id": session.client_id,
            "connected": session.connection is not None,
            "durable": bool(session.durable),
            "expiry_interval": session.expiry_interval,
            "disconnected_at": None if disconnected_ms is None else disconnected_ms / 1000,
            "filters": list(session.subscription.filters),
            "shared": list(session.shared),
            "queued": len(session.queue),
            "inflight": len(session.inflight),
            "dropped": session.dropped,
        })
    return out


def _payload_preview(payload: bytes) -> dict[str, Any]:
    head = payload[:PREVIEW_BYTES]
    try:
        return {"payload": head.decode("utf-8"), "payload_encoding": "utf-8"}
    except UnicodeDecodeError:
        return {"payload": base64.b64encode(head).decode("ascii"), "payload_encoding": "base64"}


def retained_view(app: Any, prefix: str = "", limit: int = RETAINED_LIMIT) -> dict[str, Any]:
    items = sorted(
        (topic, message) for topic, message in app.edge.retained_messages() if topic.startswith(prefix)
    )
    out = []
    for topic, message in items[:limit]:
        entry = {
            "topic": topic,
            "qos": message.qos,
            "size": len(message.payload),
            "content_type": message.content_type,
            "publish_time": message.publish_time_ms / 1000,
            "stream": message.stream,
            "truncated": len(message.payload) > PREVIEW_BYTES,
        }
        entry.update(_payload_preview(message.payload))
        out.append(entry)
    return {"total": len(items), "messages": out}


def archive_view(app: Any) -> dict[str, Any]:
    status = archive_status(app)
    if status is None:
        return {"enabled": False}
    return {"enabled": True, **status}

