"""The embedded metadata store: one SQLite file in the data directory (stdlib `sqlite3`).

One connection, WAL journal mode. A COMMIT writes the transaction to the WAL without an fsync
(`synchronous=NORMAL`); the fsync that makes it durable runs in the store's `WalSyncer` thread,
never on the caller's (event-loop) thread. Under the default `synchronous="FULL"` a write
outside an explicit `transaction()` returns once it is durable (the caller's thread waits for
the sync thread); batch frequent writes inside one, or collect the writes of a stretch of work
with `group_writes` and commit them with one `commit_group`, which returns at once with a
future that resolves when they are durable (group commit: the MQTT layer commits once per
event-loop turn, and the acknowledgements that depend on what was written wait on that
future, not the event loop). `deferred_sync` lets writes that acknowledge nothing (periodic
cursor saves) commit without waiting. Statements are fixed strings, so `sqlite3`'s statement
cache keeps them prepared; batches use `executemany`.

Not thread-safe: the store belongs to the thread that opened it (the sync thread has its own
connection, for checkpoints only). It knows nothing of `shardgate.core` or the protocols.

This module opens and migrates the database and holds the tables' statements and methods;
transactions, group commit and the statement helpers are `sqlite_transactions.py`'s.
"""
from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal, TypeVar

from shardgate.storage.metadata.durability import WalSyncer
from shardgate.storage.metadata.interface import MetadataError, SchemaVersionError
from shardgate.storage.metadata.records import (
    CursorRecord,
    DelayedRecord,
    RouteRecord,
    SessionRecord,
    StreamRecord,
    SubscriptionRecord,
    UserRecord,
)
from shardgate.storage.metadata.schema import MIGRATIONS, SCHEMA_VERSION, VERSION_TABLE
from shardgate.storage.metadata.sqlite_transactions import SqliteTransactions

log = logging.getLogger(__name__)

Synchronous = Literal["FULL", "EXTRA", "NORMAL"]

_PUT_STREAM = """INSERT INTO streams (name, mode, partitions, retention_ms, retention_bytes,
    schema, schema_definition, created_ms, replicas, min_insync_replicas)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (name) DO UPDATE SET mode = excluded.mode, partitions = excluded.partitions,
    retention_ms = excluded.retention_ms, retention_bytes = excluded.retention_bytes,
    schema = excluded.schema, schema_definition = excluded.schema_definition,
    created_ms = excluded.created_ms, replicas = excluded.replicas,
    min_insync_replicas = excluded.min_insync_replicas"""
_STREAM_COLUMNS = """name, mode, partitions, retention_ms, retention_bytes, schema,
    schema_definition, created_ms, replicas, min_insync_replicas"""
_PUT_ROUTE = """INSERT INTO routes (pattern, stream, priority) VALUES (?, ?, ?)
    ON CONFLICT (pattern) DO UPDATE SET stream = excluded.stream, priority = excluded.priority"""
_PUT_SUBSCRIPTION = """INSERT INTO subscriptions (name, type, filters, durable, options,
    created_ms) VALUES (?, ?, ?, ?, ?, ?)
    ON CONFLICT (name) DO UPDATE SET type = excluded.type, filters = excluded.filters,
    durable = excluded.durable, options = excluded.options, created_ms = excluded.created_ms"""
_PUT_CURSOR = """INSERT INTO cursors (subscription, stream, shard, ack_floor, acked)
    VALUES (?, ?, ?, ?, ?)
    ON CONFLICT (subscription, stream, shard) DO UPDATE SET ack_floor = excluded.ack_floor,
    acked = excluded.acked"""
_MIN_CURSOR = """SELECT MIN(c.ack_floor) FROM cursors AS c
    JOIN subscriptions AS s ON s.name = c.subscription
    WHERE c.stream = ? AND c.shard = ? AND s.durable"""
_PUT_SESSION = """INSERT INTO sessions (client_id, expiry_interval, disconnected_ms,
    expires_at_ms, data) VALUES (?, ?, ?, ?, ?)
    ON CONFLICT (client_id) DO UPDATE SET expiry_interval = excluded.expiry_interval,
    disconnected_ms = excluded.disconnected_ms, expires_at_ms = excluded.expires_at_ms,
    data = excluded.data"""
_PUT_RETAINED = """INSERT INTO retained (topic, data) VALUES (?, ?)
    ON CONFLICT (topic) DO UPDATE SET data = excluded.data"""
