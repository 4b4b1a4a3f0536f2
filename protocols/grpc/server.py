"""The gRPC listener: `Producer`, `Consumer` and `Admin` servicers on the core, over grpc.aio.

`start_grpc_server(edge, host, port, tls)` is what the composition root calls. The server runs on
the broker's own event loop, so servicers call the core's front door (`core.edge.Edge`)
directly. The package's modules: `convert` (API messages to core values, core errors to
statuses), `auth` (the authentication interceptor), `producer_service`, `consumer_service` and
`admin_service` (the servicers), `consumer` (a consumer's delivery state), and this module (the
server object, TLS and listener setup).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc

from ...core.edge import KICK_REASON, Action, ClientInfo, Edge, Receipt
from ...core.errors import (
    InvalidMessage,
    PublishRejected,
    SchemaMismatch,
    StoreFull,
)
from ...core.message import Message
from ...core.streams import Stream
from ...core.subscriptions import Subscription, SubscriptionType
from ...core.topics import TopicError, validate_topic_name
from ...proto import shardgate_pb2 as pb
from ...proto import shardgate_pb2_grpc as pb_grpc
from .admin_service import AdminService, Listing, ResetAnywhere
from .auth import AuthInterceptor, principal_of
from .consumer import GrpcConsumer, GrpcSubscriptionState
from .consumer_service import ConsumeRemotely, ConsumerService
from .convert import (
    MODES_OUT,
    SCHEMAS_OUT,
    SUB_TYPES_OUT,
    Refusal,
    check_text,
    is_transient,
    lag_of,
    protocol_of,
)
from .identity import Identity, identify
from .malformed import MalformedRequestInterceptor
from .producer_service import ProducerService, ProducerStreamInfo
from .settings import DEFAULT_PORT, GrpcSettings

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PORT", "GrpcServer", "start_grpc_server"]


# The longest time to live a message may ask for (100 years): its expiry, in epoch
# milliseconds, must fit the record's signed 64-bit field.
MAX_TTL_MS = 100 * 365 * 24 * 3600 * 1000


def refusal_of(exc: PublishRejected) -> Refusal:
    """The status a publish the core refused gets: a schema mismatch is the client's error
    (INVALID_ARGUMENT), any other refusal (storage failure, store full) is UNAVAILABLE."""
    if isinstance(exc, SchemaMismatch | InvalidMessage):
        return Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, StoreFull):  # a quota: the disk alarm, the journal's pending bytes
        return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    return Refusal(grpc.StatusCode.UNAVAILABLE, str(exc))


class RemoteSubscriptions(Protocol):
    """Cluster mode: durable subscriptions held by other nodes, as the gRPC API reaches them
    (`shardgate.cluster.durable_consumers.DurableConsumers`); a single node has none (None)."""

    async def consume_remotely(self, holder: str, first: pb.ConsumeRequest,
                               requests: AsyncIterator[pb.ConsumeRequest],
                               context: grpc.aio.ServicerContext, user: str | None) -> None:
        """Run a consumer's stream against `holder`, where its subscription is consumed."""

    async def describe(self, name: str) -> pb.SubscriptionInfo | None:
        """A subscription another node holds, as that node describes it (None: no node holds
        it). `DescribeSubscription` asks for a name not held here."""

    async def delete(self, name: str) -> bool:
        """Delete a subscription another node holds (False: no node holds it)."""


