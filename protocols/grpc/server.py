"""The gRPC listener: `Producer`, `Consumer` and `Admin` servicers on the core, over grpc.aio.

`start_grpc_server(edge, host, port, tls)` is what the composition root calls. The server runs on
the broker's own event loop, so servicers call the core's front door (`core.edge.Edge`) directly. Core errors are translated
here, at the edge, into gRPC status codes with a message (see the table in `shardgate.proto`);
nothing a client sends should end in UNKNOWN/INTERNAL or a hang.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import inspect
import itertools
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc

from ... import __version__
from ...core.broker import Broker
from ...core.edge import KICK_REASON, Action, ClientInfo, Edge, Principal, Receipt
from ...core.errors import (
    CoreError,
    InvalidStreamConfig,
    PublishRejected,
    SchemaMismatch,
    StreamExists,
    StreamNotFound,
    SubscriptionBusy,
)
from ...core.message import Message
from ...core.streams import DispatchMode, RoutingRule, Schema, Stream, StreamConfig
from ...core.subscriptions import Subscription, SubscriptionType
from ...core.topics import TopicError, validate_topic_filter, validate_topic_name
from ...proto import shardgate_pb2 as pb
from ...proto import shardgate_pb2_grpc as pb_grpc
from .consumer import GrpcConsumer, GrpcSubscriptionState, hand_over
from .settings import DEFAULT_PORT, GrpcSettings

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PORT", "GrpcServer", "start_grpc_server"]

MODES = {
    pb.DISPATCH_MODE_UNSPECIFIED: DispatchMode.NON_RELIABLE,
    pb.DISPATCH_MODE_NON_RELIABLE: DispatchMode.NON_RELIABLE,
    pb.DISPATCH_MODE_RELIABLE: DispatchMode.RELIABLE,
}
MODES_OUT = {DispatchMode.NON_RELIABLE: pb.DISPATCH_MODE_NON_RELIABLE,
             DispatchMode.RELIABLE: pb.DISPATCH_MODE_RELIABLE}
SCHEMAS = {
    pb.SCHEMA_UNSPECIFIED: Schema.BYTES,
    pb.SCHEMA_BYTES: Schema.BYTES,
    pb.SCHEMA_STRING: Schema.STRING,
    pb.SCHEMA_INT64: Schema.INT64,
    pb.SCHEMA_JSON: Schema.JSON,
}
SCHEMAS_OUT = {schema: code for code, schema in SCHEMAS.items() if code != pb.SCHEMA_UNSPECIFIED}
SUB_TYPES = {
    pb.SUBSCRIPTION_TYPE_UNSPECIFIED: SubscriptionType.EXCLUSIVE,
    pb.SUBSCRIPTION_TYPE_EXCLUSIVE: SubscriptionType.EXCLUSIVE,
    pb.SUBSCRIPTION_TYPE_SHARED: SubscriptionType.SHARED,
    pb.SUBSCRIPTION_TYPE_FAILOVER: SubscriptionType.FAILOVER,
}
SUB_TYPES_OUT = {value: code for code, value in SUB_TYPES.items()
                 if code != pb.SUBSCRIPTION_TYPE_UNSPECIFIED}
SUBSCRIBE_TIMEOUT_S = 30.0
PUBLISH_QUEUE_BATCHES = 256
_producer_ids = itertools.count(1)



class Refusal(Exception):
    """A request the API refuses: a gRPC status code and the reason."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _status_for(exc: CoreError) -> grpc.StatusCode:
    if isinstance(exc, StreamNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, StreamExists):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(exc, InvalidStreamConfig | TopicError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, SubscriptionBusy):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, PublishRejected):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.FAILED_PRECONDITION


@contextlib.contextmanager
def _translated() -> Any:
    """Turn core errors raised inside the block into `Refusal`s."""
    try:
        yield
    except CoreError as exc:
        raise Refusal(_status_for(exc), str(exc)) from exc


