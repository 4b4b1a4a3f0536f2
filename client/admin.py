"""`Admin`: streams, routing rules, subscriptions, connected clients and broker info."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from ..proto import shardgate_pb2 as pb
from ..proto import shardgate_pb2_grpc as pb_grpc
from .errors import from_rpc_error
from .types import (
    BrokerInfo,
    ClientInfo,
    Listing,
    Mode,
    Position,
    Schema,
    SchemaInfo,
    StreamInfo,
    SubscriptionInfo,
)

T = TypeVar("T")


class Admin:
    """Administration calls; every method raises a `ShardgateError` subclass on failure."""

    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = (),
                 timeout: float = 10.0) -> None:
        self._stub = pb_grpc.AdminStub(channel)
        self._metadata = metadata
        self._timeout = timeout

    async def _call(self, method: Callable[..., Awaitable[T]], request: Any) -> T:
        try:
            return await method(request, metadata=self._metadata, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    # ---------------------------------------------------------------- schemas
    async def register_schema(
        self, stream: str, definition: str | dict[str, Any], *, type: str = "json",
        compatibility: str | None = None,
    ) -> SchemaInfo:
        """Register a version of `stream`'s payload schema: a JSON Schema (`type="json"`) or an
        Avro schema (`"avro"`), as text or a parsed document. `compatibility` (backward,
        forward, full, none) defaults to the stream's mode so far (backward at first).
        `InvalidArgument` for an invalid schema, `FailedPrecondition` for one that breaks the
        compatibility mode; registering the latest schema again returns it unchanged."""
        text = definition if isinstance(definition, str) else json.dumps(definition)
        request = pb.RegisterSchemaRequest(stream=stream, type=type, definition=text,
                                           compatibility=compatibility or "")
        return SchemaInfo.from_pb(await self._call(self._stub.RegisterSchema, request))

    async def list_schemas(self) -> list[SchemaInfo]:
        """The latest schema version of each stream that has one."""
        response = await self._call(self._stub.ListSchemas, pb.Empty())
        return [SchemaInfo.from_pb(s) for s in response.schemas]

    async def schemas(self, stream: str) -> list[SchemaInfo]:
        """Every schema version of `stream`, oldest first (empty: none registered)."""
        response = await self._call(self._stub.GetSchemas, pb.StreamName(name=stream))
        return [SchemaInfo.from_pb(s) for s in response.versions]

    # ---------------------------------------------------------------- streams
    async def create_stream(
        self, name: str, *, partitions: int = 1, mode: Mode | str | None = None,
        schema: Schema | str = Schema.BYTES, retention_ms: int | None = None,
        retention_bytes: int | None = None, routes: list[str] | None = None,
        replicas: int | None = None, min_insync_replicas: int | None = None,
    ) -> StreamInfo:
        """Create a stream; it receives topic `name` and `name/#` unless `routes` say otherwise.
        Without `mode` the broker's `default_stream_mode` applies (reliable unless configured).
        In a cluster a reliable stream keeps `replicas` copies of each shard (default: the
        nodes' `[cluster] default_replicas`, 3 unless set; capped by the live nodes) and acknowledges a message once `min_insync_replicas`
        (default 2) hold it; a single node keeps one."""
        spec = pb.StreamSpec(name=name, partitions=partitions,
                             mode=Mode(mode).to_pb() if mode is not None else pb.DISPATCH_MODE_UNSPECIFIED,
                             schema=Schema(schema).to_pb(), routes=routes or [])
        if retention_ms is not None:
            spec.retention_ms = retention_ms
        if retention_bytes is not None:
            spec.retention_bytes = retention_bytes
        if replicas is not None:
            spec.replicas = replicas
        if min_insync_replicas is not None:
            spec.min_insync_replicas = min_insync_replicas
        return StreamInfo.from_pb(await self._call(self._stub.CreateStream, spec))

    async def list_streams(self) -> Listing[StreamInfo]:
        """Every stream; in a cluster each shard's figures come from its owner (whichever node
        is asked), and `unanswered` names the nodes that did not answer."""
        response = await self._call(self._stub.ListStreams, pb.Empty())
        return Listing([StreamInfo.from_pb(s) for s in response.streams],
                       {x.node: x.reason for x in response.unanswered})

    async def describe_stream(self, name: str) -> StreamInfo:
        return StreamInfo.from_pb(await self._call(self._stub.DescribeStream, pb.StreamName(name=name)))

    async def update_stream(self, name: str, *, retention_ms: int | None = None,
                            retention_bytes: int | None = None,
                            add_routes: list[str] | None = None) -> StreamInfo:
        request = pb.UpdateStreamRequest(name=name, add_routes=add_routes or [])
        if retention_ms is not None:
            request.retention_ms = retention_ms
        if retention_bytes is not None:
            request.retention_bytes = retention_bytes
        return StreamInfo.from_pb(await self._call(self._stub.UpdateStream, request))

    async def delete_stream(self, name: str) -> None:
        await self._call(self._stub.DeleteStream, pb.StreamName(name=name))

    # ---------------------------------------------------------------- routing
    async def add_route(self, topic_filter: str, stream: str) -> None:
        await self._call(self._stub.AddRoute, pb.Route(topic_filter=topic_filter, stream=stream))

    async def remove_route(self, topic_filter: str) -> None:
        await self._call(self._stub.RemoveRoute, pb.Route(topic_filter=topic_filter))

    async def list_routes(self) -> list[tuple[str, str]]:
        response = await self._call(self._stub.ListRoutes, pb.Empty())
        return [(r.topic_filter, r.stream) for r in response.routes]

    # ---------------------------------------------------------------- subscriptions
    async def list_subscriptions(self) -> Listing[SubscriptionInfo]:
        """Every subscription; in a cluster every node's, each with its `node`."""
        response = await self._call(self._stub.ListSubscriptions, pb.Empty())
        return Listing([SubscriptionInfo.from_pb(s) for s in response.subscriptions],
                       {x.node: x.reason for x in response.unanswered})

    async def describe_subscription(self, name: str) -> SubscriptionInfo:
        response = await self._call(self._stub.DescribeSubscription, pb.SubscriptionName(name=name))
        return SubscriptionInfo.from_pb(response)

    async def reset_cursor(self, name: str, position: Position) -> SubscriptionInfo:
        request = pb.ResetCursorRequest(subscription=name, position=position.to_pb())
        return SubscriptionInfo.from_pb(await self._call(self._stub.ResetCursor, request))

    async def delete_subscription(self, name: str) -> None:
        await self._call(self._stub.DeleteSubscription, pb.SubscriptionName(name=name))

    # ---------------------------------------------------------------- clients and broker
    async def list_clients(self) -> Listing[ClientInfo]:
        """Every connected client; in a cluster every node's, each with its `node`."""
        response = await self._call(self._stub.ListClients, pb.Empty())
        return Listing([ClientInfo.from_pb(c) for c in response.clients],
                       {x.node: x.reason for x in response.unanswered})

    async def broker_info(self) -> BrokerInfo:
        return BrokerInfo.from_pb(await self._call(self._stub.GetBrokerInfo, pb.Empty()))

    async def cluster_status(self) -> dict[str, Any]:
        """The cluster as the answering node sees it (the admin API's `/api/cluster`);
        `FailedPrecondition` from a node not in cluster mode."""
        response = await self._call(self._stub.GetClusterStatus, pb.Empty())
        status: dict[str, Any] = json.loads(response.json)
        return status
