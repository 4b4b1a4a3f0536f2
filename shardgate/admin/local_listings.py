"""What this node holds, as the listings of the admin surfaces: the answer a cluster node
gives its peers when they build a cluster-wide listing (`shardgate.cluster.views`).

Two shapes: `json`, the admin HTTP API's (`admin_http.streams_view` and the rest), and
`proto`, the gRPC Admin messages as dicts (`google.protobuf.json_format`), which the asking
node turns back into messages. Nothing here is on a message's path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from .admin_http import clients_view, stream_view, streams_view, subscriptions_view


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