@dataclass(slots=True, eq=False)
class ProducerStreamInfo:
    """A live `PublishStream`, listed by `Admin.ListClients`."""

    peer: str
    name: str
    connected_at: float = field(default_factory=time.time)
    messages_in: int = 0
    id: str = field(default_factory=lambda: f"grpc-producer-{next(_producer_ids)}")
    username: str | None = None
    # Set by `kick`: the stream ends with UNAVAILABLE and this reason once the batches already
    # read are acknowledged.
    kicked: str | None = None
    _reader: asyncio.Future[None] | None = field(default=None, repr=False)

    def kick(self, reason: str = KICK_REASON) -> None:
        """Disconnect this producer stream (the admin API's kick): batches it sent and the
        server has not read yet are not published, and the SDK resends them on reconnect."""
        if self.kicked is None:
            self.kicked = reason
        if self._reader is not None:
            self._reader.cancel()


class GrpcServer:
    """The bound gRPC server; `close()` and `await wait_closed()` stop it."""

    def __init__(self, edge: Edge, settings: GrpcSettings | None = None) -> None:
        self.edge = edge
        self.settings = settings or GrpcSettings()
        self.consumers: set[GrpcConsumer] = set()
        self.producers: set[ProducerStreamInfo] = set()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._closing: asyncio.Task[None] | None = None
        self._topic_ok: set[str] = set()
        self._registered = _RegisteredClients(self)

    def allowed(self, action: Action, user: str | None, topic: str) -> bool:
        return self.edge.authorize(_principal(user), action, topic)

    def kick(self, client_id: str, reason: str = KICK_REASON) -> int:
        """Disconnect the gRPC streams of `client_id` (a consumer id, or a producer's id, name or
        peer as `clients()` lists them); returns how many streams were ended."""
        kicked = 0
        for consumer in list(self.consumers):
            if consumer.id == client_id and not consumer.closed:
                consumer.kick(reason)
                kicked += 1
        for producer in list(self.producers):
            if client_id in (producer.id, producer.name or producer.peer) and producer.kicked is None:
                producer.kick(reason)
                kicked += 1
        return kicked

    @property
    def broker(self) -> Broker:
        return self.edge.broker

    async def start(self, host: str, port: int, credentials: grpc.ServerCredentials | None) -> None:
        settings = self.settings
        options = [
            ("grpc.max_receive_message_length", settings.max_receive_message_bytes),
            ("grpc.max_send_message_length", settings.max_send_message_bytes),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(options=options, interceptors=[AuthInterceptor(self)])
        pb_grpc.add_ProducerServicer_to_server(ProducerService(self), server)
        pb_grpc.add_ConsumerServicer_to_server(ConsumerService(self), server)
        pb_grpc.add_AdminServicer_to_server(AdminService(self), server)
        address = f"{host}:{port}"
        if port:
            _check_port_free(host, port)
        try:
            if credentials is None:
                bound = server.add_insecure_port(address)
            else:
                bound = server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise OSError(f"cannot bind gRPC listener on {address}: {exc}") from exc
        if bound == 0:
            raise OSError(f"cannot bind gRPC listener on {address}")
        await server.start()
        self.server = server
        self.port = bound
        self.edge.clients.register("grpc", self._registered)

    def close(self) -> None:
        if self.server is not None and self._closing is None:
            for consumer in list(self.consumers):
                consumer.closed = True
                consumer.wakeup.set()
            self.edge.clients.unregister("grpc", self._registered)
            self._closing = asyncio.ensure_future(self.server.stop(grace=1.0))

    async def wait_closed(self) -> None:
        if self._closing is None:
            self.close()
        if self._closing is not None:
            await self._closing

    # ---------------------------------------------------------------- publishing
    def message_from(self, request: pb.PublishRequest, producer_id: str,
                     user: str | None = None) -> Message:
        """Validate and authorize a publish request, build the core message; raises `Refusal`."""
        topic = request.topic
        if not topic:
            if not request.stream:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "a message needs a topic or a stream")
            topic = request.stream
        if topic not in self._topic_ok:
            try:
                validate_topic_name(topic)
            except TopicError as exc:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"topic {topic!r}: {exc}") from None
            if len(self._topic_ok) > 100_000:
                self._topic_ok.clear()
            self._topic_ok.add(topic)
        if not self.edge.authorize(_principal(user), Action.PUBLISH, topic):
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                          f"not authorized to publish to {topic!r}"
                          + (f" as user {user!r}" if user is not None else " anonymously"))
        payload = request.payload
        if len(payload) > self.settings.max_payload_bytes:
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"payload of {len(payload)} bytes exceeds the limit of "
                f"{self.settings.max_payload_bytes} bytes",
            )
        broker = self.broker
        stream: Stream = broker.stream_for_topic(topic)
        if request.stream and stream.config.name != request.stream:
            if request.stream not in broker.streams:
                raise Refusal(grpc.StatusCode.NOT_FOUND, f"stream {request.stream!r} does not exist")
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"topic {topic!r} resolves to stream {stream.config.name!r}, not {request.stream!r}",
            )
        # The stream's schema is checked once, by the core's publish (see `publish`).
        message = Message(topic, payload, qos=1, retain=request.retain,
                          producer_protocol="grpc", producer_id=request.producer_name or producer_id)
        if request.HasField("key"):
            message.key = request.key
        if request.headers:
            message.headers = [(h.key, h.value) for h in request.headers]
            for key, value in message.headers:
                _check_text("header name", key)
                _check_text(f"header {key!r}", value)
        if request.content_type:
            _check_text("content_type", request.content_type)
            message.content_type = request.content_type
        if request.correlation_data:
            message.correlation_data = request.correlation_data
        if request.reply_to:
            _check_text("reply_to", request.reply_to)
            message.reply_to = request.reply_to
        if request.ttl_ms:
            message.expires_at_ms = message.publish_time_ms + request.ttl_ms
        return message

    def publish(self, message: Message) -> Receipt:
        try:
            return self.edge.publish(message)
        except SchemaMismatch as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except PublishRejected as exc:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc

    # ---------------------------------------------------------------- admin views
    def stream_info(self, stream: Stream) -> pb.StreamInfo:
        broker = self.broker
        config = stream.config
        info = pb.StreamInfo(
            name=config.name,
            mode=MODES_OUT[config.mode],
            partitions=config.partitions,
            schema=SCHEMAS_OUT[config.schema],
            routes=[rule.topic_filter for rule in broker.router.rules if rule.stream == config.name],
            shards=[pb.ShardInfo(index=shard.index, next_offset=shard.next_offset)
                    for shard in stream.shards],
            is_default=config.name == broker.router.default_stream,
        )
        if config.retention_ms is not None:
            info.retention_ms = config.retention_ms
        if config.retention_bytes is not None:
            info.retention_bytes = config.retention_bytes
        for sub in list(broker.subscriptions.values()):
            state = sub.owner
            if isinstance(state, GrpcSubscriptionState) and state.stream == config.name:
                info.subscriptions.add(name=sub.name, lag=_lag(sub))
        return info

    def subscription_info(self, sub: Subscription) -> pb.SubscriptionInfo:
        info = pb.SubscriptionInfo(
            name=sub.name, type=SUB_TYPES_OUT[sub.type], durable=sub.durable and not _transient(sub),
            topic_filters=list(sub.filters), protocol=_protocol_of(sub),
        )
        active = sub.active_consumer
        for consumer in list(sub.consumers):
            entry = info.consumers.add(
                consumer_id=str(consumer.consumer_id),
                active=sub.type is SubscriptionType.SHARED or consumer is active,
            )
            if isinstance(consumer, GrpcConsumer):
                entry.protocol = "grpc"
                entry.unacked = consumer.unacked
                entry.credit = max(consumer.credit, 0)
                entry.delivered = consumer.delivered
            else:
                entry.protocol = _protocol_of(sub)
        return info

    def clients(self) -> list[pb.ClientInfo]:
        """Every connected client of every protocol, from the front door's registry."""
        return [
            pb.ClientInfo(
                protocol=client.protocol, client_id=client.client_id,
                username=client.username or "", remote=client.remote,
                connected_at=client.connected_at, messages_in=client.messages_in or 0,
                messages_out=client.messages_out or 0, detail=client.detail.lower(),
            )
            for client in self.edge.clients.list()
        ]

    # ---------------------------------------------------------------- client registry
    def registered_clients(self) -> list[ClientInfo]:
        """This listener's own streams, for the front door's registry."""
        out: list[ClientInfo] = []
        for producer in list(self.producers):
            out.append(ClientInfo(
                "grpc", producer.name or producer.peer, producer.username, producer.peer, "http2",
                producer.connected_at, producer.messages_in, None, "producer", kickable=False,
            ))
        for consumer in list(self.consumers):
            out.append(ClientInfo(
                "grpc", consumer.id, None, consumer.peer, "http2", consumer.connected_at, None,
                consumer.delivered, f"consumer of {consumer.subscription.name}",
            ))
        return out


