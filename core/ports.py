"""What the core and the protocol layers need stored, as small typing Protocols (ports).

Each port speaks in plain values (strings, ints, bytes), so neither `core` nor a protocol
imports a storage engine or its record types. `storage.metadata.ports.MetadataPorts` implements
every port over the metadata store; the composition root (`shardgate/`) wires it in. A cluster
store can implement the same ports later.

Writes through a port may be batched by the implementation (`flush` makes them durable now);
reads happen at start-up, when sessions and cursors are restored.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol


class SavedSession(Protocol):
    """An MQTT session as saved: `data` is the protocol layer's own serialization."""

    @property
    def client_id(self) -> str: ...

    @property
    def expiry_interval(self) -> int: ...

    @property
    def disconnected_ms(self) -> int | None: ...

    @property
    def data(self) -> bytes: ...


class SavedCursor(Protocol):
    """Where a durable subscription stands in one shard: the ack floor and the opaque state of
    the offsets acknowledged above it."""

    @property
    def stream(self) -> str: ...

    @property
    def shard(self) -> int: ...

    @property
    def ack_floor(self) -> int: ...

    @property
    def acked(self) -> bytes | None: ...


class SavedDelayed(Protocol):
    """A held message: an id, when it is due and its encoded record."""

    @property
    def id(self) -> str: ...

    @property
    def deliver_at_ms(self) -> int: ...

    @property
    def data(self) -> bytes: ...


class SessionStore(Protocol):
    """MQTT sessions that outlive their connection."""

    def save_session(
        self, client_id: str, expiry_interval: int, disconnected_ms: int | None, data: bytes
    ) -> None: ...

    def forget_session(self, client_id: str) -> None:
        """Delete a session, its QoS 2 state and its durable subscription's cursors."""

    def load_sessions(self) -> Sequence[SavedSession]: ...


class Qos2Store(Protocol):
    """Inbound QoS 2 packet ids (PUBLISH received, PUBREL not yet seen) per client."""

    def save_qos2(self, changes: Sequence[tuple[str, int, bool]]) -> None:
        """Apply (client id, packet id, present) changes in one atomic write; callers batch."""

    def qos2_inbound(self, client_id: str) -> set[int]: ...


class CursorStore(Protocol):
    """Durable subscriptions' cursors."""

    def save_cursor(self, subscription: str, stream: str, shard: int, floor: int, state: bytes) -> None:
        """Queue one cursor for the next batched write."""

    def flush(self, wait: bool = True) -> None:
        """Write every queued cursor (and other batched state) now; with `wait` False the
        write need not be durable on return."""

    def load_cursors(self, subscription: str) -> Sequence[SavedCursor]: ...


class DelayedStore(Protocol):
    """Messages held until a deliver-at time."""

    def put_delayed(self, id: str, deliver_at_ms: int, data: bytes) -> None: ...

    def due_delayed(self, now_ms: int, limit: int | None = None) -> Sequence[SavedDelayed]: ...

    def delete_delayed(self, id: str) -> bool: ...

    def delayed_summary(self, before_ms: int) -> tuple[int, int | None]:
        """How many are stored, and the earliest deliver-at time below `before_ms` (None:
        none), without reading their data."""


class WriteGroups(Protocol):
    """Group commit: while a group is open, writes join one transaction that `commit_group`
    commits; the future it returns resolves once the writes are durable (one fsync, off the
    caller's thread), and the caller acknowledges nothing that depends on them before."""

    def group_writes(self, on: bool) -> None:
        """Open (True) or close (False) the group; closing does not commit."""

    @property
    def group_pending(self) -> bool:
        """Writes wait in the group for `commit_group`."""
        ...

    def commit_group(self) -> Future[None] | None: ...

    @property
    def write_count(self) -> int:
        """Writes taken so far: a change tells that a stretch of work wrote something."""
        ...

    def durable_waiter(self) -> Future[None] | None:
        """Resolves once every write made so far is durable; None when they already are."""


class MqttSessionPorts(SessionStore, Qos2Store, CursorStore, WriteGroups, Protocol):
    """Everything the MQTT layer stores."""
