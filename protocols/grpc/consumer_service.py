"""The `Consumer` servicer: one bidirectional `Subscribe` stream per consumer, with credit-based
flow control, acks and nacks (the consumer's state is `consumer.GrpcConsumer`).

In a cluster a durable subscription is consumed on one node, its holder. A consumer that
subscribes on another node while the holder has consumers is served through the holder: its
stream is relayed there (`GrpcServer.consume_remotely`), so that Shared round robin, Failover
standby and the Exclusive refusal run at the one cursor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import grpc

from ...core.durable import DurableSubscription
from ...core.edge import Action
from ...core.errors import (
    CoreError,
    SubscriptionBusy,
)
from ...core.outbox import SLOW_SUBSCRIBER
from ...core.streams import Stream
from ...core.topics import TopicError, validate_topic_filter
from ...proto import shardgate_pb2 as pb
from ...proto import shardgate_pb2_grpc as pb_grpc
from .auth import peer_of, user_of
from .consumer import GrpcConsumer, GrpcSubscriptionState, hand_over
from .convert import (
    SUB_TYPES,
    Refusal,
    abort,
    is_transient,
    protocol_of,
    seek_to,
    status_for,
    translated,
)

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .server import GrpcServer


SUBSCRIBE_TIMEOUT_S = 30.0

# (holder node id, the Subscribe request, the stream's later requests, the call, its user)
ConsumeRemotely = Callable[
    [str, pb.ConsumeRequest, AsyncIterator[pb.ConsumeRequest], grpc.aio.ServicerContext, "str | None"],
    Awaitable[None],
]


class ConsumerService(pb_grpc.ConsumerServicer):
    def __init__(self, server: GrpcServer) -> None:
        self.server = server

    async def Subscribe(
        self, request_iterator: AsyncIterator[pb.ConsumeRequest], context: grpc.aio.ServicerContext
    ) -> None:
        requests = aiter(request_iterator)
        try:
            first = await asyncio.wait_for(anext(requests), SUBSCRIBE_TIMEOUT_S)
        except StopAsyncIteration:
            return
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no Subscribe request within {SUBSCRIBE_TIMEOUT_S:.0f}s")
            return
        if first.WhichOneof("request") != "subscribe":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "the first request of a Subscribe stream must be a Subscribe")
            return
        subscribe = first.subscribe
        find_elsewhere = self.server.edge.find_durable_elsewhere
        if find_elsewhere is not None and subscribe.durable and subscribe.subscription \
                and subscribe.subscription not in self.server.edge.subscriptions:
            # cluster: the durable subscription (its cursors) may live on another node
            try:
                holder = await find_elsewhere(subscribe.subscription)
            except CoreError as exc:  # etcd unreachable, say: UNAVAILABLE, retryable
                await context.abort(status_for(exc), str(exc))
                return
            if holder is not None:
                remote = self.server.consume_remotely
                if remote is None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"durable subscription {subscribe.subscription!r} is "
                                        f"consumed on node {holder}")
                    return
                await remote(holder, first, requests, context, user_of(context))
                return
        try:
            consumer = self._attach(subscribe, peer_of(context), user_of(context))
        except Refusal as refusal:
            await abort(context, refusal)
            return
        server = self.server
        consumer.user = user_of(context)
        server.consumers.add(consumer)
        log.info("%s: gRPC consumer %s of %r connected", consumer.peer, consumer.id,
                 subscribe.subscription,
                 extra={"event": "client_connected", "protocol": "grpc", "client_id": consumer.id,
                        "peer": consumer.peer})
        reason = "stream ended"
        reader = asyncio.ensure_future(self._read(requests, consumer))
        try:
            await self._write(consumer, reader, context)
        except asyncio.CancelledError:
            reason = "stream cancelled"
            raise
        finally:
            reader.cancel()
            server.consumers.discard(consumer)
            self._detach(consumer)
            if consumer.denied is not None:
                reason = f"permission denied: {consumer.denied}"
            elif consumer.kicked is not None:
                reason = f"kicked: {consumer.kicked}"
            log.info("%s: gRPC consumer %s disconnected: %s", consumer.peer, consumer.id, reason,
                     extra={"event": "client_disconnected", "protocol": "grpc",
                            "client_id": consumer.id, "peer": consumer.peer, "reason": reason})

    def _attach(self, request: pb.Subscribe, peer: str, user: str | None = None) -> GrpcConsumer:
        server = self.server
        edge = server.edge
        settings = server.settings
        name = request.subscription
        if not name:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "a subscription name is required")
        filters = list(request.topic_filters)
        if filters and request.stream:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          "give topic filters or a stream, not both")
        if not filters and not request.stream:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "give topic filters or a stream")
        for topic_filter in filters:
            try:
                validate_topic_filter(topic_filter)
            except TopicError as exc:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"topic filter {topic_filter!r}: {exc}") from None
            if topic_filter.startswith("$share/"):
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              "use a Shared subscription instead of a $share/ filter")
        stream_name = request.stream or None
        if stream_name is not None:
            with translated():
                stream = edge.stream(stream_name)
            if stream_name == edge.default_stream:
                filters = ["#"]
            else:
                filters = [rule.topic_filter for rule in edge.routes
                           if rule.stream == stream_name] or [stream_name, f"{stream_name}/#"]
            self._check_position(request.position, [stream])
        else:
            self._check_position(request.position, list(edge.streams.values()))
        for topic_filter in filters:
            if not server.allowed(Action.SUBSCRIBE, user, topic_filter):
                raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                              f"not authorized to subscribe to {topic_filter!r}"
                              + (f" as user {user!r}" if user is not None else " anonymously"))
        sub_type = SUB_TYPES.get(request.type)
        if sub_type is None:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"unknown subscription type {request.type}")
        existing = edge.subscriptions.get(name)
        if existing is not None:
            if not isinstance(existing.owner, GrpcSubscriptionState):
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"subscription {name!r} belongs to {protocol_of(existing)}")
            if existing.type is not sub_type:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"subscription {name!r} is {existing.type.value}, not {sub_type.value}")
            if set(existing.filters) != set(filters) or existing.owner.stream != stream_name:
                raise Refusal(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"subscription {name!r} follows {sorted(existing.filters)}; "
                    "its consumers must subscribe to the same filters or stream",
                )
            sub = existing
            if request.max_deliveries and request.max_deliveries != existing.owner.max_deliveries:
                existing.owner.max_deliveries = request.max_deliveries
                if isinstance(existing, DurableSubscription):
                    edge.durable_changed(existing)  # saved with it
        else:
            replay = (not request.durable and request.HasField("position")
                      and request.position.WhichOneof("position") not in (None, "latest"))
            state = GrpcSubscriptionState(
                stream=stream_name, transient=replay,
                max_deliveries=request.max_deliveries or settings.max_deliveries)
            if replay:
                sub = edge.durable_subscription(name, sub_type, owner=state)
                sub.sink = None  # its cursors are not saved: it ends with its consumers
            elif request.durable:
                sub = edge.durable_subscription(name, sub_type, owner=state)
            else:
                sub = edge.subscription(name, sub_type, owner=state)
        if isinstance(sub, DurableSubscription) and isinstance(sub.owner, GrpcSubscriptionState):
            sub.options.max_deliveries = sub.owner.max_deliveries
        consumer = GrpcConsumer(
            sub, request.consumer_name, peer,
            credit=request.credit or settings.default_credit,
            max_pending=settings.max_pending_per_consumer,
            max_batch=settings.max_batch_messages,
            on_drop=self._count_drop,
            on_sent=edge.stats.sent,
        )
        try:
            edge.attach(sub, consumer)
        except SubscriptionBusy as exc:
            if existing is None and not sub.consumers:
                edge.remove_subscription(name)
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
        if existing is None:
            for topic_filter in filters:
                edge.add_filter(sub, topic_filter)
        # The initial position applies when the subscription is created; an existing durable
        # subscription resumes from its cursors (reset them with ResetCursor).
        if isinstance(sub, DurableSubscription) and existing is None and request.HasField("position"):
            seek_to(sub, request.position)
        return consumer

    @staticmethod
    def _check_position(position: pb.StartPosition, streams: list[Stream]) -> None:
        which = position.WhichOneof("position")
        if which == "offset":
            end = max((shard.next_offset for stream in streams for shard in stream.shards),
                      default=0)
            if position.offset > end:
                raise Refusal(grpc.StatusCode.OUT_OF_RANGE,
                              f"start offset {position.offset} is beyond the end of the "
                              f"stream (next offset {end})")
        elif which == "timestamp_ms" and position.timestamp_ms < 0:
            raise Refusal(grpc.StatusCode.OUT_OF_RANGE, "start timestamp must not be negative")

    def _count_drop(self, count: int) -> None:
        # Past `max_pending` the oldest pending message of a live-only subscription is dropped.
        self.server.edge.stats.drop(SLOW_SUBSCRIBER, count)

    async def _read(self, requests: AsyncIterator[pb.ConsumeRequest], consumer: GrpcConsumer) -> None:
        try:
            async for request in requests:
                kind = request.WhichOneof("request")
                if kind == "ack":
                    unknown = consumer.ack(request.ack.delivery_ids)
                    if unknown:
                        consumer.error(grpc.StatusCode.NOT_FOUND.value[0],
                                       "ack of unknown or already settled deliveries", unknown)
                elif kind == "nack":
                    unknown = consumer.nack(request.nack.delivery_ids, request.nack.delay_ms)
                    if unknown:
                        consumer.error(grpc.StatusCode.NOT_FOUND.value[0],
                                       "nack of unknown or already settled deliveries", unknown)
                elif kind == "credit":
                    consumer.add_credit(request.credit.credit)
                elif kind == "subscribe":
                    consumer.error(grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                   "this stream is already subscribed")
                else:
                    consumer.error(grpc.StatusCode.INVALID_ARGUMENT.value[0], "empty request")
        finally:
            consumer.wakeup.set()

    async def _write(self, consumer: GrpcConsumer, reader: asyncio.Future[None],
                     context: grpc.aio.ServicerContext) -> None:
        # In a cluster, Subscribed waits (bounded) until the other nodes know the subscription,
        # so a message published anywhere after it reaches this consumer.
        ready = self.server.edge.routes_ready()
        if ready is not None:
            await ready
        active = consumer.active
        await context.write(pb.ConsumeResponse(subscribed=pb.Subscribed(
            subscription=consumer.subscription.name, consumer_id=consumer.id, active=active)))
        wakeup = consumer.wakeup
        while True:
            await wakeup.wait()
            wakeup.clear()
            if consumer.errors:
                errors, consumer.errors = consumer.errors, []
                for error in errors:
                    await context.write(pb.ConsumeResponse(error=error))
            now_active = consumer.active
            if now_active != active:
                active = now_active
                await context.write(pb.ConsumeResponse(status=pb.ConsumerStatus(active=active)))
            if consumer.closed:
                # Nothing more is pushed: what is pending goes to other consumers on detach.
                if consumer.denied is not None:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, consumer.denied)
                if consumer.kicked is not None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, consumer.kicked)
                if consumer.subscription.name not in self.server.edge.subscriptions:
                    await context.abort(grpc.StatusCode.NOT_FOUND,
                                        f"subscription {consumer.subscription.name!r} was deleted")
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
            while True:
                response = consumer.take_batch()
                if response is None:
                    break
                await context.write(response)
            if reader.done():
                return

    def _detach(self, consumer: GrpcConsumer) -> None:
        edge = self.server.edge
        sub = consumer.subscription
        left = consumer.close()
        edge.detach(sub, consumer)
        if sub.consumers:
            hand_over(sub, left)
            for other in list(sub.consumers):
                if isinstance(other, GrpcConsumer):
                    other.wakeup.set()  # a Failover standby may be active now
        elif (not sub.durable or is_transient(sub)) and edge.subscriptions.get(sub.name) is sub:
            edge.remove_subscription(sub.name)
        elif sub.durable:
            hand_over(sub, left)
            # its last consumer left: saved again at once, so a cluster writes its checkpoint
            # now (another node takes it over from there if this one dies), not a round later
            if isinstance(sub, DurableSubscription):
                edge.durable_changed(sub)