class _RegisteredClients:
    """The `ClientSource` of one `GrpcServer` (its `clients()` is the full cross-protocol list)."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server

    def clients(self) -> list[ClientInfo]:
        return self.server.registered_clients()

    def kick(self, client_id: str, reason: str = KICK_REASON) -> int:
        return self.server.kick(client_id, reason)


def _offset_landed(result: Any, message: Message, _: object) -> None:
    """A forwarded publish landed: its result carries the offset the shard's owner gave."""
    result.offset = max(message.offset, 0)


def _protocol_of(sub: Subscription) -> str:
    owner = sub.owner
    if isinstance(owner, GrpcSubscriptionState):
        return "grpc"
    module = type(owner).__module__ if owner is not None else ""
    for protocol in ("mqtt", "amqp"):
        if f".{protocol}." in module:
            return protocol
    return "core" if owner is None else type(owner).__name__.lower()


def _lag(sub: Subscription) -> int:
    lag = getattr(sub, "lag", None)  # durable subscriptions (cursor seam)
    if callable(lag):
        return int(lag())
    return int(lag or 0)


async def _abort(context: grpc.aio.ServicerContext, refusal: Refusal) -> None:
    await context.abort(refusal.code, refusal.reason)


def _user(context: grpc.aio.ServicerContext) -> str | None:
    """The user name the call authenticated as (None: anonymous or a bearer token)."""
    try:
        credentials = credentials_from_metadata(context.invocation_metadata())
    except Exception:  # noqa: BLE001 - no metadata: anonymous
        return None
    return credentials[0] if credentials is not None else None


