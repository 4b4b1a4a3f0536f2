"""The admin HTTP server: a JSON API, Prometheus `/metrics` and the web dashboard, on aiohttp.

It runs on the broker's own event loop, so every handler reads broker state between awaits and
never races the hot path; views are built only when asked, nothing here runs per message. The
writes are kicking a client, moving a durable subscription's cursors (reset to the earliest,
the latest, an offset or a time; purge: to the end), flushing the archive and draining a
cluster node. Unknown paths and bad requests under `/api/` answer with a JSON
`{"error": ..., "status": ...}` body. No CORS headers are sent, so other web origins cannot call
the state-changing `DELETE` from a browser.

Authentication: as soon as the broker's security model is not open (a user exists, or
anonymous access is off), every path (API, `/metrics`, dashboard) needs HTTP Basic credentials
of a user the ACL grants the `admin` action on the request path as a topic (`api/streams`,
`api/clients/mqtt/x`, `metrics`, `dashboard`); users with the `admin` role have it everywhere.
An open broker serves only a loopback address (the composition root refuses anything else).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .. import __version__
from ..core.edge import KICK_REASON
from .health import HEALTH_PATHS, healthz, readyz_handler
from .history import TrafficHistory
from .metrics import (
    CONTENT_TYPE,
    archive_status,
    connection_counts,
    create_registry,
    render,
    subscription_queue,
)

log = logging.getLogger(__name__)


class _MalformedRequests(logging.Filter):
    """A request that is not valid HTTP is the client's error: aiohttp answers 400 and would
    log an ERROR with a traceback for it; it gets one debug line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            log.debug("malformed HTTP request: %s", str(exc).replace("\n", " ")[:300])
            return False
        return True


# The admin server's own logger (aiohttp's request handler logs there).
_server_log = logging.getLogger(f"{__name__}.server")
_server_log.addFilter(_MalformedRequests())

DASHBOARD_DIR = Path(__file__).with_name("dashboard")
RETAINED_LIMIT = 1000
PREVIEW_BYTES = 256


class Served:
    """The broker an admin application serves and what is built from it (the metrics
    registry, the traffic history), dropped when the server stops: aiohttp keeps up to 1,024
    recent applications in a module-level cache (its middleware LRU), which would otherwise
    keep a stopped broker alive with all its sessions and journals."""

    __slots__ = ("app", "registry", "history")

    def __init__(self, app: Any, registry: Any, history: Any) -> None:
        self.app = app
        self.registry = registry
        self.history = history

    def forget(self) -> None:
        self.app = self.registry = self.history = None


SERVED_KEY: web.AppKey[Served] = web.AppKey("served", Served)


class NotFound(Exception):
    """A named thing (stream, subscription, client) does not exist; answered with 404."""


# ---------------------------------------------------------------------------- views
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


def kick_client(app: Any, protocol: str, client_id: str) -> None:
    """Disconnect one client; raises `NotFound` if no such client is connected."""
    if protocol not in ("mqtt", "amqp", "grpc"):
        raise NotFound(f"unknown protocol {protocol!r}: expected mqtt, amqp or grpc")
    edge = getattr(app, "edge", None)
    if edge is None or not edge.clients.kick(protocol, client_id, KICK_REASON):
        raise NotFound(f"no {protocol} client {client_id!r} is connected")


class Conflict(Exception):
    """The request cannot apply to the thing it names (a live-only subscription has no
    cursor); answered with 409."""


class BadRequest(Exception):
    """The request's body or parameters are wrong; answered with 400."""


class Unavailable(Exception):
    """In a cluster, the node that would answer cannot be reached now; answered with 503."""


def _durable_subscription(app: Any, name: str) -> Any:
    from ..core.durable import DurableSubscription

    sub = app.edge.subscriptions.get(name)
    if sub is None:
        raise NotFound(f"subscription {name!r} does not exist on this node")
    if not sub.durable or not isinstance(sub, DurableSubscription):
        raise Conflict(f"subscription {name!r} is live-only: it has no cursor to move")
    return sub


