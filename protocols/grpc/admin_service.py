"""The `Admin` servicer: streams, routes, subscriptions, clients and broker information; every
call needs the `admin` action on `admin/<method>`.

In a cluster, the listings (`ListStreams`, `DescribeStream`, `ListSubscriptions`,
`ListClients`) are cluster-wide, whichever node is asked: the server's `listing` (handed in by
the composition root) asks every node and merges their answers (each shard from its owner,
every node's subscriptions and clients with their node), naming the nodes that did not answer.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.json_format import ParseDict

from ... import __version__
from ...core.durable import DurableSubscription
from ...core.edge import Action, Edge
from ...core.schema_registry import SchemaVersion
from ...core.streams import DispatchMode, RoutingRule, StreamConfig
from ...core.subscriptions import Subscription
from ...core.topics import validate_topic_filter
from ...proto import shardgate_pb2 as pb
from ...proto import shardgate_pb2_grpc as pb_grpc
from .auth import user_of
from .convert import MODES, SCHEMAS, Refusal, abort, seek_to, translated

if TYPE_CHECKING:
    from .server import GrpcServer

Listing = Callable[[str, str, Mapping[str, Any] | None], Awaitable[tuple[Any, list[dict[str, str]]]]]
"""Cluster mode: `(kind, "proto", arguments) -> (listing as dicts, unanswered nodes)`, the
cluster-wide listing of `streams`, `stream` (`{"name": ...}`), `subscriptions` or `clients`."""

ResetAnywhere = Callable[[str, pb.StartPosition], Awaitable[pb.SubscriptionInfo]]
"""Cluster mode: move the cursors of a durable subscription on the node that holds it; its
answer names that node. Raises `Refusal` (NOT_FOUND, FAILED_PRECONDITION, UNAVAILABLE)."""




def _unary(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run an admin method, translating `Refusal`s and core errors into gRPC statuses."""

    async def handler(self: AdminService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            user = user_of(context)
            topic = f"admin/{method.__name__}"
            if not self.server.allowed(Action.ADMIN, user, topic):
                raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                              f"{method.__name__} needs the admin action ({topic!r}), which "
                              + (f"user {user!r}" if user is not None else "an anonymous client")
                              + " does not have")
            with translated():
                result = method(self, request)
                if inspect.isawaitable(result):
                    result = await result
                return result
        except Refusal as refusal:
            await abort(context, refusal)

    handler.__name__ = method.__name__
    handler.__doc__ = method.__doc__
    return handler


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, server: GrpcServer) -> None:
        self.server = server

    @property
    def edge(self) -> Edge:
        return self.server.edge

    # -- schemas ------------------------------------------------------------------------

    def _schema_info(self, version: SchemaVersion) -> pb.SchemaInfo:
        return pb.SchemaInfo(
            stream=version.stream, version=version.version, type=version.type.value,
            definition=version.definition, compatibility=version.compatibility.value,
            registered_ms=version.registered_ms,
            rejected=self.edge.schemas.rejected.get(version.stream, 0))

    @_unary
    async def RegisterSchema(self, request: pb.RegisterSchemaRequest) -> pb.SchemaInfo:
        self.edge.stream(request.stream)  # NOT_FOUND for an unknown stream
        version = await self.edge.schemas.register_ordered(
            request.stream, request.type or "json", request.definition,
            request.compatibility or None)
        return self._schema_info(version)

    @_unary
    def ListSchemas(self, request: pb.Empty) -> pb.ListSchemasResponse:
        registry = self.edge.schemas
        return pb.ListSchemasResponse(schemas=[
            self._schema_info(latest) for name in registry.streams()
            if (latest := registry.latest(name)) is not None
        ])

    @_unary
    def GetSchemas(self, request: pb.StreamName) -> pb.SchemaVersions:
        self.edge.stream(request.name)
        return pb.SchemaVersions(versions=[
            self._schema_info(v) for v in self.edge.schemas.versions(request.name)])

    # -- streams ------------------------------------------------------------------------

    @_unary
    def CreateStream(self, request: pb.StreamSpec) -> pb.StreamInfo:
        mode = MODES.get(request.mode)
        if request.mode == pb.DISPATCH_MODE_UNSPECIFIED:
            # One default everywhere: the broker's `default_stream_mode`, the default stream's.
            mode = self.edge.stream(self.edge.default_stream).config.mode
        schema = SCHEMAS.get(request.schema)
        if mode is None or schema is None:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "unknown dispatch mode or schema")
        config = StreamConfig(
            request.name, mode=mode, partitions=request.partitions or 1, schema=schema,
            retention_ms=request.retention_ms if request.HasField("retention_ms") else None,
            retention_bytes=request.retention_bytes if request.HasField("retention_bytes") else None,
            replicas=request.replicas if request.HasField("replicas") else None,
            min_insync_replicas=(request.min_insync_replicas
                                 if request.HasField("min_insync_replicas") else None),
        )
        routes = list(request.routes) or [request.name, f"{request.name}/#"]
        for route in routes:
            validate_topic_filter(route)
        if mode is DispatchMode.RELIABLE and not self.edge.stores_messages:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "reliable streams need a journal and this broker has none configured")
        stream = self.edge.create_stream(config, routes=routes)
        return self.server.stream_info(stream)

    @_unary
    async def ListStreams(self, request: pb.Empty) -> pb.ListStreamsResponse:
        listing = self.server.listing
        if listing is not None:
            streams, unanswered = await listing("streams", "proto", None)
            return ParseDict({"streams": streams, "unanswered": unanswered},
                             pb.ListStreamsResponse())
        streams = sorted(self.edge.streams.values(), key=lambda s: s.config.name)
        return pb.ListStreamsResponse(streams=[self.server.stream_info(s) for s in streams])

    @_unary
    async def DescribeStream(self, request: pb.StreamName) -> pb.StreamInfo:
        listing = self.server.listing
        if listing is not None:
            try:
                stream, unanswered = await listing("stream", "proto", {"name": request.name})
            except LookupError as exc:
                raise Refusal(grpc.StatusCode.NOT_FOUND, str(exc)) from None
            return ParseDict(dict(stream, unanswered=unanswered), pb.StreamInfo())
        return self.server.stream_info(self.edge.stream(request.name))

    @_unary
    def UpdateStream(self, request: pb.UpdateStreamRequest) -> pb.StreamInfo:
        stream = self.edge.stream(request.name)
        for route in request.add_routes:
            self.edge.add_route(RoutingRule(route, request.name))
        if request.HasField("retention_ms") or request.HasField("retention_bytes"):
            stream = self.edge.update_stream(
                request.name,
                retention_ms=request.retention_ms if request.HasField("retention_ms") else None,
                retention_bytes=request.retention_bytes if request.HasField("retention_bytes") else None,
            )
        return self.server.stream_info(stream)

    @_unary
    def DeleteStream(self, request: pb.StreamName) -> pb.Empty:
        edge = self.edge
        edge.stream(request.name)
        if request.name == edge.default_stream:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "the default stream cannot be deleted")
        edge.delete_stream(request.name)
        return pb.Empty()

    @_unary
    def AddRoute(self, request: pb.Route) -> pb.Empty:
        self.edge.add_route(RoutingRule(request.topic_filter, request.stream))
        return pb.Empty()

    @_unary
    def RemoveRoute(self, request: pb.Route) -> pb.Empty:
        if not self.edge.remove_route(request.topic_filter):
            raise Refusal(grpc.StatusCode.NOT_FOUND, f"no route for {request.topic_filter!r}")
        return pb.Empty()

    @_unary
    def ListRoutes(self, request: pb.Empty) -> pb.ListRoutesResponse:
        return pb.ListRoutesResponse(routes=[
            pb.Route(topic_filter=rule.topic_filter, stream=rule.stream)
            for rule in self.edge.routes
        ])

    @_unary
    async def ListSubscriptions(self, request: pb.Empty) -> pb.ListSubscriptionsResponse:
        listing = self.server.listing
        if listing is not None:
            rows, unanswered = await listing("subscriptions", "proto", None)
            return ParseDict({"subscriptions": rows, "unanswered": unanswered},
                             pb.ListSubscriptionsResponse())
        subs = sorted(self.edge.subscriptions.values(), key=lambda s: s.name)
        return pb.ListSubscriptionsResponse(
            subscriptions=[self.server.subscription_info(sub) for sub in subs])

    def _subscription(self, name: str) -> Subscription:
        sub = self.edge.subscriptions.get(name)
        if sub is None:
            raise Refusal(grpc.StatusCode.NOT_FOUND, f"subscription {name!r} does not exist")
        return sub

    @_unary
    async def DescribeSubscription(self, request: pb.SubscriptionName) -> pb.SubscriptionInfo:
        """On any node of a cluster: a durable subscription another node holds is described
        by that node (its consumers from every node are attached there)."""
        sub = self.edge.subscriptions.get(request.name)
        elsewhere = self.server.describe_elsewhere
        if sub is None and elsewhere is not None:
            info = await elsewhere(request.name)
            if info is not None:
                return info
        return self.server.subscription_info(self._subscription(request.name))

    @_unary
    async def ResetCursor(self, request: pb.ResetCursorRequest) -> pb.SubscriptionInfo:
        """In a cluster, on the node that holds the subscription, named in the answer's `node`."""
        reset_anywhere = self.server.reset_anywhere
        if reset_anywhere is not None:
            return await reset_anywhere(request.subscription, request.position)
        sub = self._subscription(request.subscription)
        if not sub.durable or not isinstance(sub, DurableSubscription):
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"subscription {sub.name!r} is live-only: it has no cursor to reset")
        seek_to(sub, request.position)
        return self.server.subscription_info(sub)

    @_unary
    async def DeleteSubscription(self, request: pb.SubscriptionName) -> pb.Empty:
        """On any node of a cluster: a durable subscription another node holds is deleted
        there (or in etcd, when its holder is down)."""
        elsewhere = self.server.delete_elsewhere
        if request.name not in self.edge.subscriptions and elsewhere is not None:
            if await elsewhere(request.name):
                return pb.Empty()
        self.server.delete_subscription(self._subscription(request.name))
        return pb.Empty()

    @_unary
    async def ListClients(self, request: pb.Empty) -> pb.ListClientsResponse:
        listing = self.server.listing
        if listing is not None:
            rows, unanswered = await listing("clients", "proto", None)
            return ParseDict({"clients": rows, "unanswered": unanswered}, pb.ListClientsResponse())
        return pb.ListClientsResponse(clients=self.server.clients())

    @_unary
    def GetBrokerInfo(self, request: pb.Empty) -> pb.BrokerInfo:
        edge = self.edge
        stats = edge.stats
        listeners = self.server.edge.listeners
        return pb.BrokerInfo(
            version=__version__,
            started_at=stats.started_at,
            uptime_s=max(0.0, time.time() - stats.started_at),
            listeners=[pb.Listener(name=lst.name, host=lst.host, port=lst.port)
                       for lst in listeners.values()],
            messages_in=stats.messages_in, bytes_in=stats.bytes_in,
            messages_out=stats.messages_out, bytes_out=stats.bytes_out,
            messages_dropped=stats.messages_dropped,
            streams=len(edge.streams), subscriptions=len(edge.subscriptions),
            clients=len(self.server.clients()),
        )

    @_unary
    def GetClusterStatus(self, request: pb.Empty) -> pb.ClusterStatus:
        status = self.server.cluster_status
        if status is None:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "this node is not in cluster mode (serve --cluster)")
        return pb.ClusterStatus(json=json.dumps(status(), default=str))