def _peer(context: grpc.aio.ServicerContext) -> str:
    try:
        return context.peer() or ""
    except Exception:  # noqa: BLE001 - a peer name is only informative
        return ""


# ---------------------------------------------------------------------------- Producer
class ProducerService(pb_grpc.ProducerServicer):
    def __init__(self, server: GrpcServer) -> None:
        self.server = server

    async def Publish(self, request: pb.PublishRequest, context: grpc.aio.ServicerContext) -> pb.PublishResponse:
        server = self.server
        try:
            message = server.message_from(request, _peer(context), _user(context))
            waiter = server.publish(message)
            if waiter is not None:
                try:
                    await waiter
                except Exception as exc:
                    raise Refusal(grpc.StatusCode.UNAVAILABLE,
                                  f"the message could not be stored: {exc}") from exc
        except Refusal as refusal:
            await _abort(context, refusal)
            raise  # unreachable: abort raises
        return pb.PublishResponse(stream=message.stream, shard=message.shard, offset=message.offset)

    async def PublishStream(
        self, request_iterator: AsyncIterator[pb.PublishBatch], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PublishAck]:
        server = self.server
        info = ProducerStreamInfo(peer=_peer(context), name="", username=_user(context))
        server.producers.add(info)
        queue: asyncio.Queue[tuple[pb.PublishAck, list[asyncio.Future[None]]] | None] = (
            asyncio.Queue(PUBLISH_QUEUE_BATCHES)
        )

        async def read() -> None:
            try:
                async for batch in request_iterator:
                    await queue.put(self._publish_batch(batch, info))
            finally:
                await queue.put(None)

        reader = info._reader = asyncio.ensure_future(read())
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                ack, waiters = item
                if waiters:
                    await self._await_durable(ack, waiters)
                yield ack
            if info.kicked is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, info.kicked)
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                exc = reader.exception()
                if not isinstance(exc, asyncio.CancelledError | grpc.aio.AbortError):
                    log.debug("publish stream from %s ended: %r", info.peer, exc)
        finally:
            reader.cancel()
            server.producers.discard(info)

    def _publish_batch(
        self, batch: pb.PublishBatch, info: ProducerStreamInfo
    ) -> tuple[pb.PublishAck, list[asyncio.Future[None]]]:
        server = self.server
        ack = pb.PublishAck(sequence=batch.sequence)
        results = ack.results
        waiters: list[asyncio.Future[None]] = []
        producer_id = info.name or info.peer
        user = info.username
        message_from, publish = server.message_from, server.publish
        for request in batch.messages:
            if not info.name and request.producer_name:
                info.name = request.producer_name
            try:
                message = message_from(request, producer_id, user)
                waiter = publish(message)
            except Refusal as refusal:
                results.add(code=refusal.code.value[0], error=refusal.reason)
                continue
            result = results.add(stream=message.stream, shard=message.shard)
            if message.offset >= 0:
                result.offset = message.offset
            if waiter is not None:
                waiters.append(waiter)
                if message.offset < 0:  # forwarded to the shard's owner: the offset comes back
                    waiter.add_done_callback(partial(_offset_landed, result, message))
        info.messages_in += len(batch.messages)
        return ack, waiters

    @staticmethod
    async def _await_durable(ack: pb.PublishAck, waiters: list[asyncio.Future[None]]) -> None:
        outcomes = await asyncio.gather(*set(waiters), return_exceptions=True)
        failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failure is not None:
            # Which messages shared the failed commit is not tracked per message: fail them all.
            for result in ack.results:
                if result.code == 0:
                    result.code = grpc.StatusCode.UNAVAILABLE.value[0]
                    result.error = f"the message could not be stored: {failure}"