def cursor_position(body: Any) -> tuple[str, int | None]:
    """The position a reset-cursor body names: `{"position": "earliest" | "latest"}`,
    `{"offset": N}` (on every shard) or `{"timestamp_ms": T}` (the first message at or after
    T); raises `BadRequest` otherwise."""
    if not isinstance(body, dict):
        raise BadRequest('expected a JSON object: {"position": "earliest" | "latest"}, '
                         '{"offset": N} or {"timestamp_ms": T}')
    given = [key for key in ("position", "offset", "timestamp_ms") if key in body]
    if len(given) != 1:
        raise BadRequest("name exactly one of position, offset and timestamp_ms")
    key = given[0]
    value = body[key]
    if key == "position":
        if value not in ("earliest", "latest"):
            raise BadRequest('position must be "earliest" or "latest"')
        return value, None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"{key} must be a non-negative integer")
    return key, value


def reset_cursor(app: Any, name: str, kind: str, value: int | None = None) -> dict[str, Any]:
    """Move every cursor of the durable subscription `name` (kind as `cursor_position`'s);
    answers the subscription's view. What was in flight is forgotten: an acknowledgement of
    it afterwards changes nothing."""
    sub = _durable_subscription(app, name)
    sub.seek(kind, value)
    return subscription_view(sub)


def purge_subscription(app: Any, name: str) -> dict[str, Any]:
    """Drop a durable subscription's backlog: its cursors move to the end of every shard (and
    an AMQP queue's ready messages go). Answers how many messages were skipped and the
    subscription's view."""
    sub = _durable_subscription(app, name)
    before = sub.lag()
    sub.seek("latest")
    return {"purged": before, "subscription": subscription_view(sub)}


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


# ---------------------------------------------------------------------------- OpenAPI
def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_NOT_FOUND = _json(_ref("Error"), "Not found")


