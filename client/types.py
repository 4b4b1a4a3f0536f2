"""Plain data the SDK returns: receipts, received messages, stream / subscription / client views."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from ..proto import shardgate_pb2 as pb
from . import schemas

T = TypeVar("T")


class SubscriptionType(StrEnum):
    EXCLUSIVE = "exclusive"
    SHARED = "shared"
    FAILOVER = "failover"

    def to_pb(self) -> pb.SubscriptionType:
        return {"exclusive": pb.SUBSCRIPTION_TYPE_EXCLUSIVE, "shared": pb.SUBSCRIPTION_TYPE_SHARED,
                "failover": pb.SUBSCRIPTION_TYPE_FAILOVER}[self.value]

    @classmethod
    def from_pb(cls, value: int) -> SubscriptionType:
        by_value: dict[int, SubscriptionType] = {pb.SUBSCRIPTION_TYPE_SHARED: cls.SHARED,
                                                 pb.SUBSCRIPTION_TYPE_FAILOVER: cls.FAILOVER}
        return by_value.get(value, cls.EXCLUSIVE)


class Mode(StrEnum):
    NON_RELIABLE = "non-reliable"
    RELIABLE = "reliable"

    def to_pb(self) -> pb.DispatchMode:
        return pb.DISPATCH_MODE_RELIABLE if self is Mode.RELIABLE else pb.DISPATCH_MODE_NON_RELIABLE

    @classmethod
    def from_pb(cls, value: int) -> Mode:
        return cls.RELIABLE if value == pb.DISPATCH_MODE_RELIABLE else cls.NON_RELIABLE


class Schema(StrEnum):
    BYTES = "bytes"
    STRING = "string"
    INT64 = "int64"
    JSON = "json"

    def to_pb(self) -> pb.Schema:
        return {"bytes": pb.SCHEMA_BYTES, "string": pb.SCHEMA_STRING, "int64": pb.SCHEMA_INT64,
                "json": pb.SCHEMA_JSON}[self.value]

    @classmethod
    def from_pb(cls, value: int) -> Schema:
        by_value: dict[int, Schema] = {pb.SCHEMA_STRING: cls.STRING, pb.SCHEMA_INT64: cls.INT64,
                                       pb.SCHEMA_JSON: cls.JSON}
        return by_value.get(value, cls.BYTES)


@dataclass(slots=True, frozen=True)
class Position:
    """Where a new subscription starts: `Position.latest()`, `earliest()`, `at_offset(n)`,
    `at_time(ms)`."""

    kind: str = "latest"
    value: int = 0

    @classmethod
    def latest(cls) -> Position:
        return cls("latest")

    @classmethod
    def earliest(cls) -> Position:
        return cls("earliest")

    @classmethod
    def at_offset(cls, offset: int) -> Position:
        return cls("offset", offset)

    @classmethod
    def at_time(cls, timestamp_ms: int) -> Position:
        return cls("timestamp_ms", timestamp_ms)

    def to_pb(self) -> pb.StartPosition:
        if self.kind == "latest":
            return pb.StartPosition(latest=True)
        if self.kind == "earliest":
            return pb.StartPosition(earliest=True)
        if self.kind == "offset":
            return pb.StartPosition(offset=self.value)
        if self.kind == "timestamp_ms":
            return pb.StartPosition(timestamp_ms=self.value)
        raise ValueError(f"unknown position {self.kind!r}")


@dataclass(slots=True, frozen=True)
class Receipt:
    """Where a published message was stored."""

    stream: str
    shard: int
    offset: int


@dataclass(slots=True, eq=False)
class ReceivedMessage:
    """A message pushed to a consumer. Call `ack()` once processed, or `nack(delay_s)`."""

    topic: str
    payload: bytes
    key: bytes | None
    headers: list[tuple[str, str]]
    content_type: str
    correlation_data: bytes
    reply_to: str
    publish_time_ms: int
    expires_at_ms: int | None
    stream: str
    shard: int
    offset: int
    producer_protocol: str
    producer_id: str
    redelivery_count: int
    delivery_id: int
    _settle: Callable[[ReceivedMessage, bool, float], Awaitable[None]] | None = field(default=None, repr=False)

    @classmethod
    def from_pb(cls, m: pb.ConsumedMessage,
                settle: Callable[[ReceivedMessage, bool, float], Awaitable[None]] | None) -> ReceivedMessage:
        # Positional, in field order: a third faster than keywords on the consumer's hot path.
        headers = m.headers
        return cls(
            m.topic, m.payload, m.key if m.HasField("key") else None,
            [(h.key, h.value) for h in headers] if headers else [], m.content_type,
            m.correlation_data, m.reply_to, m.publish_time_ms, m.expires_at_ms or None,
            m.stream, m.shard, m.offset, m.producer_protocol, m.producer_id,
            m.redelivery_count, m.delivery_id, settle,
        )

    def ack(self) -> Awaitable[None]:
        """Mark the message processed (sent with the next batch of acks, within the consumer's
        `ack_interval_s`). Calling it is enough; `await message.ack()` waits until the ack is
        written to the broker."""
        if self._settle is not None:
            return self._settle(self, True, 0.0)
        return _DONE

    def nack(self, delay_s: float = 0.0) -> Awaitable[None]:
        """Give the message back; it is redelivered (to this or another consumer) after
        `delay_s`, with `redelivery_count` one higher (a durable subscription with
        `max_deliveries` dead-letters it instead once it was delivered that often).
        Awaitable like `ack()`."""
        if self._settle is not None:
            return self._settle(self, False, delay_s)
        return _DONE

    def header(self, name: str, default: str | None = None) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return default

    def text(self) -> str:
        return schemas.decode_string(self.payload)

    def int64(self) -> int:
        return schemas.decode_int64(self.payload)

    def json(self) -> Any:
        return schemas.decode_json(self.payload)


@dataclass(slots=True)
class ShardInfo:
    index: int
    next_offset: int
    owner: str = ""
    """In a cluster: the node that leads the shard ("" on a single node)."""
    unavailable: bool = False
    """In a cluster: its owner did not answer (`next_offset` is then unknown, 0)."""


class Listing(list[T]):
    """A listing (a list) that, in a cluster, also says which nodes did not answer:
    `unanswered` maps each such node to why; what they hold is missing from the list."""

    unanswered: dict[str, str]

    def __init__(self, items: Iterable[T] = (), unanswered: dict[str, str] | None = None) -> None:
        super().__init__(items)
        self.unanswered = dict(unanswered or {})


@dataclass(slots=True)
class StreamInfo:
    name: str
    mode: Mode
    partitions: int
    schema: Schema
    retention_ms: int | None
    retention_bytes: int | None
    routes: list[str]
    shards: list[ShardInfo]
    subscriptions: dict[str, int]
    is_default: bool
    replicas: int | None = None
    """As created (None: the default, 3 in a cluster capped by the live nodes)."""
    min_insync_replicas: int | None = None
    """As created (None: the default, 2)."""
    unanswered: dict[str, str] = field(default_factory=dict)
    """In a cluster: the nodes that did not answer, and why (their shards are `unavailable`)."""

    @classmethod
    def from_pb(cls, s: pb.StreamInfo) -> StreamInfo:
        return cls(
            name=s.name, mode=Mode.from_pb(s.mode), partitions=s.partitions,
            schema=Schema.from_pb(s.schema),
            retention_ms=s.retention_ms if s.HasField("retention_ms") else None,
            retention_bytes=s.retention_bytes if s.HasField("retention_bytes") else None,
            routes=list(s.routes),
            shards=[ShardInfo(x.index, x.next_offset, x.owner, x.unavailable) for x in s.shards],
            subscriptions={x.name: x.lag for x in s.subscriptions}, is_default=s.is_default,
            replicas=s.replicas if s.HasField("replicas") else None,
            min_insync_replicas=s.min_insync_replicas if s.HasField("min_insync_replicas") else None,
            unanswered={x.node: x.reason for x in s.unanswered},
        )


@dataclass(slots=True)
class SchemaInfo:
    """A version of a stream's registered payload schema."""

    stream: str
    version: int
    type: str
    """`json` (JSON Schema) or `avro`."""
    definition: str
    """The schema as canonical JSON text (`json.loads` gives the document)."""
    compatibility: str
    registered_ms: int
    rejected: int
    """Payloads the stream refused since the broker started."""

    @classmethod
    def from_pb(cls, s: pb.SchemaInfo) -> SchemaInfo:
        return cls(stream=s.stream, version=s.version, type=s.type, definition=s.definition,
                   compatibility=s.compatibility, registered_ms=s.registered_ms,
                   rejected=s.rejected)