# ---------------------------------------------------------------------------- Consumer
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
        try:
            consumer = self._attach(first.subscribe, _peer(context), _user(context))
        except Refusal as refusal:
            await _abort(context, refusal)
            return
        server = self.server
        server.consumers.add(consumer)
        reader = asyncio.ensure_future(self._read(requests, consumer))
        try:
            await self._write(consumer, reader, context)
        finally:
            reader.cancel()
            server.consumers.discard(consumer)
            self._detach(consumer)

    def _attach(self, request: pb.Subscribe, peer: str, user: str | None = None) -> GrpcConsumer:
        server = self.server
        broker = server.broker
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
            with _translated():
                stream = broker.stream(stream_name)
            if stream_name == broker.router.default_stream:
                filters = ["#"]
            else:
                filters = [rule.topic_filter for rule in broker.router.rules
                           if rule.stream == stream_name] or [stream_name, f"{stream_name}/#"]
            self._check_position(request.position, [stream])
        else:
            self._check_position(request.position, list(broker.streams.values()))
        for topic_filter in filters:
            if not server.allowed(Action.SUBSCRIBE, user, topic_filter):
                raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                              f"not authorized to subscribe to {topic_filter!r}"
                              + (f" as user {user!r}" if user is not None else " anonymously"))
        sub_type = SUB_TYPES.get(request.type)
        if sub_type is None:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"unknown subscription type {request.type}")
        existing = broker.subscriptions.get(name)
        if existing is not None:
            if not isinstance(existing.owner, GrpcSubscriptionState):
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"subscription {name!r} belongs to {_protocol_of(existing)}")
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
        else:
            replay = (not request.durable and request.HasField("position")
                      and request.position.WhichOneof("position") not in (None, "latest"))
            state = GrpcSubscriptionState(stream=stream_name, transient=replay)
            if replay:
                sub = broker.durable_subscription(name, sub_type, owner=state)
                sub.sink = None  # its cursors are not saved: it ends with its consumers
            else:
                sub = broker.subscription(name, sub_type, durable=request.durable, owner=state)
        consumer = GrpcConsumer(
            sub, request.consumer_name, peer,
            credit=request.credit or settings.default_credit,
            max_pending=settings.max_pending_per_consumer,
            max_batch=settings.max_batch_messages,
            on_drop=self._count_drop,
            on_sent=broker.stats.sent,
        )
        try:
            broker.attach(sub, consumer)
        except SubscriptionBusy as exc:
            if existing is None and not sub.consumers:
                broker.remove_subscription(name)
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
        if existing is None:
            for topic_filter in filters:
                broker.add_filter(sub, topic_filter)
        seek = getattr(sub, "seek", None)  # durable subscriptions (cursor seam)
        # The initial position applies when the subscription is created; an existing durable
        # subscription resumes from its cursors (reset them with ResetCursor).
        if callable(seek) and existing is None and request.HasField("position"):
            seek(request.position.WhichOneof("position"),
                 getattr(request.position, request.position.WhichOneof("position") or "latest"))
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
        self.server.broker.stats.messages_dropped += count

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
                if consumer.kicked is not None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, consumer.kicked)
                if consumer.subscription.name not in self.server.broker.subscriptions:
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
        broker = self.server.broker
        sub = consumer.subscription
        left = consumer.close()
        broker.detach(sub, consumer)
        if sub.consumers:
            hand_over(sub, left)
            for other in list(sub.consumers):
                if isinstance(other, GrpcConsumer):
                    other.wakeup.set()  # a Failover standby may be active now
        elif (not sub.durable or _transient(sub)) and broker.subscriptions.get(sub.name) is sub:
            broker.remove_subscription(sub.name)
        elif sub.durable:
            hand_over(sub, left)


