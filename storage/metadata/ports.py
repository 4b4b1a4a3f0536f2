"""The core's storage ports (`shardgate.core.ports`) implemented over a `MetadataStore`.

The ports are typing Protocols checked by structure, so this module does not import the core:
`MetadataPorts` has the methods the ports name, in plain values, and translates them into the
store's records. Cursor saves are queued and written in one transaction by `flush` (the
composition root calls it periodically, without waiting for the fsync, and on shutdown).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import nullcontext

from shardgate.storage.metadata.interface import MetadataStore
from shardgate.storage.metadata.records import CursorRecord, DelayedRecord, SessionRecord

log = logging.getLogger(__name__)

MQTT_SUBSCRIPTION_PREFIX = "mqtt:"


class MetadataPorts:
    """Sessions, QoS 2 state, cursors and delayed messages in the metadata store."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self._pending_cursors: dict[tuple[str, str, int], CursorRecord] = {}

    # ------------------------------------------------------------------ sessions
    def save_session(
        self, client_id: str, expiry_interval: int, disconnected_ms: int | None, data: bytes
    ) -> None:
        self.store.put_session(SessionRecord(client_id, expiry_interval, disconnected_ms, data))

    def forget_session(self, client_id: str) -> None:
        with self.store.transaction():
            self.store.delete_session(client_id)
            self.store.delete_subscription(f"{MQTT_SUBSCRIPTION_PREFIX}{client_id}")

    def load_sessions(self) -> list[SessionRecord]:
        return self.store.list_sessions()

    # ------------------------------------------------------------------ group commit
    def group_writes(self, on: bool) -> None:
        group = getattr(self.store, "group_writes", None)
        if group is not None:
            group(on)

    @property
    def group_pending(self) -> bool:
        return bool(getattr(self.store, "group_pending", False))

    def commit_group(self) -> Future[None] | None:
        """Commit the open group; the future resolves once it is durable."""
        commit = getattr(self.store, "commit_group", None)
        return commit() if commit is not None else None

    @property
    def write_count(self) -> int:
        """How many writes the store has taken (to tell whether some work wrote anything)."""
        return int(getattr(self.store, "write_count", 0))

    def durable_waiter(self) -> Future[None] | None:
        """The future that resolves once every write made so far is durable; None when they
        are already."""
        waiter = getattr(self.store, "durable_waiter", None)
        return waiter() if waiter is not None else None

    # ------------------------------------------------------------------ QoS 2 inbound state
    def save_qos2(self, changes: Sequence[tuple[str, int, bool]]) -> None:
        with self.store.transaction():
            for client_id, packet_id, present in changes:
                if present:
                    self.store.add_qos2_inbound(client_id, packet_id)
                else:
                    self.store.remove_qos2_inbound(client_id, packet_id)

    def qos2_inbound(self, client_id: str) -> set[int]:
        return self.store.list_qos2_inbound(client_id)

    # ------------------------------------------------------------------ cursors
    def save_cursor(self, subscription: str, stream: str, shard: int, floor: int, state: bytes) -> None:
        self._pending_cursors[(subscription, stream, shard)] = CursorRecord(
            subscription, stream, shard, floor, state
        )

    def flush(self, wait: bool = True) -> None:
        """Write the queued cursors in one transaction; with `wait` False the fsync follows
        in the store's sync thread (a periodic save acknowledges nothing)."""
        if not self._pending_cursors:
            return
        batch, self._pending_cursors = list(self._pending_cursors.values()), {}
        deferred = getattr(self.store, "deferred_sync", None)
        try:
            with deferred() if deferred is not None and not wait else nullcontext():
                self.store.put_cursors(batch)
        except Exception:
            log.exception("could not save %d cursors", len(batch))

    def load_cursors(self, subscription: str) -> list[CursorRecord]:
        return self.store.get_cursors(subscription)

    # ------------------------------------------------------------------ delayed messages
    def put_delayed(self, id: str, deliver_at_ms: int, data: bytes) -> None:
        self.store.put_delayed(id, deliver_at_ms, data)

    def due_delayed(self, now_ms: int, limit: int | None = None) -> list[DelayedRecord]:
        return self.store.due_delayed(now_ms, limit)

    def delete_delayed(self, id: str) -> bool:
        return self.store.delete_delayed(id)

    def delayed_summary(self, before_ms: int) -> tuple[int, int | None]:
        return self.store.delayed_summary(before_ms)