def _get(summary: str, schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    operation = {"summary": summary, "responses": {"200": _json(schema)}}
    operation.update(extra)
    return {"get": operation}


def _path_param(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": description,
            "schema": {"type": "string"}}


def _object(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


_INT = {"type": "integer"}
_NUM = {"type": "number"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_STRS = {"type": "array", "items": _STR}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 description of every `/api/` route."""
    shard = _object(
        index=_INT, next_offset=_INT, low_watermark=_INT, committed_offset=_INT,
        segments=_INT, size_bytes=_INT,
        cursors={"type": "array", "items": _object(
            subscription=_STR, position=_INT, floor=_INT, unacked=_INT, lag=_INT)},
    )
    node_resources = _object(
        pid=_INT, rss_bytes=_INT, memory_limit_bytes={"type": ["integer", "null"]},
        open_descriptors={"type": ["integer", "null"]},
        descriptor_limit={"type": ["integer", "null"]}, data_dir={"type": ["string", "null"]},
        disk_free_bytes={"type": ["integer", "null"]},
        disk_free_limit_bytes={"type": ["integer", "null"]},
        alarms={"type": "array", "items": {"enum": ["memory", "disk"]}})
    schemas = {
        "Error": _object(error=_STR, status=_INT),
        "Info": _object(
            version=_STR, now=_NUM, started_at=_NUM, uptime_s=_NUM,
            listeners={"type": "array", "items": _object(name=_STR, host=_STR, port=_INT)},
            messages_in=_INT, bytes_in=_INT, messages_out=_INT, bytes_out=_INT,
            messages_dropped=_INT, messages_without_subscriber=_INT,
            connections={"type": "object", "additionalProperties": _INT},
            streams=_INT, subscriptions=_INT, sessions=_INT, retained=_INT,
            cluster_node={"type": ["string", "null"]},
            journal={"type": ["object", "null"], "additionalProperties": _INT}, archive=_BOOL,
            # name of a span → {count, p50, p99, max} in ms (protocols/mqtt/timing.py)
            mqtt_connect_timing={"type": ["object", "null"], "additionalProperties": _object(
                count=_INT, p50=_NUM, p99=_NUM, max=_NUM)},
            node=_ref("NodeResources"),
        ),
        "NodeResources": node_resources,
        # one node's resources in the cluster-wide table: `node` its id (null on a single
        # node), `connections` by protocol; a node that did not answer has only `node` and
        # `unanswered` (why)
        "Node": {"type": "object", "properties": dict(
            node_resources["properties"], node={"type": ["string", "null"]},
            connections={"type": "object", "additionalProperties": _INT},
            unanswered=_STR)},
        "Shard": shard,
        "Stream": _object(
            name=_STR, mode={"enum": ["reliable", "non-reliable"]}, partitions=_INT, schema=_STR,
            retention_ms={"type": ["integer", "null"]}, retention_bytes={"type": ["integer", "null"]},
            replicas={"type": ["integer", "null"]}, min_insync_replicas={"type": ["integer", "null"]},
            default=_BOOL, routes=_STRS, messages=_INT,
            shards={"type": "array", "items": _ref("Shard")},
        ),
        "Subscription": _object(
            name=_STR, type={"enum": ["exclusive", "shared", "failover"]}, durable=_BOOL,
            protocol=_STR, filters=_STRS,
            consumers={"type": "array", "items": _object(id=_STR, protocol=_STR, active=_BOOL)},
            lag=_INT, inflight=_INT, queued=_INT,
        ),
        "Client": _object(
            protocol={"enum": ["mqtt", "amqp", "grpc"]}, client_id=_STR,
            username={"type": ["string", "null"]}, remote=_STR, transport=_STR, connected_at=_NUM,
            messages_in={"type": ["integer", "null"]}, messages_out={"type": ["integer", "null"]},
            detail=_STR, kickable=_BOOL,
        ),
        "Session": _object(
            protocol=_STR, client_id=_STR, connected=_BOOL, durable=_BOOL, expiry_interval=_INT,
            disconnected_at={"type": ["number", "null"]}, filters=_STRS, shared=_STRS,
            queued=_INT, inflight=_INT, dropped=_INT,
        ),
        "Retained": _object(
            total=_INT,
            messages={"type": "array", "items": _object(
                topic=_STR, qos=_INT, size=_INT, content_type={"type": ["string", "null"]},
                publish_time=_NUM, stream=_STR, truncated=_BOOL, payload=_STR,
                payload_encoding={"enum": ["utf-8", "base64"]},
            )},
        ),
        "Archive": {"type": "object", "properties": {"enabled": _BOOL},
                    "additionalProperties": True},
    }
    array = lambda name: {"type": "array", "items": _ref(name)}  # noqa: E731
    paths = {
        "/api/info": _get("Broker version, listeners, counters, counts, and this node's memory, descriptors, "
                          "free disk and resource alarms", _ref("Info")),
        "/api/nodes": _get("Every node's memory, descriptors, free disk, resource alarms and "
                           "connections: in a cluster one row per node, whichever node is asked",
                           array("Node")),
        "/api/streams": _get("Streams with their shards and offsets", array("Stream")),
        "/api/streams/{name}": _get(
            "One stream, with the durable cursors on each shard", _ref("Stream"),
            parameters=[_path_param("name", "stream name")], responses={
                "200": _json(_ref("Stream")), "404": _NOT_FOUND}),
        "/api/subscriptions": _get("Subscriptions with lag and in-flight counts",
                                   array("Subscription")),
        "/api/subscriptions/{name}": _get(
            "One subscription", _ref("Subscription"),
            parameters=[_path_param("name", "subscription name")], responses={
                "200": _json(_ref("Subscription")), "404": _NOT_FOUND}),
        "/api/subscriptions/{name}/cursor": {"post": {
            "summary": "Move every cursor of a durable subscription: to the earliest or latest "
                       "message, an offset on every shard, or a time. In a cluster the node that "
                       "holds the subscription acts, and `node` names it",
            "parameters": [_path_param("name", "subscription name")],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "oneOf": [_object(position={"enum": ["earliest", "latest"]}),
                          _object(offset={"type": "integer", "minimum": 0}),
                          _object(timestamp_ms={"type": "integer", "minimum": 0})]}}}},
            "responses": {"200": _json(_ref("Subscription")), "400": _json(_ref("Error"), "Bad body"),
                          "404": _NOT_FOUND, "409": _json(_ref("Error"), "Live-only subscription"),
                          "503": _json(_ref("Error"), "Cluster: a node that may hold it did not answer")},
        }},
        "/api/subscriptions/{name}/purge": {"post": {
            "summary": "Drop a durable subscription's backlog: its cursors move to the end of "
                       "every shard, and an AMQP queue's ready messages go (not its unacknowledged "
                       "ones). In a cluster the node that holds the subscription acts, and `node` "
                       "names it",
            "parameters": [_path_param("name", "subscription name")],
            "responses": {"200": _json(_object(purged=_INT, subscription=_ref("Subscription"),
                                               node={"type": "string"})),
                          "404": _NOT_FOUND, "409": _json(_ref("Error"), "Live-only subscription"),
                          "503": _json(_ref("Error"), "Cluster: a node that may hold it did not answer")},
        }},
        "/api/clients": _get("Connected clients of every protocol", array("Client")),
        "/api/clients/{protocol}/{client_id}": {"delete": {
            "summary": "Disconnect a client (MQTT 5 DISCONNECT 0x98, AMQP connection.close 320, "
                       "gRPC UNAVAILABLE)",
            "parameters": [_path_param("protocol", "mqtt, amqp or grpc"),
                           _path_param("client_id", "the client id from /api/clients")],
            "responses": {"200": _json(_object(kicked=_BOOL, protocol=_STR, client_id=_STR)),
                          "404": _NOT_FOUND},
        }},
        "/api/sessions": _get("MQTT sessions, connected or not", array("Session")),
        "/api/retained": _get(
            "Retained messages (payload previews)", _ref("Retained"),
            parameters=[
                {"name": "prefix", "in": "query", "schema": _STR,
                 "description": "only topics starting with this"},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 0},
                 "description": f"at most this many (default {RETAINED_LIMIT})"},
            ]),
        "/api/archive": _get("Archiver status", _ref("Archive")),
        "/api/history": _get(
            "The last 15 minutes of traffic counters, one sample every few seconds (cumulative "
            "messages and bytes in and out, connections)", {"type": "object"}),
        "/api/archive/flush": {"post": {
            "summary": "Seal and upload what the journal holds for the archive, now",
            "responses": {"200": _json(_ref("Archive")), "409": _json(_ref("Error"), "Not enabled"),
                          "503": _json(_ref("Error"), "Object store unavailable")},
        }},
        "/api/cluster": {"get": {
            "summary": "Cluster mode: nodes, their addresses, the controller, shards per node",
            "responses": {"200": _json({"type": "object"}),
                          "404": _json(_ref("Error"), "Not in cluster mode")},
        }},
        "/api/cluster/drain/{node}": {
            "post": {
                "parameters": [_path_param("node", "a node id")],
                "summary": "Cluster mode: move every replica and leadership off a node (the "
                           "controller copies each replica elsewhere first), so it can be removed",
                "responses": {"200": _json({"type": "object"}, "The cluster status"),
                              "404": _json(_ref("Error"), "Not in cluster mode, or no such node"),
                              "503": _json(_ref("Error"), "etcd unreachable")},
            },
            "delete": {
                "parameters": [_path_param("node", "a node id")],
                "summary": "Cluster mode: stop draining a node",
                "responses": {"200": _json({"type": "object"}, "The cluster status"),
                              "404": _json(_ref("Error"), "Not in cluster mode"),
                              "503": _json(_ref("Error"), "etcd unreachable")},
            },
        },
        "/api/openapi.json": _get("This document", {"type": "object"}),
    }
    for item in paths.values():
        for operation in item.values():
            operation["responses"].setdefault("default", _json(_ref("Error"), "Error"))
    return {
        "openapi": "3.1.0",
        "info": {"title": "Shardgate admin API", "version": __version__},
        "paths": paths,
        "components": {"schemas": schemas},
    }


# ---------------------------------------------------------------------------- handlers
def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status)


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Under `/api/`: `NotFound` and HTTP errors become JSON bodies, crashes a JSON 500."""
    try:
        return await handler(request)
    except NotFound as exc:
        return _error(404, str(exc))
    except Conflict as exc:
        return _error(409, str(exc))
    except BadRequest as exc:
        return _error(400, str(exc))
    except Unavailable as exc:
        return _error(503, str(exc))
    except web.HTTPException as exc:
        if not request.path.startswith("/api/") or exc.status < 400:
            raise
        message = {404: f"no such endpoint: {request.method} {request.path}",
                   405: f"method {request.method} not allowed on {request.path}"}.get(
            exc.status, exc.reason)
        response = _error(exc.status, message)
        for header in ("Allow", "WWW-Authenticate"):
            if header in exc.headers:
                response.headers[header] = exc.headers[header]
        return response
    except Exception:
        log.exception("admin HTTP handler failed: %s %s", request.method, request.path)
        if not request.path.startswith("/api/"):
            raise
        return _error(500, "internal error; see the broker log")


def _app(request: web.Request) -> Any:
    return request.app[SERVED_KEY].app


_UNAUTHORIZED_HEADERS = {"WWW-Authenticate": 'Basic realm="Shardgate", charset="UTF-8"'}


def _basic_credentials(request: web.Request) -> tuple[str, str] | None:
    header = request.headers.get("Authorization", "")
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic" or not encoded:
        return None
    try:
        text = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    username, sep, password = text.partition(":")
    return (username, password) if sep else None


def admin_topic(path: str) -> str:
    """The topic the `admin` action is checked on for a request path."""
    topic = path.strip("/")
    if not topic or topic == "index.html" or topic.startswith("dashboard/") or topic == "dashboard":
        return "dashboard"
    return topic


_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _host_allowed(request: web.Request, allowed: list[str]) -> bool:
    """The request's Host names this listener: localhost, a loopback address, the address the
    request came in on, or a name of `listeners.http_allowed_hosts`."""
    try:
        name = urlsplit(f"//{request.host}").hostname
    except ValueError:
        return False
    if name is None:
        return False
    if name in _LOOPBACK_NAMES or name.endswith(".localhost") or name.startswith("127.") or "*" in allowed:
        return True
    if name in (entry.lower() for entry in allowed):
        return True
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    own = str(sockname[0]).split("%")[0].lower() if sockname else None
    return own is not None and name == own


def _same_origin(request: web.Request, origin: str) -> bool:
    try:
        return urlsplit(origin).hostname == urlsplit(f"//{request.host}").hostname
    except ValueError:
        return False


@web.middleware
async def _check_host(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """DNS rebinding: a request whose Host is not this listener's is refused (421)."""
    listeners = getattr(getattr(_app(request), "config", None), "listeners", None)
    allowed = list(getattr(listeners, "http_allowed_hosts", None) or [])
    if not _host_allowed(request, allowed):
        log.info("admin API: Host %r refused (listeners.http_allowed_hosts)", request.host)
        raise web.HTTPMisdirectedRequest(reason="host not allowed (listeners.http_allowed_hosts)")
    return await handler(request)


@web.middleware
async def _check_change(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A request that changes something (not GET, HEAD, OPTIONS) must not come from a page of
    another origin, and must be one a browser only sends after a CORS preflight (which this
    API never grants): `Content-Type: application/json` or an `X-Requested-With` header. A
    form or a simple cross-site fetch cannot cause a change."""
    if request.method in _SAFE_METHODS or request.match_info.http_exception is not None:
        return await handler(request)  # (no such route or method: its 404 or 405)
    origin = request.headers.get("Origin")
    if origin is not None and not _same_origin(request, origin):
        raise web.HTTPForbidden(reason="cross-origin request refused")
    content_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if content_type != "application/json" and "X-Requested-With" not in request.headers:
        raise web.HTTPForbidden(
            reason="a change needs Content-Type: application/json or an X-Requested-With header")
    return await handler(request)


@web.middleware
async def _authenticate(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """HTTP Basic with the broker's users and the ACL's `admin` action, unless the broker is
    open (no user, anonymous on), which the composition root allows only on loopback."""
    security = getattr(_app(request), "security", None)
    if security is not None:
        security.reload()  # a stat of the files: a user just added or removed counts at once
    if security is None or security.open or request.path in HEALTH_PATHS:
        return await handler(request)
    credentials = _basic_credentials(request)
    remote = request.remote or ""
    if credentials is None:
        raise web.HTTPUnauthorized(reason="credentials required (HTTP Basic)",
                                   headers=_UNAUTHORIZED_HEADERS)
    username, password = credentials
    verdict = security.authenticate_later(username, password, "http", remote, "http")
    if verdict is not None and not isinstance(verdict, str):
        verdict = await verdict  # the password is hashed off the event loop
    if verdict is not None:
        raise web.HTTPUnauthorized(reason="authentication failed", headers=_UNAUTHORIZED_HEADERS)
    topic = admin_topic(request.path)
    if not security.authorize("admin", username, "http", topic, "http"):
        raise web.HTTPForbidden(reason=f"user {username!r} may not administer {topic!r}")
    return await handler(request)


async def _info(request: web.Request) -> web.Response:
    return web.json_response(info_view(_app(request)))


UNANSWERED_HEADER = "Shardgate-Unanswered-Nodes"


async def _cluster_listing(request: web.Request, kind: str,
                           arguments: dict[str, Any] | None = None) -> web.Response | None:
    """In a cluster, the cluster-wide listing (`shardgate.cluster.views`): every node's part,
    with the nodes that did not answer in the `Shardgate-Unanswered-Nodes` header (JSON) and,
    for one stream, its `unanswered` field. None on a single node."""
    views = getattr(_app(request), "cluster_views", None)
    if views is None:
        return None
    from ..cluster.views import listing

    try:
        value, unanswered = await listing(views, kind, "json", arguments)
    except LookupError as exc:
        raise NotFound(str(exc)) from None
    if kind == "stream":
        value = dict(value, unanswered=unanswered)
    headers = {UNANSWERED_HEADER: json.dumps(unanswered)} if unanswered else None
    return web.json_response(value, headers=headers)


def nodes_view(app: Any) -> list[dict[str, Any]]:
    """This node's row of the node-resource table: its resources (`node_view`), its open
    connections by protocol, and its cluster node id (None on a single node)."""
    node_id = getattr(getattr(app, "cluster", None), "node_id", None)
    return [dict(node_view(app), node=node_id, connections=connection_counts(app))]


async def _nodes(request: web.Request) -> web.Response:
    cluster_wide = await _cluster_listing(request, "nodes")
    if cluster_wide is not None:
        return cluster_wide
    return web.json_response(nodes_view(_app(request)))


async def _streams(request: web.Request) -> web.Response:
    cluster_wide = await _cluster_listing(request, "streams")
    if cluster_wide is not None:
        return cluster_wide
    return web.json_response(streams_view(_app(request)))


async def _stream(request: web.Request) -> web.Response:
    app = _app(request)
    name = request.match_info["name"]
    cluster_wide = await _cluster_listing(request, "stream", {"name": name})
    if cluster_wide is not None:
        return cluster_wide
    stream = app.edge.streams.get(name)
    if stream is None:
        raise NotFound(f"stream {name!r} does not exist")
    return web.json_response(stream_view(app, stream, detail=True))


async def _subscriptions(request: web.Request) -> web.Response:
    cluster_wide = await _cluster_listing(request, "subscriptions")
    if cluster_wide is not None:
        return cluster_wide
    return web.json_response(subscriptions_view(_app(request)))


async def _subscription(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    sub = _app(request).edge.subscriptions.get(name)
    if sub is None:
        raise NotFound(f"subscription {name!r} does not exist")
    return web.json_response(subscription_view(sub))


async def _act(request: web.Request, action: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """Take `action` (`shardgate.cluster.views.ACTIONS`) on the subscription `arguments["name"]`
    here, or in a cluster on the node that holds it; the answer names that node (`node`)."""
    app = _app(request)
    views = getattr(app, "cluster_views", None)
    if views is None:
        name = str(arguments["name"])
        if action == "purge":
            return purge_subscription(app, name)
        return reset_cursor(app, name, arguments["kind"], arguments["value"])
    from ..cluster.views import Refused, Unreached

    try:
        acted = await views.act(action, arguments)
    except LookupError as exc:
        raise NotFound(str(exc)) from None
    except Refused as exc:
        raise Conflict(str(exc)) from None
    except Unreached as exc:
        raise Unavailable(str(exc)) from None
    first = acted[0]
    answer = dict(first.value, node=first.node)
    if len(acted) > 1:  # held on two nodes for a moment (a handover): each acted
        answer["nodes"] = [done.node for done in acted]
        if "purged" in answer:
            answer["purged"] = sum(int(done.value.get("purged", 0)) for done in acted)
    return answer


async def _reset_cursor(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest("the body is not JSON") from None
    kind, value = cursor_position(body)
    view = await _act(request, "cursor", {"name": name, "kind": kind, "value": value})
    log.info("administrator moved the cursors of subscription %r to %s%s%s (from %s)", name, kind,
             "" if value is None else f" {value}", _on_node(view), request.remote)
    return web.json_response(view)


async def _purge(request: web.Request) -> web.Response:
    """Drop a durable subscription's backlog: its cursors move to the end of every shard."""
    name = request.match_info["name"]
    answer = await _act(request, "purge", {"name": name})
    log.info("administrator purged subscription %r%s: %d messages skipped (from %s)", name,
             _on_node(answer), answer["purged"], request.remote)
    return web.json_response(answer)


def _on_node(answer: dict[str, Any]) -> str:
    node = answer.get("node")
    return "" if node is None else f" on node {node}"


async def _clients(request: web.Request) -> web.Response:
    cluster_wide = await _cluster_listing(request, "clients")
    if cluster_wide is not None:
        return cluster_wide
    return web.json_response(clients_view(_app(request)))


async def _kick(request: web.Request) -> web.Response:
    protocol = request.match_info["protocol"]
    client_id = request.match_info["client_id"]
    kick_client(_app(request), protocol, client_id)
    log.info("administrator kicked %s client %r (from %s)", protocol, client_id, request.remote)
    return web.json_response({"kicked": True, "protocol": protocol, "client_id": client_id})


async def _sessions(request: web.Request) -> web.Response:
    return web.json_response(sessions_view(_app(request)))


async def _retained(request: web.Request) -> web.Response:
    try:
        limit = int(request.query.get("limit", RETAINED_LIMIT))
    except ValueError:
        return _error(400, "limit must be an integer")
    if limit < 0:
        return _error(400, "limit must not be negative")
    prefix = request.query.get("prefix", "")
    return web.json_response(retained_view(_app(request), prefix, limit))


async def _archive(request: web.Request) -> web.Response:
    return web.json_response(archive_view(_app(request)), dumps=_dumps)


async def _archive_flush(request: web.Request) -> web.Response:
    """Seal and upload everything the journal holds for the archive, now."""
    app = _app(request)
    archiver = getattr(app, "archiver", None)
    if archiver is None:
        return _error(409, "archiving is not enabled")
    try:
        await archiver.flush(timeout=120)
    except Exception as exc:
        return _error(503, f"archive flush did not finish: {exc}")
    return web.json_response(archive_view(app), dumps=_dumps)


async def _cluster(request: web.Request) -> web.Response:
    node = getattr(_app(request), "cluster", None)
    if node is None:
        return _error(404, "this node is not in cluster mode (serve --cluster)")
    from ..cluster.attach import cluster_status

    return web.json_response(cluster_status(node), dumps=_dumps)


async def _drain(request: web.Request) -> web.Response:
    """Cluster mode: ask the controller to move every replica and leadership off a node
    (POST), or to stop (DELETE); answers the cluster status."""
    node = getattr(_app(request), "cluster", None)
    if node is None:
        return _error(404, "this node is not in cluster mode (serve --cluster)")
    from ..cluster.attach import cluster_status
    from ..cluster.etcd import EtcdError

    drained = request.match_info["node"]
    cancel = request.method == "DELETE"
    if not cancel and drained not in node.view.registrations:
        return _error(404, f"no live node {drained!r} in the cluster")
    try:
        await node.drain(drained, cancel=cancel)
    except EtcdError as exc:
        return _error(503, f"cannot reach etcd: {exc}")
    log.info("administrator %s draining node %r (from %s)", "stopped" if cancel else "started",
             drained, request.remote)
    return web.json_response(cluster_status(node), dumps=_dumps)


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[_OPENAPI_KEY])


async def _metrics(request: web.Request) -> web.Response:
    body = render(request.app[SERVED_KEY].registry)
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE
    return response


async def _index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(DASHBOARD_DIR / "index.html")


def _dumps(value: Any) -> str:
    return json.dumps(value, default=str)


_OPENAPI_KEY: web.AppKey[dict[str, Any]] = web.AppKey("openapi", dict)


def _traffic_counters(app: Any) -> dict[str, Any]:
    stats = app.edge.stats
    return {
        "messages_in": stats.messages_in, "messages_out": stats.messages_out,
        "bytes_in": stats.bytes_in, "bytes_out": stats.bytes_out,
        "connections": sum(connection_counts(app).values()),
    }


async def _history(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVED_KEY].history.view())

_DASHBOARD_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


async def _dashboard_headers(request: web.Request, response: web.StreamResponse) -> None:
    if not request.path.startswith("/api/") and request.path != "/metrics":
        for name, value in _DASHBOARD_HEADERS.items():
            response.headers.setdefault(name, value)


def create_web_app(app: Any, middlewares: list[Any] | None = None) -> web.Application:
    """The aiohttp application for `app` (a `Shardgate`); extra `middlewares` (authentication)
    run inside the JSON error translation, so their HTTP errors reach clients as JSON too."""
    web_app = web.Application(middlewares=[_json_errors, _check_host, _authenticate, _check_change,
                                           *(middlewares or [])])
    web_app[SERVED_KEY] = Served(
        app, create_registry(app), TrafficHistory(lambda: _traffic_counters(app))
    )
    web_app[_OPENAPI_KEY] = openapi_document()
    web_app.on_cleanup.append(_forget_served)
    router = web_app.router
    router.add_get("/api/info", _info)
    router.add_get("/api/nodes", _nodes)
    router.add_get("/api/streams", _streams)
    router.add_get("/api/streams/{name}", _stream)
    router.add_get("/api/subscriptions", _subscriptions)
    router.add_get("/api/subscriptions/{name}", _subscription)
    router.add_post("/api/subscriptions/{name}/cursor", _reset_cursor)
    router.add_post("/api/subscriptions/{name}/purge", _purge)
    router.add_get("/api/clients", _clients)
    router.add_delete("/api/clients/{protocol}/{client_id:.+}", _kick)
    router.add_get("/api/sessions", _sessions)
    router.add_get("/api/retained", _retained)
    router.add_get("/api/archive", _archive)
    router.add_get("/api/history", _history)
    router.add_post("/api/archive/flush", _archive_flush)
    router.add_get("/api/cluster", _cluster)
    router.add_post("/api/cluster/drain/{node}", _drain)
    router.add_delete("/api/cluster/drain/{node}", _drain)
    router.add_get("/api/openapi.json", _openapi)
    router.add_get("/metrics", _metrics)
    router.add_get("/healthz", healthz)
    router.add_get("/readyz", readyz_handler(_app))
    router.add_get("/", _index)
    router.add_static("/dashboard/", DASHBOARD_DIR, show_index=False, follow_symlinks=False)
    web_app.on_response_prepare.append(_dashboard_headers)
    return web_app


async def _forget_served(web_app: web.Application) -> None:
    web_app[SERVED_KEY].forget()


class HttpServer:
    """The bound admin server: `.port`, `close()`, `await wait_closed()`."""

    def __init__(self, runner: web.AppRunner, site: web.TCPSite, port: int) -> None:
        self.history = runner.app[SERVED_KEY].history
        self.runner = runner
        self.site = site
        self.port = port
        self._closing: asyncio.Task[None] | None = None

    def close(self) -> None:
        self.history.stop()
        if self._closing is None:
            self._closing = asyncio.ensure_future(self.runner.cleanup())

    async def wait_closed(self) -> None:
        self.close()
        assert self._closing is not None
        await self._closing


async def start_http_server(app: Any, host: str, port: int) -> HttpServer:
    """Serve the admin API, `/metrics` and the dashboard for `app` on `host:port` (0: any port),
    on the running event loop. Raises `OSError` if the port cannot be bound."""
    runner = web.AppRunner(create_web_app(app), access_log=None, shutdown_timeout=2.0,
                           logger=_server_log)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    addresses = runner.addresses
    server = HttpServer(runner, site, addresses[0][1] if addresses else port)
    server.history.start()
    return server