def _check_port_free(host: str, port: int) -> None:
    """Raise OSError(EADDRINUSE) when another socket listens on host:port, before gRPC's core
    tries and logs its own raw failure line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # let gRPC report the address it cannot resolve
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(errno.EADDRINUSE, f"{host}:{port} is already in use") from None


def _transient(sub: Subscription) -> bool:
    return bool(getattr(sub.owner, "transient", False))


# ---------------------------------------------------------------------------- Admin
def _unary(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run an admin method, translating `Refusal`s and core errors into gRPC statuses."""

    async def handler(self: AdminService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            user = _user(context)
            topic = f"admin/{method.__name__}"
            if not self.server.allowed(Action.ADMIN, user, topic):
                raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                              f"{method.__name__} needs the admin action ({topic!r}), which "
                              + (f"user {user!r}" if user is not None else "an anonymous client")
                              + " does not have")
            with _translated():
                return method(self, request)
        except Refusal as refusal:
            await _abort(context, refusal)

    handler.__name__ = method.__name__
    handler.__doc__ = method.__doc__
    return handler


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, server: GrpcServer) -> None:
        self.server = server

    @property
    def broker(self) -> Broker:
        return self.server.broker

    @_unary
    def CreateStream(self, request: pb.StreamSpec) -> pb.StreamInfo:
        mode = MODES.get(request.mode)
        if request.mode == pb.DISPATCH_MODE_UNSPECIFIED:
            # One default everywhere: the broker's `default_stream_mode`, the default stream's.
            mode = self.broker.stream(self.broker.router.default_stream).config.mode
        schema = SCHEMAS.get(request.schema)
        if mode is None or schema is None:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "unknown dispatch mode or schema")
        config = StreamConfig(
            request.name, mode=mode, partitions=request.partitions or 1, schema=schema,
            retention_ms=request.retention_ms if request.HasField("retention_ms") else None,
            retention_bytes=request.retention_bytes if request.HasField("retention_bytes") else None,
        )
        routes = list(request.routes) or [request.name, f"{request.name}/#"]
        for route in routes:
            validate_topic_filter(route)
        if mode is DispatchMode.RELIABLE and getattr(self.broker, "storage", None) is None:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "reliable streams need a journal and this broker has none configured")
        stream = self.broker.create_stream(config, routes=routes)
        return self.server.stream_info(stream)

    @_unary
    def ListStreams(self, request: pb.Empty) -> pb.ListStreamsResponse:
        streams = sorted(self.broker.streams.values(), key=lambda s: s.config.name)
        return pb.ListStreamsResponse(streams=[self.server.stream_info(s) for s in streams])

    @_unary
    def DescribeStream(self, request: pb.StreamName) -> pb.StreamInfo:
        return self.server.stream_info(self.broker.stream(request.name))

    @_unary
    def UpdateStream(self, request: pb.UpdateStreamRequest) -> pb.StreamInfo:
        stream = self.broker.stream(request.name)
        for route in request.add_routes:
            self.broker.add_route(RoutingRule(route, request.name))
        if request.HasField("retention_ms") or request.HasField("retention_bytes"):
            stream = self.broker.update_stream(
                request.name,
                retention_ms=request.retention_ms if request.HasField("retention_ms") else None,
                retention_bytes=request.retention_bytes if request.HasField("retention_bytes") else None,
            )
        return self.server.stream_info(stream)

    @_unary
    def DeleteStream(self, request: pb.StreamName) -> pb.Empty:
        broker = self.broker
        broker.stream(request.name)
        if request.name == broker.router.default_stream:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "the default stream cannot be deleted")
        broker.delete_stream(request.name)
        return pb.Empty()

    @_unary
    def AddRoute(self, request: pb.Route) -> pb.Empty:
        self.broker.add_route(RoutingRule(request.topic_filter, request.stream))
        return pb.Empty()

    @_unary
    def RemoveRoute(self, request: pb.Route) -> pb.Empty:
        if not self.broker.remove_route(request.topic_filter):
            raise Refusal(grpc.StatusCode.NOT_FOUND, f"no route for {request.topic_filter!r}")
        return pb.Empty()

    @_unary
    def ListRoutes(self, request: pb.Empty) -> pb.ListRoutesResponse:
        return pb.ListRoutesResponse(routes=[
            pb.Route(topic_filter=rule.topic_filter, stream=rule.stream)
            for rule in self.broker.router.rules
        ])

    @_unary
    def ListSubscriptions(self, request: pb.Empty) -> pb.ListSubscriptionsResponse:
        subs = sorted(self.broker.subscriptions.values(), key=lambda s: s.name)
        return pb.ListSubscriptionsResponse(
            subscriptions=[self.server.subscription_info(sub) for sub in subs])

    def _subscription(self, name: str) -> Subscription:
        sub = self.broker.subscriptions.get(name)
        if sub is None:
            raise Refusal(grpc.StatusCode.NOT_FOUND, f"subscription {name!r} does not exist")
        return sub

    @_unary
    def DescribeSubscription(self, request: pb.SubscriptionName) -> pb.SubscriptionInfo:
        return self.server.subscription_info(self._subscription(request.name))

    @_unary
    def ResetCursor(self, request: pb.ResetCursorRequest) -> pb.SubscriptionInfo:
        sub = self._subscription(request.subscription)
        seek = getattr(sub, "seek", None)
        if not sub.durable or not callable(seek):
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"subscription {sub.name!r} is live-only: it has no cursor to reset")
        which = request.position.WhichOneof("position") or "latest"
        seek(which, getattr(request.position, which))
        return self.server.subscription_info(sub)

    @_unary
    def DeleteSubscription(self, request: pb.SubscriptionName) -> pb.Empty:
        sub = self._subscription(request.name)
        self.broker.remove_subscription(sub.name)
        for consumer in list(sub.consumers):
            if isinstance(consumer, GrpcConsumer):
                consumer.closed = True
                consumer.wakeup.set()
        return pb.Empty()

    @_unary
    def ListClients(self, request: pb.Empty) -> pb.ListClientsResponse:
        return pb.ListClientsResponse(clients=self.server.clients())

    @_unary
    def GetBrokerInfo(self, request: pb.Empty) -> pb.BrokerInfo:
        broker = self.broker
        stats = broker.stats
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
            streams=len(broker.streams), subscriptions=len(broker.subscriptions),
            clients=len(self.server.clients()),
        )


