"""The admin HTTP server's middlewares, in the order they run: JSON errors under `/api/`
(the errors of `admin/errors.py` and HTTP errors become `{"error": ..., "status": ...}`, a
crash a JSON 500), the Host check against DNS rebinding, HTTP Basic authentication with the
`admin` action of the ACL, and the cross-site check of a request that changes something.
They guard requests; they never read or change broker state beyond the security model.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

from .errors import BadRequest, Conflict, NotFound, Unavailable
from .health import HEALTH_PATHS
from .served import served_app

# The admin server's logger, as before these middlewares had a module of their own.
log = logging.getLogger("shardgate.admin.admin_http")


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status)


@web.middleware
async def json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Under `/api/`: `NotFound` and HTTP errors become JSON bodies, crashes a JSON 500."""
    try:
        return await handler(request)
    except NotFound as exc:
        return error_response(404, str(exc))
    except Conflict as exc:
        return error_response(409, str(exc))
    except BadRequest as exc:
        return error_response(400, str(exc))
    except Unavailable as exc:
        return error_response(503, str(exc))
    except web.HTTPException as exc:
        if not request.path.startswith("/api/") or exc.status < 400:
            raise
        message = {404: f"no such endpoint: {request.method} {request.path}",
                   405: f"method {request.method} not allowed on {request.path}"}.get(
            exc.status, exc.reason)
        response = error_response(exc.status, message)
        for header in ("Allow", "WWW-Authenticate"):
            if header in exc.headers:
                response.headers[header] = exc.headers[header]
        return response
    except Exception:
        log.exception("admin HTTP handler failed: %s %s", request.method, request.path)
        if not request.path.startswith("/api/"):
            raise
        return error_response(500, "internal error; see the broker log")



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
async def check_host(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """DNS rebinding: a request whose Host is not this listener's is refused (421)."""
    listeners = getattr(getattr(served_app(request), "config", None), "listeners", None)
    allowed = list(getattr(listeners, "http_allowed_hosts", None) or [])
    if not _host_allowed(request, allowed):
        log.info("admin API: Host %r refused (listeners.http_allowed_hosts)", request.host)
        raise web.HTTPMisdirectedRequest(reason="host not allowed (listeners.http_allowed_hosts)")
    return await handler(request)


@web.middleware
async def check_change(
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
async def authenticate(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """HTTP Basic with the broker's users and the ACL's `admin` action, unless the broker is
    open (no user, anonymous on), which the composition root allows only on loopback."""
    security = getattr(served_app(request), "security", None)
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

