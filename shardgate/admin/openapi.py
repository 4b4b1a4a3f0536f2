"""The OpenAPI 3.1 description of the admin HTTP API (`/api/openapi.json`): one path per
`/api/` route of `admin_http.create_web_app` and a schema per view of `admin/views.py`. Built
once per application; it must list every route the API serves."""

from __future__ import annotations

from typing import Any

from .. import __version__
from .views import RETAINED_LIMIT


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