_PUT_DELAYED = """INSERT INTO delayed (id, deliver_at_ms, data) VALUES (?, ?, ?)
    ON CONFLICT (id) DO UPDATE SET deliver_at_ms = excluded.deliver_at_ms,
    data = excluded.data"""
_PUT_USER = """INSERT INTO users (name, password_hash, roles) VALUES (?, ?, ?)
    ON CONFLICT (name) DO UPDATE SET password_hash = excluded.password_hash,
    roles = excluded.roles"""


R = TypeVar("R")


def _readable(rows: Iterable[tuple[Any, ...]], decode: Callable[[tuple[Any, ...]], R],
              what: str) -> list[R]:
    """The records of `rows`; a row that cannot be read is logged with what it holds and set
    aside (left in the table), so that one bad row never hides the others, nor stops a
    start."""
    records = []
    for row in rows:
        try:
            records.append(decode(row))
        except (TypeError, ValueError) as exc:
            log.error("%s record cannot be restored, set aside (%s: %s); stored as %.500r",
                      what, type(exc).__name__, exc, row)
    return records


def _stream(row: tuple[Any, ...]) -> StreamRecord:
    return StreamRecord(*row)


def _subscription(row: tuple[Any, ...]) -> SubscriptionRecord:
    name, type_, filters, durable, options, created_ms = row
    return SubscriptionRecord(
        name, type_, json.loads(filters), bool(durable), json.loads(options), created_ms
    )


def _session(row: tuple[Any, ...]) -> SessionRecord:
    return SessionRecord(row[0], row[1], row[2], bytes(row[3]))


def _user(row: tuple[Any, ...]) -> UserRecord:
    return UserRecord(row[0], row[1], json.loads(row[2]))

