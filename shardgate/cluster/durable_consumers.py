"""Consumers of a durable subscription connected on a node other than its holder.

A durable subscription (`durables.py`) lives on one node at a time, its holder. While
consumers of it are attached there, a consumer that comes to another node attaches there
remotely: its node relays its `Subscribe` stream to the holder over the cluster port
(`DurableConsumers/Consume`, the same `ConsumeRequest` / `ConsumeResponse` messages, the
client's credit window passing through end to end), where it is one more consumer of the
subscription; deliveries, acks, nacks and redeliveries all go through the one cursor. When the
holder dies, a relayed stream ends with UNAVAILABLE and the SDK resubscribes on its own node,
which takes the subscription over (`DurableHandover.find`). So does it when the holder leaves
this node's view: a holder frozen or cut off past its lease keeps the stream open and silent,
and its consumers here would wait on it for good.

`DescribeSubscription` and `DeleteSubscription` for a subscription held elsewhere are asked of
its holder the same way, or answered from its etcd record when the holder is down.

This module is the gRPC server's `RemoteSubscriptions` port and the holder's side of the relay;
it never moves a subscription itself (that is `durables.DurableHandover`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from ..core.durable import DurableSubscription
from ..core.errors import ShardUnavailable
from ..core.subscriptions import SubscriptionType
from ..proto import shardgate_pb2 as pb
from ..protocols.grpc.convert import SUB_TYPES_OUT
from .etcd import EtcdError, KeyValue
from .set_aside import decode_record
from .state_rpc import StateCallError

if TYPE_CHECKING:
    from ..protocols.grpc.server import GrpcServer
    from .durables import DurableHandover

log = logging.getLogger(__name__)

# The stream a consumer on another node is relayed through (module docstring).
CONSUMERS_SERVICE = "shardgate.cluster.v1.DurableConsumers"
CONSUME = "Consume"
# A holder's description of a durable subscription (`SubscriptionName` -> `SubscriptionInfo`).
DESCRIBE = "Describe"
# A holder deletes a durable subscription (`SubscriptionName` -> `Empty`).
DELETE = "Delete"
# How long a holder gets to describe a subscription before the last checkpoint is used.
DESCRIBE_TIMEOUT_S = 5.0
# Metadata of a relayed stream: the subscription it is for.
SUBSCRIPTION_HEADER = "shardgate-subscription"
# Statuses of a relayed stream that mean "the holder went away": the client retries.
_HOLDER_GONE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                          grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
                          grpc.StatusCode.INTERNAL})


class DurableConsumers:
    """Durable subscriptions held by other nodes, as the gRPC API reaches them, and the
    holder's service for consumers relayed from other nodes (module docstring)."""

    def __init__(self, handover: DurableHandover) -> None:
        self.handover = handover
        self.node = handover.node
        self.broker = handover.broker
        self.rpc = handover.rpc
        # the relayed streams open now, by holder: ended when their holder leaves the view
        self._relays: dict[str, set[Any]] = {}
        self.node.view.on_change(self._view_changed)

    def _view_changed(self) -> None:
        if not self._relays:
            return
        live = self.node.view.nodes()
        for holder in [holder for holder in self._relays if holder not in live]:
            for call in self._relays.pop(holder):
                call.cancel()

    # ------------------------------------------------------------ the holder
    def serve(self, grpc_server: GrpcServer) -> grpc.GenericRpcHandler:
        """Relay consumers from other nodes (module docstring): this node's gRPC server takes
        their streams; the returned handler goes on the cluster port."""
        handover = self.handover

        async def consume(requests: AsyncIterator[pb.ConsumeRequest],
                          context: grpc.aio.ServicerContext) -> None:
            name = dict(context.invocation_metadata() or ()).get(SUBSCRIPTION_HEADER, "")
            sub = self.broker.subscriptions.get(str(name))
            if not isinstance(sub, DurableSubscription) or not handover.shareable(sub):
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"durable subscription {name!r} is no longer consumed on node "
                                    f"{self.node.node_id}; retry")
                return
            handover.relay_started(sub)
            try:
                await grpc_server.consumer_service.Subscribe(requests, context)
            finally:
                handover.relay_ended(sub)

        async def describe(request: pb.SubscriptionName,
                           context: grpc.aio.ServicerContext) -> pb.SubscriptionInfo:
            sub = self.broker.subscriptions.get(request.name)
            if sub is None:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"subscription {request.name!r} is not held on node {self.node.node_id}")
            assert sub is not None
            return grpc_server.subscription_info(sub)

        async def delete(request: pb.SubscriptionName, context: grpc.aio.ServicerContext) -> pb.Empty:
            sub = self.broker.subscriptions.get(request.name)
            if sub is None:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"subscription {request.name!r} is not held on node {self.node.node_id}")
            assert sub is not None
            grpc_server.delete_subscription(sub)  # its etcd record goes too (`durable_removed`)
            return pb.Empty()

        return grpc.method_handlers_generic_handler(CONSUMERS_SERVICE, {
            DELETE: grpc.unary_unary_rpc_method_handler(
                delete, request_deserializer=pb.SubscriptionName.FromString,
                response_serializer=pb.Empty.SerializeToString),
            CONSUME: grpc.stream_stream_rpc_method_handler(
                consume, request_deserializer=pb.ConsumeRequest.FromString,
                response_serializer=pb.ConsumeResponse.SerializeToString),
            DESCRIBE: grpc.unary_unary_rpc_method_handler(
                describe, request_deserializer=pb.SubscriptionName.FromString,
                response_serializer=pb.SubscriptionInfo.SerializeToString),
        })

    # ------------------------------------------------------------ the consumer's node
    async def _held_elsewhere(self, name: str) -> tuple[KeyValue, dict[str, Any], str | None] | None:
        """The etcd record of a durable subscription this node does not hold (its key-value, its
        state and its holder, if any), or None: no such subscription, claimed but never defined,
        or held here after all (the caller looked here first)."""
        try:
            kv = await self.node.state_store.get(self.handover.key(name))
        except EtcdError as exc:
            raise ShardUnavailable(
                f"durable subscription {name!r} cannot be looked up in etcd now ({exc}); retry"
            ) from exc
        if kv is None:
            return None
        try:
            state = decode_record(kv.value)
        except ValueError as exc:
            self.handover.set_aside(f"durable subscription {name!r}", kv, exc)
            return None
        holder = state.get("node")
        if "type" not in state or holder == self.node.node_id:
            return None
        return kv, state, None if holder is None else str(holder)

    async def delete(self, name: str) -> bool:
        """Delete a durable subscription this node does not hold: on its holder, or, with the
        holder down, its record in etcd (the holder drops its copy when it comes back,
        `drop_moved`). False: no node holds it (nor any before the node has joined)."""
        if self.handover.edge is None:
            return False
        found = await self._held_elsewhere(name)
        if found is None:
            return False
        kv, state, holder = found
        if holder in self.node.view.nodes():
            try:
                call = self.rpc.channel(str(holder)).unary_unary(
                    f"/{CONSUMERS_SERVICE}/{DELETE}",
                    request_serializer=pb.SubscriptionName.SerializeToString,
                    response_deserializer=pb.Empty.FromString)
                await call(pb.SubscriptionName(name=name), timeout=DESCRIBE_TIMEOUT_S)
                return True
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.NOT_FOUND:
                    return False
                raise ShardUnavailable(f"node {holder}, which holds durable subscription {name!r}, "
                                       f"did not delete it ({exc.code().name}); retry") from None
            except StateCallError as exc:
                raise ShardUnavailable(f"node {holder}, which holds durable subscription {name!r}, "
                                       f"cannot be reached ({exc}); retry") from None
        try:
            deleted = await self.node.state_store.delete_unchanged(self.handover.key(name), kv.mod_revision)
        except EtcdError as exc:
            raise ShardUnavailable(f"durable subscription {name!r} cannot be deleted in etcd now "
                                   f"({exc}); retry") from exc
        if not deleted:
            raise ShardUnavailable(f"durable subscription {name!r} changed meanwhile; retry")
        return True

    async def describe(self, name: str) -> pb.SubscriptionInfo | None:
        """A durable subscription this node does not hold, as its holder describes it (with
        the consumers of every node, all attached there); when the holder is down, as its last
        checkpoint in etcd says, with no consumer. None: no node holds it (nor any before the
        node has joined)."""
        if self.handover.edge is None:
            return None
        found = await self._held_elsewhere(name)
        if found is None:
            return None
        _kv, state, holder = found
        if holder in self.node.view.nodes():
            try:
                channel = self.rpc.channel(str(holder))
                call = channel.unary_unary(
                    f"/{CONSUMERS_SERVICE}/{DESCRIBE}",
                    request_serializer=pb.SubscriptionName.SerializeToString,
                    response_deserializer=pb.SubscriptionInfo.FromString)
                info: pb.SubscriptionInfo = await call(pb.SubscriptionName(name=name),
                                                       timeout=DESCRIBE_TIMEOUT_S)
                return info
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.NOT_FOUND:
                    return None  # given up or deleted meanwhile
                log.info("cluster: node %s did not describe subscription %r (%s); answering "
                         "from its last checkpoint", holder, name, exc.code().name)
            except StateCallError as exc:
                log.info("cluster: cannot reach node %s to describe subscription %r (%s); "
                         "answering from its last checkpoint", holder, name, exc)
        owner = state.get("owner") or {}
        return pb.SubscriptionInfo(
            name=name, type=SUB_TYPES_OUT[SubscriptionType(state["type"])], durable=True,
            topic_filters=list(state.get("filters", [])), protocol=str(owner.get("protocol", "grpc")))

    async def consume_remotely(self, holder: str, first: pb.ConsumeRequest,
                               requests: AsyncIterator[pb.ConsumeRequest],
                               context: grpc.aio.ServicerContext, user: str | None) -> None:
        """Serve a consumer of this node through `holder`: relay its stream both ways until
        either end finishes; a holder that goes away ends it with UNAVAILABLE (retry here)."""
        name = first.subscribe.subscription
        try:
            channel = self.rpc.channel(holder)
        except StateCallError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"durable subscription {name!r} is consumed on node {holder}: {exc}; retry")
            return
        metadata: list[tuple[str, str]] = [(SUBSCRIPTION_HEADER, name)]
        if user is not None:  # authenticated here; the holder authorizes it as this user
            metadata.append(("authorization", "Basic " + base64.b64encode(f"{user}:".encode()).decode()))
        call = channel.stream_stream(
            f"/{CONSUMERS_SERVICE}/{CONSUME}",
            request_serializer=pb.ConsumeRequest.SerializeToString,
            response_deserializer=pb.ConsumeResponse.FromString,
        )(metadata=tuple(metadata))

        async def upstream() -> None:
            await call.write(first)
            async for request in requests:
                await call.write(request)
            await call.done_writing()

        sender = asyncio.ensure_future(upstream())
        sender.add_done_callback(lambda task: task.cancelled() or task.exception())
        relays = self._relays.setdefault(holder, set())
        relays.add(call)
        failure: grpc.aio.AioRpcError | None = None
        left = False
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    break
                await context.write(response)
        except grpc.aio.AioRpcError as exc:
            failure = exc
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError in the reader of a call cancelled elsewhere: here
            # `_view_changed` (the holder left), unless this task itself is being cancelled
            task = asyncio.current_task()
            if not call.cancelled() or self._relays.get(holder) is relays or (
                    task is not None and task.cancelling()):
                raise
            left = True
        finally:
            sender.cancel()
            call.cancel()
            relays.discard(call)
            if not relays and self._relays.get(holder) is relays:
                del self._relays[holder]
        if left:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"node {holder}, where durable subscription {name!r} is consumed, "
                                "left the cluster; retry")
            return
        if failure is None:
            return
        code, details = failure.code(), failure.details() or ""
        if code in _HOLDER_GONE:
            code = grpc.StatusCode.UNAVAILABLE
            details = (f"node {holder}, where durable subscription {name!r} is consumed, ended "
                       f"the stream ({details}); retry")
        await context.abort(code, details)
