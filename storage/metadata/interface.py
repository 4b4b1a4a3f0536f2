"""The metadata store boundary: one small typing Protocol that the embedded SQLite store
implements today and a cluster store (etcd) can implement later.

Every write is atomic on its own; `transaction()` groups several writes into one atomic,
durable commit (and is how callers batch frequent writes such as cursors). Values are the plain
records of `records.py`; this module must not import `shardgate.core` or any protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from shardgate.storage.interfaces import StorageError
from shardgate.storage.metadata.records import (
    CursorRecord,
    DelayedRecord,
    RouteRecord,
    SessionRecord,
    StreamRecord,
    SubscriptionRecord,
    UserRecord,
)


class MetadataError(StorageError):
    """Base of every error a metadata store raises (I/O failure, closed store, bad database)."""


class SchemaVersionError(MetadataError):
    """The database was written by a newer Shardgate (a schema version this code does not
    know); it is refused rather than misread."""


class MetadataStore(Protocol):
    """Streams, routes, subscriptions, cursors, MQTT sessions, retained and delayed messages,
    and users. Puts are upserts; deletes return whether something was deleted."""

    def transaction(self) -> AbstractContextManager[None]:
        """Group the writes made inside the block into one atomic commit; an exception inside
        the block rolls all of them back and propagates. Transactions nest (an inner block
        that fails rolls back only its own writes)."""

    def close(self) -> None:
        """Release the store; further calls raise MetadataError. Idempotent."""

    # streams
    def put_stream(self, stream: StreamRecord) -> None: ...

    def get_stream(self, name: str) -> StreamRecord | None: ...

    def list_streams(self) -> list[StreamRecord]:
        """Every stream, by name."""

    def delete_stream(self, name: str) -> bool:
        """Delete a stream together with the routes to it and every cursor on it."""

    # routing rules
    def put_route(self, route: RouteRecord) -> None:
        """Add or replace the rule keyed by `route.pattern`."""

    def list_routes(self) -> list[RouteRecord]:
        """Every rule, highest priority first, then by pattern."""

    def delete_route(self, pattern: str) -> bool: ...

    # subscriptions and their cursors
    def put_subscription(self, subscription: SubscriptionRecord) -> None:
        """Add or replace a subscription; replacing keeps its cursors."""

    def get_subscription(self, name: str) -> SubscriptionRecord | None: ...

    def list_subscriptions(self) -> list[SubscriptionRecord]:
        """Every subscription, by name."""

    def delete_subscription(self, name: str) -> bool:
        """Delete a subscription and all its cursors."""

    def put_cursors(self, cursors: Sequence[CursorRecord]) -> None:
        """Upsert many cursors, keyed by (subscription, stream, shard), in one commit."""

    def get_cursors(self, subscription: str) -> list[CursorRecord]:
        """A subscription's cursors, by (stream, shard)."""

    def min_cursor(self, stream: str, shard: int) -> int | None:
        """The lowest ack floor any durable subscription holds on this shard (journal
        retention must keep everything from there on); None when no durable subscription
        has a cursor on it."""

    # MQTT sessions and their QoS 2 inbound state
    def put_session(self, session: SessionRecord) -> None: ...

    def get_session(self, client_id: str) -> SessionRecord | None: ...

    def list_sessions(self) -> list[SessionRecord]:
        """Every session, by client id."""

    def delete_session(self, client_id: str) -> bool:
        """Delete a session and its QoS 2 inbound packet ids."""

    def expired_sessions(self, now_ms: int) -> list[str]:
        """Client ids of disconnected sessions whose expiry interval has run out by now_ms."""

    def add_qos2_inbound(self, client_id: str, packet_id: int) -> None:
        """Remember an inbound QoS 2 packet id (received, PUBREL not yet seen)."""

    def remove_qos2_inbound(self, client_id: str, packet_id: int) -> bool: ...

    def list_qos2_inbound(self, client_id: str) -> set[int]: ...

    # retained messages
    def put_retained(self, topic: str, data: bytes) -> None: ...

    def delete_retained(self, topic: str) -> bool: ...

    def list_retained(self) -> list[tuple[str, bytes]]:
        """Every retained message as (topic, data), by topic."""

    # delayed messages
    def put_delayed(self, id: str, deliver_at_ms: int, data: bytes) -> None: ...

    def due_delayed(self, now_ms: int, limit: int | None = None) -> list[DelayedRecord]:
        """Delayed messages with deliver_at_ms <= now_ms, earliest first (at most `limit`).
        They stay stored until `delete_delayed`."""

    def delete_delayed(self, id: str) -> bool: ...

    def delayed_summary(self, before_ms: int) -> tuple[int, int | None]:
        """How many delayed messages are stored, and the earliest deliver-at time below
        `before_ms` (None: none), without reading their data."""

    # users
    def put_user(self, user: UserRecord) -> None: ...

    def get_user(self, name: str) -> UserRecord | None: ...

    def list_users(self) -> list[UserRecord]:
        """Every user, by name."""

    def delete_user(self, name: str) -> bool: ...
