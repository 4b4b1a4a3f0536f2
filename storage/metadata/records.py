"""The plain-data records the metadata store keeps: streams, routes, subscriptions, cursors,
MQTT sessions, delayed messages and users.

These are storage values, not the core's domain objects: `core` converts to and from them.
Protocol-specific parts travel as opaque bytes or JSON-compatible values. This module must not
import `shardgate.core` or any protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

StreamMode = Literal["reliable", "non-reliable"]
StreamSchema = Literal["bytes", "string", "int64", "json"]
SubscriptionType = Literal["exclusive", "shared", "failover"]

#: MQTT 5.0 §3.1.2.11.2: a Session Expiry Interval of 0xFFFFFFFF means the session never expires.
SESSION_NEVER_EXPIRES = 0xFFFFFFFF


def _check_choice(what: str, value: str, allowed: Any) -> None:
    choices = get_args(allowed)
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(choices)}, not {value!r}")


@dataclass(slots=True, frozen=True)
class StreamRecord:
    """A stream's configuration."""

    name: str
    mode: StreamMode
    partitions: int
    retention_ms: int | None
    retention_bytes: int | None
    schema: StreamSchema
    schema_definition: str | None
    created_ms: int
    replicas: int | None = None
    min_insync_replicas: int | None = None

    def __post_init__(self) -> None:
        _check_choice("stream mode", self.mode, StreamMode)
        _check_choice("stream schema", self.schema, StreamSchema)
        if self.partitions < 1:
            raise ValueError(f"a stream needs at least one partition, not {self.partitions}")


@dataclass(slots=True, frozen=True)
class RouteRecord:
    """A routing rule: topics matching `pattern` (a topic filter) go to `stream`.

    The pattern is the rule's key: one pattern routes to one stream.
    """

    pattern: str
    stream: str
    priority: int


@dataclass(slots=True, frozen=True)
class SubscriptionRecord:
    """A named subscription; `options` is protocol-specific JSON-compatible data."""

    name: str
    type: SubscriptionType
    filters: list[str]
    durable: bool
    options: dict[str, Any]
    created_ms: int

    def __post_init__(self) -> None:
        _check_choice("subscription type", self.type, SubscriptionType)


@dataclass(slots=True, frozen=True)
class CursorRecord:
    """Where a subscription stands in one shard.

    `ack_floor` is the first offset not yet acknowledged; `acked` is an opaque compact encoding
    of the offsets above the floor that are already acknowledged (None when there are none).
    """

    subscription: str
    stream: str
    shard: int
    ack_floor: int
    acked: bytes | None = None


@dataclass(slots=True, frozen=True)
class SessionRecord:
    """An MQTT session; `data` is the protocol layer's own serialization (subscriptions, will,
    inflight). `expiry_interval` is in seconds (MQTT 5.0 §3.1.2.11.2); `disconnected_ms` is
    None while the client is connected."""

    client_id: str
    expiry_interval: int
    disconnected_ms: int | None
    data: bytes

    @property
    def expires_at_ms(self) -> int | None:
        """When the session expires, or None while connected or if it never expires."""
        if self.disconnected_ms is None or self.expiry_interval >= SESSION_NEVER_EXPIRES:
            return None
        return self.disconnected_ms + self.expiry_interval * 1000


@dataclass(slots=True, frozen=True)
class DelayedRecord:
    """A message held back until `deliver_at_ms`; `data` is opaque to the store."""

    id: str
    deliver_at_ms: int
    data: bytes


@dataclass(slots=True, frozen=True)
class UserRecord:
    """A user for authentication; `roles` is a JSON-compatible list of role names."""

    name: str
    password_hash: str
    roles: list[str] = field(default_factory=list)