# ---------------------------------------------------------------------------- authentication
def _refuse(code: grpc.StatusCode, reason: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, reason)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, reason)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(streaming)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


def credentials_from_metadata(metadata: Any) -> tuple[str | None, bytes | None] | None:
    """(username, password) from `authorization: Basic ...` or `Bearer TOKEN` (a token is a
    password without a username); None when the call carries no authorization."""
    for key, value in metadata or ():
        if key != "authorization":
            continue
        text = value.decode() if isinstance(value, bytes) else str(value)
        scheme, _, rest = text.strip().partition(" ")
        if scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(rest.strip(), validate=True).decode()
            except ValueError:
                return ("", b"")
            username, _, password = decoded.partition(":")
            return (username, password.encode())
        if scheme.lower() == "bearer":
            return (None, rest.strip().encode())
        return ("", b"")
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks credentials at the front door (`Edge.authenticate`), passing the peer address.

    A call without credentials is refused at once when anonymous access is off; a call with
    credentials is checked when it starts, where the peer address is known."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        edge = self.server.edge
        allow_anonymous = self.server.settings.allow_anonymous and edge.allow_anonymous
        credentials = credentials_from_metadata(handler_call_details.invocation_metadata)
        if credentials is None:
            if allow_anonymous:
                return handler
            return _refuse(grpc.StatusCode.UNAUTHENTICATED, "credentials required", handler)
        if edge.authenticator is None:
            return handler
        username, password = credentials
        return _checked(
            handler, lambda peer: edge.authenticate(Principal("grpc", username, "", peer), password)
        )


