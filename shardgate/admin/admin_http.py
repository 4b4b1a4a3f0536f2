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

This module holds the routes, their handlers and the server; its parts are `views.py` (what
the API shows), `actions.py` (what an administrator changes), `errors.py`, `openapi.py` (the
API's description), `guards.py` (the middlewares: JSON errors, Host check, authentication,
cross-site check) and `served.py` (the broker an application serves). Their names are
importable from here as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .actions import cursor_position, kick_client, purge_subscription, reset_cursor
from .errors import BadRequest, Conflict, NotFound, Unavailable
from .guards import admin_topic, authenticate, check_change, check_host, error_response, json_errors
from .health import healthz, readyz_handler
from .history import TrafficHistory
from .metrics import CONTENT_TYPE, create_registry, render
from .node_readings import connection_counts
from .openapi import openapi_document
from .served import SERVED_KEY, Served, served_app
from .views import (
    PREVIEW_BYTES,
    RETAINED_LIMIT,
    archive_view,
    clients_view,
    info_view,
    node_view,
    nodes_view,
    retained_view,
    sessions_view,
    stream_view,
    streams_view,
    subscription_view,
    subscriptions_view,
)

__all__ = [
    "PREVIEW_BYTES", "RETAINED_LIMIT", "SERVED_KEY", "UNANSWERED_HEADER", "BadRequest", "Conflict",
    "HttpServer", "NotFound", "Served", "Unavailable", "admin_topic", "archive_view",
    "clients_view", "create_web_app", "cursor_position", "info_view", "kick_client", "node_view",
    "nodes_view", "openapi_document", "purge_subscription", "reset_cursor", "retained_view",
    "sessions_view", "start_http_server", "stream_view", "streams_view", "subscription_view",
    "subscriptions_view",
]

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


async def _info(request: web.Request) -> web.Response:
    return web.json_response(info_view(served_app(request)))


UNANSWERED_HEADER = "Shardgate-Unanswered-Nodes"


async def _cluster_listing(request: web.Request, kind: str,
                           arguments: dict[str, Any] | None = None) -> web.Response | None:
    """In a cluster, the cluster-wide listing (`shardgate.cluster.views`): every node's part,
    with the nodes that did not answer in the `Shardgate-Unanswered-Nodes` header (JSON) and,
    for one stream, its `unanswered` field. None on a single node."""
    views = getattr(served_app(request), "cluster_views", None)
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



async def _nodes(request: web.Request) -> web.Response:
    cluster_wide = await _cluster_listing(request, "nodes")
    if cluster_wide is not None:
        return cluster_wide
    return web.json_response(nodes_view(served_app(request)))


async def _streams(request: web.Request) -> web.Response:
    cluster_wide = await _cluster_listing(request, "streams")
    if cluster_wide is not None:
        return cluster_wide
    return web.json_response(streams_view(served_app(request)))


async def _stream(request: web.Request) -> web.Response:
    app = served_app(request)
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
    return web.json_response(subscriptions_view(served_app(request)))


async def _subscription(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    sub = served_app(request).edge.subscriptions.get(name)
    if sub is None:
        raise NotFound(f"subscription {name!r} does not exist")
    return web.json_response(subscription_view(sub))


async def _act(request: web.Request, action: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """Take `action` (`shardgate.cluster.views.ACTIONS`) on the subscription `arguments["name"]`
    here, or in a cluster on the node that holds it; the answer names that node (`node`)."""
    app = served_app(request)
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
    return web.json_response(clients_view(served_app(request)))


async def _kick(request: web.Request) -> web.Response:
    protocol = request.match_info["protocol"]
    client_id = request.match_info["client_id"]
    kick_client(served_app(request), protocol, client_id)
    log.info("administrator kicked %s client %r (from %s)", protocol, client_id, request.remote)
    return web.json_response({"kicked": True, "protocol": protocol, "client_id": client_id})


async def _sessions(request: web.Request) -> web.Response:
    return web.json_response(sessions_view(served_app(request)))


async def _retained(request: web.Request) -> web.Response:
    try:
        limit = int(request.query.get("limit", RETAINED_LIMIT))
    except ValueError:
        return error_response(400, "limit must be an integer")
    if limit < 0:
        return error_response(400, "limit must not be negative")
    prefix = request.query.get("prefix", "")
    return web.json_response(retained_view(served_app(request), prefix, limit))


async def _archive(request: web.Request) -> web.Response:
    return web.json_response(archive_view(served_app(request)), dumps=_dumps)


async def _archive_flush(request: web.Request) -> web.Response:
    """Seal and upload everything the journal holds for the archive, now."""
    app = served_app(request)
    archiver = getattr(app, "archiver", None)
    if archiver is None:
        return error_response(409, "archiving is not enabled")
    try:
        await archiver.flush(timeout=120)
    except Exception as exc:
        return error_response(503, f"archive flush did not finish: {exc}")
    return web.json_response(archive_view(app), dumps=_dumps)


async def _cluster(request: web.Request) -> web.Response:
    node = getattr(served_app(request), "cluster", None)
    if node is None:
        return error_response(404, "this node is not in cluster mode (serve --cluster)")
    from ..cluster.attach import cluster_status

    return web.json_response(cluster_status(node), dumps=_dumps)


async def _drain(request: web.Request) -> web.Response:
    """Cluster mode: ask the controller to move every replica and leadership off a node
    (POST), or to stop (DELETE); answers the cluster status."""
    node = getattr(served_app(request), "cluster", None)
    if node is None:
        return error_response(404, "this node is not in cluster mode (serve --cluster)")
    from ..cluster.attach import cluster_status
    from ..cluster.etcd import EtcdError

    drained = request.match_info["node"]
    cancel = request.method == "DELETE"
    if not cancel and drained not in node.view.registrations:
        return error_response(404, f"no live node {drained!r} in the cluster")
    try:
        await node.drain(drained, cancel=cancel)
    except EtcdError as exc:
        return error_response(503, f"cannot reach etcd: {exc}")
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
    web_app = web.Application(middlewares=[json_errors, check_host, authenticate, check_change,
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
    router.add_get("/readyz", readyz_handler(served_app))
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