class SqliteMetadataStore(SqliteTransactions):
    """`MetadataStore` over one SQLite database file, created and migrated on open."""

    def __init__(self, path: Path, *, synchronous: Synchronous = "FULL") -> None:
        if synchronous not in ("FULL", "EXTRA", "NORMAL"):
            raise ValueError(f"synchronous must be FULL, EXTRA or NORMAL, not {synchronous!r}")
        self.path = Path(path)
        self._depth = 0
        # Group commit (see `group_writes`): inside a group, writes join one open transaction
        # that `commit_group` commits; outside, every write commits at once as before.
        self._grouping = False
        self._group_open = False
        # Durability: the future of the open group (resolved after its commit's fsync), the
        # future of the last commit, and how many writes were made (callers compare counts to
        # learn whether a stretch of work wrote anything).
        self._group_future: Future[None] | None = None
        self._last_durable: Future[None] | None = None
        self.write_count = 0
        self._wait_for_sync = synchronous != "NORMAL"
        self._deferred = 0
        self._syncer: WalSyncer | None = None
        try:
            self._conn: sqlite3.Connection | None = sqlite3.connect(
                self.path, isolation_level=None, cached_statements=256
            )
        except sqlite3.Error as exc:
            raise MetadataError(f"cannot open metadata database {self.path}: {exc}") from exc
        try:
            self._configure()
            self._syncer = WalSyncer(self.path, fsync=synchronous != "NORMAL")
            self._migrate()
        except BaseException:
            if self._syncer is not None:
                self._syncer.stop()
            self._conn.close()
            self._conn = None
            raise

    # ---------------------------------------------------------------- setup and transactions

    def _configure(self) -> None:
        conn = self._db
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            # Commits write the WAL without an fsync: the sync thread makes them durable, and
            # checkpoints (which do fsync) run there too, not on this connection.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA wal_autocheckpoint=0")
            conn.execute("PRAGMA busy_timeout=5000")
        except sqlite3.DatabaseError as exc:
            raise MetadataError(f"{self.path} is not a usable SQLite database: {exc}") from exc
        if mode.lower() != "wal":
            raise MetadataError(f"{self.path}: cannot switch to WAL journal mode (got {mode})")

    def _migrate(self) -> None:
        with self.transaction():
            self._db.execute(VERSION_TABLE)
            current = self._db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]
            current = current or 0
            if current > SCHEMA_VERSION:
                raise SchemaVersionError(
                    f"metadata database {self.path} has schema version {current}, newer than "
                    f"the {SCHEMA_VERSION} this Shardgate knows; upgrade Shardgate or use "
                    "another data directory"
                )
            for version in range(current + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[version]:
                    self._db.execute(statement)
                self._db.execute(
                    "INSERT INTO schema_version (version, applied_ms) VALUES (?, ?)",
                    (version, int(time.time() * 1000)),
                )

    @property
    def schema_version(self) -> int:
        """The schema version of the open database."""
        return self._one("SELECT MAX(version) FROM schema_version", ())

    # ---------------------------------------------------------------- streams

    def put_stream(self, stream: StreamRecord) -> None:
        self._write(
            _PUT_STREAM,
            (
                stream.name,
                stream.mode,
                stream.partitions,
                stream.retention_ms,
                stream.retention_bytes,
                stream.schema,
                stream.schema_definition,
                stream.created_ms,
                stream.replicas,
                stream.min_insync_replicas,
            ),
        )

    def get_stream(self, name: str) -> StreamRecord | None:
        row = self._row(f"SELECT {_STREAM_COLUMNS} FROM streams WHERE name = ?", (name,))
        return None if row is None else _stream(row)

    def list_streams(self) -> list[StreamRecord]:
        return _readable(
            self._rows(f"SELECT {_STREAM_COLUMNS} FROM streams ORDER BY name", ()), _stream, "stream"
        )

    def delete_stream(self, name: str) -> bool:
        return bool(
            self._write_many(
                [
                    ("DELETE FROM streams WHERE name = ?", (name,)),
                    ("DELETE FROM routes WHERE stream = ?", (name,)),
                    ("DELETE FROM cursors WHERE stream = ?", (name,)),
                ]
            )
        )

    # ---------------------------------------------------------------- routing rules

    def put_route(self, route: RouteRecord) -> None:
        self._write(_PUT_ROUTE, (route.pattern, route.stream, route.priority))

    def list_routes(self) -> list[RouteRecord]:
        rows = self._rows(
            "SELECT pattern, stream, priority FROM routes ORDER BY priority DESC, pattern", ()
        )
        return _readable(rows, lambda r: RouteRecord(*r), "route")

    def delete_route(self, pattern: str) -> bool:
        return bool(self._write("DELETE FROM routes WHERE pattern = ?", (pattern,)))

    # ---------------------------------------------------------------- subscriptions and cursors

    def put_subscription(self, subscription: SubscriptionRecord) -> None:
        self._write(
            _PUT_SUBSCRIPTION,
            (
                subscription.name,
                subscription.type,
                json.dumps(list(subscription.filters)),
                int(subscription.durable),
                json.dumps(subscription.options, sort_keys=True),
                subscription.created_ms,
            ),
        )

    def get_subscription(self, name: str) -> SubscriptionRecord | None:
        row = self._row(
            "SELECT name, type, filters, durable, options, created_ms FROM subscriptions "
            "WHERE name = ?",
            (name,),
        )
        return None if row is None else _subscription(row)

    def list_subscriptions(self) -> list[SubscriptionRecord]:
        rows = self._rows(
            "SELECT name, type, filters, durable, options, created_ms FROM subscriptions "
            "ORDER BY name",
            (),
        )
        return _readable(rows, _subscription, "subscription")

    def delete_subscription(self, name: str) -> bool:
        return bool(
            self._write_many(
                [
                    ("DELETE FROM subscriptions WHERE name = ?", (name,)),
                    ("DELETE FROM cursors WHERE subscription = ?", (name,)),
                ]
            )
        )

    def put_cursors(self, cursors: Sequence[CursorRecord]) -> None:
        if not cursors:
            return
        rows = [(c.subscription, c.stream, c.shard, c.ack_floor, c.acked) for c in cursors]
        with self.transaction():
            try:
                self._db.executemany(_PUT_CURSOR, rows)
            except sqlite3.Error as exc:
                raise MetadataError(f"metadata write failed: {exc}") from exc

    def get_cursors(self, subscription: str) -> list[CursorRecord]:
        rows = self._rows(
            "SELECT subscription, stream, shard, ack_floor, acked FROM cursors "
            "WHERE subscription = ? ORDER BY stream, shard",
            (subscription,),
        )
        return [
            CursorRecord(s, st, sh, floor, None if acked is None else bytes(acked))
            for s, st, sh, floor, acked in rows
        ]

    def min_cursor(self, stream: str, shard: int) -> int | None:
        return self._one(_MIN_CURSOR, (stream, shard))

    # ---------------------------------------------------------------- MQTT sessions

    def put_session(self, session: SessionRecord) -> None:
        self._write(
            _PUT_SESSION,
            (
                session.client_id,
                session.expiry_interval,
                session.disconnected_ms,
                session.expires_at_ms,
                session.data,
            ),
        )

    def get_session(self, client_id: str) -> SessionRecord | None:
        row = self._row(
            "SELECT client_id, expiry_interval, disconnected_ms, data FROM sessions "
            "WHERE client_id = ?",
            (client_id,),
        )
        return None if row is None else _session(row)

    def list_sessions(self) -> list[SessionRecord]:
        rows = self._rows(
            "SELECT client_id, expiry_interval, disconnected_ms, data FROM sessions "
            "ORDER BY client_id",
            (),
        )
        return _readable(rows, _session, "session")

    def delete_session(self, client_id: str) -> bool:
        return bool(
            self._write_many(
                [
                    ("DELETE FROM sessions WHERE client_id = ?", (client_id,)),
                    ("DELETE FROM qos2_inbound WHERE client_id = ?", (client_id,)),
                ]
            )
        )

    def expired_sessions(self, now_ms: int) -> list[str]:
        rows = self._rows(
            "SELECT client_id FROM sessions WHERE expires_at_ms IS NOT NULL "
            "AND expires_at_ms <= ? ORDER BY expires_at_ms, client_id",
            (now_ms,),
        )
        return [r[0] for r in rows]

    def add_qos2_inbound(self, client_id: str, packet_id: int) -> None:
        self._write(
            "INSERT OR IGNORE INTO qos2_inbound (client_id, packet_id) VALUES (?, ?)",
            (client_id, packet_id),
        )

    def remove_qos2_inbound(self, client_id: str, packet_id: int) -> bool:
        return bool(
            self._write(
                "DELETE FROM qos2_inbound WHERE client_id = ? AND packet_id = ?",
                (client_id, packet_id),
            )
        )

    def list_qos2_inbound(self, client_id: str) -> set[int]:
        rows = self._rows("SELECT packet_id FROM qos2_inbound WHERE client_id = ?", (client_id,))
        return {r[0] for r in rows}

    # ---------------------------------------------------------------- retained messages

    def put_retained(self, topic: str, data: bytes) -> None:
        self._write(_PUT_RETAINED, (topic, data))

    def delete_retained(self, topic: str) -> bool:
        return bool(self._write("DELETE FROM retained WHERE topic = ?", (topic,)))

    def list_retained(self) -> list[tuple[str, bytes]]:
        rows = self._rows("SELECT topic, data FROM retained ORDER BY topic", ())
        return [(topic, bytes(data)) for topic, data in rows]

    # ---------------------------------------------------------------- delayed messages

    def put_delayed(self, id: str, deliver_at_ms: int, data: bytes) -> None:
        self._write(_PUT_DELAYED, (id, deliver_at_ms, data))

    def due_delayed(self, now_ms: int, limit: int | None = None) -> list[DelayedRecord]:
        rows = self._rows(
            "SELECT id, deliver_at_ms, data FROM delayed WHERE deliver_at_ms <= ? "
            "ORDER BY deliver_at_ms, id LIMIT ?",
            (now_ms, -1 if limit is None else limit),
        )
        return _readable(rows, lambda r: DelayedRecord(r[0], r[1], bytes(r[2])), "delayed message")

    def delete_delayed(self, id: str) -> bool:
        return bool(self._write("DELETE FROM delayed WHERE id = ?", (id,)))

    def delayed_summary(self, before_ms: int) -> tuple[int, int | None]:
        count = self._row("SELECT COUNT(*) FROM delayed", ())
        earliest = self._row("SELECT MIN(deliver_at_ms) FROM delayed WHERE deliver_at_ms < ?", (before_ms,))
        return (count[0] if count else 0), (earliest[0] if earliest else None)

    # ---------------------------------------------------------------- users

    def put_user(self, user: UserRecord) -> None:
        self._write(_PUT_USER, (user.name, user.password_hash, json.dumps(list(user.roles))))

    def get_user(self, name: str) -> UserRecord | None:
        row = self._row("SELECT name, password_hash, roles FROM users WHERE name = ?", (name,))
        return None if row is None else _user(row)

    def list_users(self) -> list[UserRecord]:
        rows = self._rows("SELECT name, password_hash, roles FROM users ORDER BY name", ())
        return [_user(r) for r in rows]

    def delete_user(self, name: str) -> bool:
        return bool(self._write("DELETE FROM users WHERE name = ?", (name,)))