@dataclass(slots=True)
class ConsumerInfo:
    consumer_id: str
    protocol: str
    active: bool
    unacked: int
    credit: int
    delivered: int


@dataclass(slots=True)
class SubscriptionInfo:
    name: str
    type: SubscriptionType
    durable: bool
    topic_filters: list[str]
    consumers: list[ConsumerInfo]
    protocol: str
    # Durable: messages stored and not yet acknowledged by it (0 for a live subscription).
    lag: int = 0
    # Durable: deliveries before a message is dead-lettered to `$dlq/<name>` (0: never).
    max_deliveries: int = 0
    # In a cluster's listing: the node that holds it.
    node: str = ""

    @classmethod
    def from_pb(cls, s: pb.SubscriptionInfo) -> SubscriptionInfo:
        return cls(
            name=s.name, type=SubscriptionType.from_pb(s.type), durable=s.durable,
            topic_filters=list(s.topic_filters), protocol=s.protocol, lag=s.lag,
            max_deliveries=s.max_deliveries, node=s.node,
            consumers=[ConsumerInfo(c.consumer_id, c.protocol, c.active, c.unacked, c.credit,
                                    c.delivered) for c in s.consumers],
        )


@dataclass(slots=True)
class ClientInfo:
    protocol: str
    client_id: str
    username: str
    remote: str
    connected_at: float
    messages_in: int
    messages_out: int
    detail: str
    node: str = ""
    """In a cluster's listing: the node it is connected to."""

    @classmethod
    def from_pb(cls, c: pb.ClientInfo) -> ClientInfo:
        return cls(c.protocol, c.client_id, c.username, c.remote, c.connected_at,
                   c.messages_in, c.messages_out, c.detail, c.node)


@dataclass(slots=True)
class BrokerInfo:
    version: str
    started_at: float
    uptime_s: float
    listeners: dict[str, tuple[str, int]]
    messages_in: int
    bytes_in: int
    messages_out: int
    bytes_out: int
    messages_dropped: int
    streams: int
    subscriptions: int
    clients: int

    @classmethod
    def from_pb(cls, b: pb.BrokerInfo) -> BrokerInfo:
        return cls(
            version=b.version, started_at=b.started_at, uptime_s=b.uptime_s,
            listeners={x.name: (x.host, x.port) for x in b.listeners},
            messages_in=b.messages_in, bytes_in=b.bytes_in, messages_out=b.messages_out,
            bytes_out=b.bytes_out, messages_dropped=b.messages_dropped, streams=b.streams,
            subscriptions=b.subscriptions, clients=b.clients,
        )


class _Done:
    """An awaitable that is done already (a message without a consumer to settle with)."""

    def __await__(self) -> Generator[None, None, None]:
        return
        yield


_DONE = _Done()
