"""What this node holds, as the listings of the admin surfaces: the answer a cluster node
gives its peers when they build a cluster-wide listing (`shardgate.cluster.views`).

Two shapes: `json`, the admin HTTP API's (`views.streams_view` and the rest), and
`proto`, the gRPC Admin messages as dicts (`google.protobuf.json_format`), which the asking
node turns back into messages. `local_action` is this node's side of an administrator's
action on a subscription it holds (purge, cursor moves), which the cluster forwards to the
holder (`ClusterViews.act`). Nothing here is on a message's path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf.json_format import MessageToDict, ParseDict
from google.protobuf.message import Message
from grpc import StatusCode

from .actions import purge_subscription, reset_cursor
from .errors import Conflict, NotFound
from .views import clients_view, nodes_view, stream_view, streams_view, subscriptions_view


def as_dict(message: Message) -> dict[str, Any]:
    value: dict[str, Any] = MessageToDict(message, preserving_proto_field_name=True,
                                          always_print_fields_with_no_presence=True)
    return value


def local_view(app: Any) -> Callable[[str, str, dict[str, Any]], Any]:
    """`(kind, shape, arguments) -> listing` for `app`'s node (see `cluster.views.LocalView`)."""

    def stream_of(arguments: dict[str, Any]) -> Any:
        name = str(arguments.get("name", ""))
        stream = app.edge.streams.get(name)
        if stream is None:
            raise LookupError(f"stream {name!r} does not exist")
        return stream

    def view(kind: str, shape: str, arguments: dict[str, Any]) -> Any:
        if kind == "nodes":  # one shape: the admin HTTP API's
            return nodes_view(app)
        if shape == "json":
            if kind == "streams":
                return streams_view(app)
            if kind == "stream":
                return stream_view(app, stream_of(arguments), detail=True)
            if kind == "subscriptions":
                return subscriptions_view(app)
            return clients_view(app)
        grpc = getattr(app, "grpc", None)
        if grpc is None:
            raise LookupError("this node has no gRPC service")
        if kind == "streams":
            streams = sorted(app.edge.streams.values(), key=lambda s: s.config.name)
            return [as_dict(grpc.stream_info(stream)) for stream in streams]
        if kind == "stream":
            return as_dict(grpc.stream_info(stream_of(arguments)))
        if kind == "subscriptions":
            subs = sorted(app.edge.subscriptions.values(), key=lambda sub: sub.name)
            return [as_dict(grpc.subscription_info(sub)) for sub in subs]
        return [as_dict(client) for client in grpc.clients()]

    return view


def local_action(app: Any) -> Callable[[str, dict[str, Any]], Any]:
    """`(action, arguments) -> what was done` on a subscription `app`'s node holds (see
    `cluster.views.LocalAction`): `purge` and `cursor` answer as the admin HTTP API, `reset`
    (gRPC Admin ResetCursor, `position` a `StartPosition` as a dict) as gRPC Admin."""
    from ..cluster.views import Refused

    def act(action: str, arguments: dict[str, Any]) -> Any:
        name = str(arguments.get("name", ""))
        try:
            if action == "purge":
                return purge_subscription(app, name)
            if action == "cursor":
                value = arguments.get("value")
                return reset_cursor(app, name, str(arguments.get("kind", "latest")),
                                    None if value is None else int(value))
            if action == "reset":
                return _grpc_reset(app, name, arguments.get("position") or {})
        except NotFound as exc:
            raise LookupError(str(exc)) from None
        except Conflict as exc:
            raise Refused(str(exc)) from None
        raise ValueError(f"no action {action!r}")

    return act


def _grpc_reset(app: Any, name: str, position: dict[str, Any]) -> dict[str, Any]:
    from ..core.durable import DurableSubscription
    from ..proto import shardgate_pb2 as pb
    from ..protocols.grpc.convert import seek_to

    grpc = getattr(app, "grpc", None)
    if grpc is None:
        raise LookupError("this node has no gRPC service")
    sub = app.edge.subscriptions.get(name)
    if sub is None:
        raise NotFound(f"subscription {name!r} does not exist on this node")
    if not sub.durable or not isinstance(sub, DurableSubscription):
        raise Conflict(f"subscription {name!r} is live-only: it has no cursor to reset")
    seek_to(sub, ParseDict(position, pb.StartPosition()))
    return as_dict(grpc.subscription_info(sub))


def grpc_reset_anywhere(views: Any) -> Callable[[str, Any], Awaitable[Any]]:
    """gRPC Admin `ResetCursor` in a cluster (`protocols.grpc.admin_service.ResetAnywhere`):
    on the node that holds the subscription (`ClusterViews.act`), which its answer names."""
    from ..cluster.views import Refused, Unreached
    from ..proto import shardgate_pb2 as pb
    from ..protocols.grpc.convert import Refusal

    async def reset(name: str, position: Any) -> Any:
        try:
            acted = await views.act("reset", {"name": name, "position": as_dict(position)})
        except LookupError as exc:
            raise Refusal(StatusCode.NOT_FOUND, str(exc)) from None
        except Refused as exc:
            raise Refusal(StatusCode.FAILED_PRECONDITION, str(exc)) from None
        except Unreached as exc:
            raise Refusal(StatusCode.UNAVAILABLE, str(exc)) from None
        info = ParseDict(acted[0].value, pb.SubscriptionInfo(), ignore_unknown_fields=True)
        info.node = acted[0].node
        return info

    return reset
