"""The administrator's actions on this node: kicking a client and moving a durable
subscription's cursors (reset to the earliest, the latest, an offset or a time; purge: to the
end). Each answers a view (`admin/views.py`) or raises one of `admin/errors.py`; the admin HTTP
API and the cluster's forwarded actions (`local_listings.py`) call them. Nothing here knows
HTTP.
"""

from __future__ import annotations

from typing import Any

from ..core.edge import KICK_REASON
from .errors import BadRequest, Conflict, NotFound
from .views import subscription_view


def kick_client(app: Any, protocol: str, client_id: str) -> None:
    """Disconnect one client; raises `NotFound` if no such client is connected."""
    if protocol not in ("mqtt", "amqp", "grpc"):
        raise NotFound(f"unknown protocol {protocol!r}: expected mqtt, amqp or grpc")
    edge = getattr(app, "edge", None)
    if edge is None or not edge.clients.kick(protocol, client_id, KICK_REASON):
        raise NotFound(f"no {protocol} client {client_id!r} is connected")


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