class GrpcServer:
    """The bound gRPC server; `close()` and `await wait_closed()` stop it."""

    def __init__(self, edge: Edge, settings: GrpcSettings | None = None,
                 cluster_status: Callable[[], dict[str, Any]] | None = None, *,
                 remote: RemoteSubscriptions | None = None,
                 listing: Listing | None = None,
                 reset_anywhere: ResetAnywhere | None = None) -> None:
        self.edge = edge
        # Cluster mode: the cluster as this node sees it (`Admin.GetClusterStatus`); None on
        # a single node.
        self.cluster_status = cluster_status
        # Cluster mode: the cluster-wide listings of streams, subscriptions and clients
        # (`shardgate.cluster.views.listing`, in the `proto` shape); None on a single node.
        self.listing = listing
        # Cluster mode: `Admin.ResetCursor` on the node holding the subscription; None on a
        # single node.
        self.reset_anywhere = reset_anywhere
        self.settings = settings or GrpcSettings()
        self.consumers: set[GrpcConsumer] = set()
        self.producers: set[ProducerStreamInfo] = set()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        # the TLS port (`listeners.grpcs_port`) when the same servicers also listen on one
        self.secure_port = 0
        self._closing: asyncio.Task[None] | None = None
        # Cleared while the memory alarm blocks publishers (`shardgate.resources`): producers
        # wait for it before their next message or batch.
        self.publishing = asyncio.Event()
        self.publishing.set()
        self._topic_ok: set[str] = set()
        self._registered = _RegisteredClients(self)
        self.consumer_service = ConsumerService(self)
        # Cluster mode (`RemoteSubscriptions`, bound once; None on a single node): runs a
        # consumer's stream against the node where its durable subscription is consumed,
        # describes and deletes a subscription held by another node.
        self.consume_remotely: ConsumeRemotely | None = None if remote is None else remote.consume_remotely
        self.describe_elsewhere: Callable[[str], Awaitable[pb.SubscriptionInfo | None]] | None = (
            None if remote is None else remote.describe)
        self.delete_elsewhere: Callable[[str], Awaitable[bool]] | None = (
            None if remote is None else remote.delete)

    def allowed(self, action: Action, user: str | None, topic: str) -> bool:
        return self.edge.authorize(principal_of(user), action, topic)

    def reauthorize(self) -> int:
        """Check every consumer stream's subscription again (the users or the ACL rules
        changed): a stream whose user may no longer subscribe to one of its filters is ended
        with PERMISSION_DENIED (its unacknowledged messages go back to the subscription).
        Nothing is checked per message. Returns how many streams were ended."""
        ended = 0
        for consumer in list(self.consumers):
            if consumer.closed:
                continue
            for topic_filter in list(consumer.subscription.filters):
                if not self.allowed(Action.SUBSCRIBE, consumer.user, topic_filter):
                    who = f"user {consumer.user!r}" if consumer.user is not None else "anonymous clients"
                    reason = f"{who} may no longer subscribe to {topic_filter!r}"
                    log.info("%s: gRPC consumer %s of %r ended: %s", consumer.peer, consumer.id,
                             consumer.subscription.name, reason)
                    consumer.deny(reason)
                    ended += 1
                    break
        return ended

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

    async def start(self, host: str, port: int, credentials: grpc.ServerCredentials | None) -> None:
        """Listen on `host:port` (0 picks a free port; TLS when `credentials`) and serve."""
        self.listen(host, port, credentials)
        await self.serve()

    def listen(self, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
        """Bind one more port (plaintext, or TLS with `credentials`) before `serve()`; every port
        serves the same servicers, consumers and producers. Returns the bound port, which is
        also `port` (plaintext) or `secure_port` (TLS) from then on."""
        if self.server is None:
            self.server = self._new_server()
        address = f"{host}:{port}"
        if port:
            check_port_free(host, port)
        try:
            if credentials is None:
                bound = self.server.add_insecure_port(address)
            else:
                bound = self.server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise OSError(f"cannot bind gRPC listener on {address}: {exc}") from exc
        if bound == 0:
            raise OSError(f"cannot bind gRPC listener on {address}")
        if credentials is None:
            self.port = bound
        else:
            self.secure_port = bound
        return bound

    async def serve(self) -> None:
        """Start serving the ports `listen()` bound."""
        assert self.server is not None, "listen() first"
        await self.server.start()
        self.edge.clients.register("grpc", self._registered)

    def _new_server(self) -> grpc.aio.Server:
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
        server = grpc.aio.server(options=options,
                                 interceptors=[AuthInterceptor(self), MalformedRequestInterceptor()])
        pb_grpc.add_ProducerServicer_to_server(ProducerService(self), server)
        pb_grpc.add_ConsumerServicer_to_server(self.consumer_service, server)
        pb_grpc.add_AdminServicer_to_server(AdminService(self), server)
        return server

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
                     user: str | None = None, identity: Identity | None = None,
                     index: int = 0) -> Message:
        """Validate and authorize a publish request, build the core message; raises `Refusal`.
        Its producer identity is the request's own, else the `index`-th of its batch's
        `identity` (see `identify`)."""
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
        if not self.edge.authorize(principal_of(user), Action.PUBLISH, topic):
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
        edge = self.edge
        stream: Stream = edge.stream_for_topic(topic)
        if request.stream and stream.config.name != request.stream:
            if request.stream not in edge.streams:
                raise Refusal(grpc.StatusCode.NOT_FOUND, f"stream {request.stream!r} does not exist")
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"topic {topic!r} resolves to stream {stream.config.name!r}, not {request.stream!r}",
            )
        # The stream's schema is checked once, by the core's publish (see `publish`).
        message = Message(topic, payload, qos=1, retain=request.retain,
                          producer_protocol="grpc", producer_id=request.producer_name or producer_id)
        if request.HasField("identity"):
            identify(message, Identity(request.identity), 0)
        elif identity is not None:
            identify(message, identity, index)
        if request.HasField("key"):
            message.key = request.key
        if request.headers:
            message.headers = [(h.key, h.value) for h in request.headers]
            for key, value in message.headers:
                check_text("header name", key)
                check_text(f"header {key!r}", value)
        if request.content_type:
            check_text("content_type", request.content_type)
            message.content_type = request.content_type
        if request.correlation_data:
            message.correlation_data = request.correlation_data
        if request.reply_to:
            check_text("reply_to", request.reply_to)
            message.reply_to = request.reply_to
        if request.ttl_ms:
            if request.ttl_ms > MAX_TTL_MS:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"ttl_ms {request.ttl_ms} is longer than the maximum {MAX_TTL_MS}")
            message.expires_at_ms = message.publish_time_ms + request.ttl_ms
        return message

    def block_publishers(self, blocked: bool) -> None:
        """The memory alarm went off (or cleared): producers wait meanwhile."""
        if blocked:
            self.publishing.clear()
        else:
            self.publishing.set()

    def publish(self, message: Message) -> Receipt:
        try:
            return self.edge.publish(message)
        except PublishRejected as exc:
            raise refusal_of(exc) from exc

    def publish_many(self, messages: list[Message]) -> list[Receipt | Refusal]:
        """Publish the messages of one batch in one core call (one journal append per
        shard): per message, in order, its receipt or the `Refusal` that refused it alone."""
        return [
            refusal_of(outcome) if isinstance(outcome, PublishRejected) else outcome
            for outcome in self.edge.publish_many(messages)
        ]

    # ---------------------------------------------------------------- admin views
    def stream_info(self, stream: Stream) -> pb.StreamInfo:
        edge = self.edge
        config = stream.config
        info = pb.StreamInfo(
            name=config.name,
            mode=MODES_OUT[config.mode],
            partitions=config.partitions,
            schema=SCHEMAS_OUT[config.schema],
            routes=[rule.topic_filter for rule in edge.routes if rule.stream == config.name],
            shards=[pb.ShardInfo(index=shard.index, next_offset=shard.next_offset)
                    for shard in stream.shards],
            is_default=config.name == edge.default_stream,
        )
        if config.retention_ms is not None:
            info.retention_ms = config.retention_ms
        if config.retention_bytes is not None:
            info.retention_bytes = config.retention_bytes
        if config.replicas is not None:
            info.replicas = config.replicas
        if config.min_insync_replicas is not None:
            info.min_insync_replicas = config.min_insync_replicas
        for sub in list(edge.subscriptions.values()):
            state = sub.owner
            if isinstance(state, GrpcSubscriptionState) and state.stream == config.name:
                info.subscriptions.add(name=sub.name, lag=lag_of(sub))
        return info

    def delete_subscription(self, sub: Subscription) -> None:
        """Remove `sub`; its gRPC consumers' streams end."""
        self.edge.remove_subscription(sub.name)
        for consumer in list(sub.consumers):
            if isinstance(consumer, GrpcConsumer):
                consumer.closed = True
                consumer.wakeup.set()

    def subscription_info(self, sub: Subscription) -> pb.SubscriptionInfo:
        info = pb.SubscriptionInfo(
            name=sub.name, type=SUB_TYPES_OUT[sub.type], durable=sub.durable and not is_transient(sub),
            topic_filters=list(sub.filters), protocol=protocol_of(sub), lag=lag_of(sub),
        )
        options = getattr(sub, "options", None)
        if options is not None:
            info.max_deliveries = options.max_deliveries
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
                entry.protocol = protocol_of(sub)
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


def check_port_free(host: str, port: int) -> None:
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