def _checked(handler: grpc.RpcMethodHandler,
             check: Callable[[str], str | None]) -> grpc.RpcMethodHandler:
    """`handler`, preceded by `check(peer)`: a refusal ends the call with UNAUTHENTICATED."""

    async def refused(context: grpc.aio.ServicerContext) -> bool:
        refusal = check(_peer(context))
        if refusal is None:
            return False
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"authentication failed: {refusal}")
        return True

    def wrap(behaviour: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behaviour):
            async def generator(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if await refused(context):
                    return
                async for response in behaviour(request, context):
                    yield response
            return generator

        async def coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if await refused(context):
                return None
            return await behaviour(request, context)
        return coroutine

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **kwargs)
    return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **kwargs)


# ---------------------------------------------------------------------------- entry point
def _check_text(what: str, text: str, limit: int = 0xFFFF) -> None:
    """Text every protocol can carry: no U+0000 (MQTT strings must not hold it
    [MQTT-1.5.4-2]) and at most `limit` bytes of UTF-8 (MQTT's and the record's u16 lengths)."""
    if "\x00" in text:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{what} contains U+0000")
    if len(text) > limit // 4 and len(text.encode()) > limit:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is longer than {limit} bytes")


def _principal(user: str | None) -> Principal:
    """A gRPC caller as authorization sees it: by user (ACL rules see no client id)."""
    return Principal("grpc", user)


def tls_credentials(cert_file: str, key_file: str, ca_file: str = "",
                    require_client_cert: bool = False) -> grpc.ServerCredentials:
    """gRPC needs PEM files, not an `ssl.SSLContext`: server credentials from the files."""
    with open(cert_file, "rb") as cert, open(key_file, "rb") as key:
        chain = [(key.read(), cert.read())]
    root = None
    if ca_file:
        with open(ca_file, "rb") as ca:
            root = ca.read()
    return grpc.ssl_server_credentials(
        chain, root_certificates=root, require_client_auth=bool(root and require_client_cert),
    )


async def start_grpc_server(
    edge: Edge, host: str, port: int, tls: grpc.ServerCredentials | None = None,
    settings: GrpcSettings | None = None,
) -> GrpcServer:
    """Start the native API on `host:port` (0 picks a free port) at the front door `edge`;
    `tls` is None for plaintext (see `tls_credentials`)."""
    server = GrpcServer(edge, settings)
    await server.start(host, port, tls)
    return server
