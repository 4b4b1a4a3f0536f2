"""The SQLite metadata schema as numbered migrations.

Migration N takes a database from version N-1 to N. Append new migrations; never edit one that
has shipped. `SCHEMA_VERSION` is the newest version this code knows; a database recording a
higher version is refused by the store. Only SQL lives here: no connection handling.
"""

from __future__ import annotations

MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE streams (
            name TEXT PRIMARY KEY,
            mode TEXT NOT NULL,
            partitions INTEGER NOT NULL,
            retention_ms INTEGER,
            retention_bytes INTEGER,
            schema TEXT NOT NULL,
            schema_definition TEXT,
            created_ms INTEGER NOT NULL
        )""",
        """CREATE TABLE routes (
            pattern TEXT PRIMARY KEY,
            stream TEXT NOT NULL,
            priority INTEGER NOT NULL
        )""",
        "CREATE INDEX routes_by_stream ON routes (stream)",
        """CREATE TABLE subscriptions (
            name TEXT PRIMARY KEY,
            type TEXT NOT NULL,
            filters TEXT NOT NULL,
            durable INTEGER NOT NULL,
            options TEXT NOT NULL,
            created_ms INTEGER NOT NULL
        )""",
        """CREATE TABLE cursors (
            subscription TEXT NOT NULL,
            stream TEXT NOT NULL,
            shard INTEGER NOT NULL,
            ack_floor INTEGER NOT NULL,
            acked BLOB,
            PRIMARY KEY (subscription, stream, shard)
        ) WITHOUT ROWID""",
        "CREATE INDEX cursors_by_shard ON cursors (stream, shard, ack_floor)",
        """CREATE TABLE sessions (
            client_id TEXT PRIMARY KEY,
            expiry_interval INTEGER NOT NULL,
            disconnected_ms INTEGER,
            expires_at_ms INTEGER,
            data BLOB NOT NULL
        )""",
        "CREATE INDEX sessions_by_expiry ON sessions (expires_at_ms) WHERE expires_at_ms IS NOT NULL",
        """CREATE TABLE qos2_inbound (
            client_id TEXT NOT NULL,
            packet_id INTEGER NOT NULL,
            PRIMARY KEY (client_id, packet_id)
        ) WITHOUT ROWID""",
        """CREATE TABLE retained (
            topic TEXT PRIMARY KEY,
            data BLOB NOT NULL
        ) WITHOUT ROWID""",
        """CREATE TABLE delayed (
            id TEXT PRIMARY KEY,
            deliver_at_ms INTEGER NOT NULL,
            data BLOB NOT NULL
        )""",
        "CREATE INDEX delayed_by_time ON delayed (deliver_at_ms)",
        """CREATE TABLE users (
            name TEXT PRIMARY KEY,
            password_hash TEXT NOT NULL,
            roles TEXT NOT NULL
        )""",
    ),
    # replicated reliable streams: copies per shard and the in-sync minimum (NULL: default)
    2: (
        "ALTER TABLE streams ADD COLUMN replicas INTEGER",
        "ALTER TABLE streams ADD COLUMN min_insync_replicas INTEGER",
    ),
}

SCHEMA_VERSION = max(MIGRATIONS)

#: Created before any migration runs; one row per applied migration.
VERSION_TABLE = """CREATE TABLE IF NOT EXISTS schema_version (
    version INTEGER PRIMARY KEY,
    applied_ms INTEGER NOT NULL
)"""
