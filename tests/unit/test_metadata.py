"""The SQLite metadata store: CRUD of every record kind, transactions, persistence across
reopen, schema versioning, and consistency after the writing process is killed."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from shardgate.storage.metadata import (
    SCHEMA_VERSION,
    SESSION_NEVER_EXPIRES,
    CursorRecord,
    DelayedRecord,
    MetadataError,
    MetadataStore,
    RouteRecord,
    SchemaVersionError,
    SessionRecord,
    SqliteMetadataStore,
    StreamRecord,
    SubscriptionRecord,
    UserRecord,
    durability,
)
from shardgate.storage.metadata import sqlite as sqlite_engine


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "metadata.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[SqliteMetadataStore]:
    s = SqliteMetadataStore(db_path)
    yield s
    s.close()


def stream(name: str = "telemetry", **changes: object) -> StreamRecord:
    fields: dict[str, object] = {
        "name": name,
        "mode": "reliable",
        "partitions": 4,
        "retention_ms": 86_400_000,
        "retention_bytes": None,
        "schema": "json",
        "schema_definition": '{"type": "object"}',
        "created_ms": 1_700_000_000_000,
    }
    fields.update(changes)
    return StreamRecord(**fields)  # type: ignore[arg-type]


def subscription(name: str = "orders", durable: bool = True) -> SubscriptionRecord:
    return SubscriptionRecord(
        name=name,
        type="shared",
        filters=["sensors/#", "alerts/+/high"],
        durable=durable,
        options={"max_inflight": 100, "ack_timeout_ms": 30000, "nested": {"a": [1, 2]}},
        created_ms=1_700_000_000_123,
    )


def fill(store: MetadataStore) -> None:
    """One record of every kind."""
    store.put_stream(stream())
    store.put_route(RouteRecord("sensors/#", "telemetry", 10))
    store.put_subscription(subscription())
    store.put_cursors([CursorRecord("orders", "telemetry", 0, 42, b"\x01\x02")])
    store.put_session(SessionRecord("device-1", 3600, 1_000, b"session-blob"))
    store.add_qos2_inbound("device-1", 7)
    store.put_retained("sensors/1/temp", b"21.5")
    store.put_delayed("d1", 5_000, b"later")
    store.put_user(UserRecord("alice", "$argon2id$hash", ["admin"]))


def test_store_satisfies_the_interface(store: SqliteMetadataStore) -> None:
    as_interface: MetadataStore = store
    assert as_interface is store
    assert store.schema_version == SCHEMA_VERSION


def test_stream_put_get_list_delete(store: SqliteMetadataStore) -> None:
    assert store.get_stream("telemetry") is None
    store.put_stream(stream())
    store.put_stream(stream("audit", mode="non-reliable", partitions=1, schema="bytes"))
    assert store.get_stream("telemetry") == stream()
    assert [s.name for s in store.list_streams()] == ["audit", "telemetry"]

    store.put_stream(stream(partitions=8, retention_bytes=1 << 30))
    assert store.get_stream("telemetry") == stream(partitions=8, retention_bytes=1 << 30)

    assert store.delete_stream("telemetry") is True
    assert store.delete_stream("telemetry") is False
    assert store.get_stream("telemetry") is None


def test_stream_record_rejects_unknown_mode_schema_and_partitions() -> None:
    with pytest.raises(ValueError, match="mode"):
        stream(mode="sometimes")
    with pytest.raises(ValueError, match="schema"):
        stream(schema="avro")
    with pytest.raises(ValueError, match="partition"):
        stream(partitions=0)


def test_deleting_a_stream_drops_its_routes_and_cursors(store: SqliteMetadataStore) -> None:
    fill(store)
    store.put_route(RouteRecord("other/#", "elsewhere", 1))
    store.delete_stream("telemetry")
    assert store.list_routes() == [RouteRecord("other/#", "elsewhere", 1)]
    assert store.get_cursors("orders") == []


def test_routes_listed_by_priority_and_replaced_by_pattern(store: SqliteMetadataStore) -> None:
    store.put_route(RouteRecord("a/#", "s1", 1))
    store.put_route(RouteRecord("b/#", "s2", 5))
    store.put_route(RouteRecord("c/#", "s3", 5))
    assert [r.pattern for r in store.list_routes()] == ["b/#", "c/#", "a/#"]

    store.put_route(RouteRecord("a/#", "s9", 9))
    assert store.list_routes()[0] == RouteRecord("a/#", "s9", 9)
    assert store.delete_route("a/#") is True
    assert store.delete_route("a/#") is False
    assert len(store.list_routes()) == 2


def test_subscription_round_trips_filters_and_options(store: SqliteMetadataStore) -> None:
    store.put_subscription(subscription())
    store.put_subscription(subscription("live", durable=False))
    assert store.get_subscription("orders") == subscription()
    assert store.get_subscription("missing") is None
    assert [s.name for s in store.list_subscriptions()] == ["live", "orders"]
    assert store.get_subscription("live").durable is False  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="subscription type"):
        SubscriptionRecord("x", "broadcast", [], True, {}, 0)  # type: ignore[arg-type]


def test_deleting_a_subscription_removes_its_cursors(store: SqliteMetadataStore) -> None:
    store.put_subscription(subscription("a"))
    store.put_subscription(subscription("b"))
    store.put_cursors([CursorRecord("a", "s", 0, 5), CursorRecord("b", "s", 0, 9)])
    assert store.delete_subscription("a") is True
    assert store.get_cursors("a") == []
    assert store.get_cursors("b") == [CursorRecord("b", "s", 0, 9)]
    assert store.delete_subscription("a") is False


def test_replacing_a_subscription_keeps_its_cursors(store: SqliteMetadataStore) -> None:
    store.put_subscription(subscription())
    store.put_cursors([CursorRecord("orders", "s", 0, 5)])
    store.put_subscription(subscription())
    assert store.get_cursors("orders") == [CursorRecord("orders", "s", 0, 5)]


def test_put_cursors_upserts_by_subscription_stream_shard(store: SqliteMetadataStore) -> None:
    store.put_subscription(subscription())
    store.put_cursors([CursorRecord("orders", "t", shard, 0) for shard in range(3)])
    store.put_cursors(
        [CursorRecord("orders", "t", 1, 17, b"\xff\x00"), CursorRecord("orders", "a", 0, 3)]
    )
    store.put_cursors([])
    assert store.get_cursors("orders") == [
        CursorRecord("orders", "a", 0, 3),
        CursorRecord("orders", "t", 0, 0),
        CursorRecord("orders", "t", 1, 17, b"\xff\x00"),
        CursorRecord("orders", "t", 2, 0),
    ]


def test_min_cursor_is_lowest_floor_of_durable_subscriptions(store: SqliteMetadataStore) -> None:
    assert store.min_cursor("t", 0) is None
    store.put_subscription(subscription("slow"))
    store.put_subscription(subscription("fast"))
    store.put_subscription(subscription("live", durable=False))
    store.put_cursors(
        [
            CursorRecord("slow", "t", 0, 10),
            CursorRecord("fast", "t", 0, 90),
            CursorRecord("live", "t", 0, 2),
            CursorRecord("slow", "t", 1, 50),
        ]
    )
    assert store.min_cursor("t", 0) == 10
    assert store.min_cursor("t", 1) == 50
    assert store.min_cursor("t", 2) is None
    store.delete_subscription("slow")
    assert store.min_cursor("t", 0) == 90
    assert store.min_cursor("t", 1) is None


def test_session_put_get_list_delete(store: SqliteMetadataStore) -> None:
    connected = SessionRecord("c1", 60, None, b"\x00subs")
    store.put_session(connected)
    store.put_session(SessionRecord("c0", 0, 5, b""))
    assert store.get_session("c1") == connected
    assert store.get_session("nobody") is None
    assert [s.client_id for s in store.list_sessions()] == ["c0", "c1"]
    store.put_session(SessionRecord("c1", 60, 1000, b"new"))
    assert store.get_session("c1") == SessionRecord("c1", 60, 1000, b"new")
    assert store.delete_session("c1") is True
    assert store.delete_session("c1") is False


def test_expired_sessions_only_disconnected_and_past_their_interval(
    store: SqliteMetadataStore,
) -> None:
    store.put_session(SessionRecord("connected", 10, None, b""))
    store.put_session(SessionRecord("forever", SESSION_NEVER_EXPIRES, 0, b""))
    store.put_session(SessionRecord("short", 10, 1_000, b""))  # expires at 11_000
    store.put_session(SessionRecord("long", 100, 1_000, b""))  # expires at 101_000
    assert store.expired_sessions(10_999) == []
    assert store.expired_sessions(11_000) == ["short"]
    assert store.expired_sessions(10**12) == ["short", "long"]
    store.put_session(SessionRecord("short", 10, None, b""))  # reconnected
    assert store.expired_sessions(10**12) == ["long"]


def test_qos2_inbound_ids_added_removed_and_cleared_with_session(
    store: SqliteMetadataStore,
) -> None:
    store.put_session(SessionRecord("c1", 60, None, b""))
    for packet_id in (1, 2, 65535):
        store.add_qos2_inbound("c1", packet_id)
    store.add_qos2_inbound("c1", 2)  # duplicate PUBLISH: no error
    store.add_qos2_inbound("c2", 1)
    assert store.list_qos2_inbound("c1") == {1, 2, 65535}
    assert store.remove_qos2_inbound("c1", 2) is True
    assert store.remove_qos2_inbound("c1", 2) is False
    assert store.list_qos2_inbound("c1") == {1, 65535}
    store.delete_session("c1")
    assert store.list_qos2_inbound("c1") == set()
    assert store.list_qos2_inbound("c2") == {1}


def test_retained_messages_put_replace_delete(store: SqliteMetadataStore) -> None:
    store.put_retained("b/t", b"1")
    store.put_retained("a/t", b"2")
    store.put_retained("b/t", b"3")
    assert store.list_retained() == [("a/t", b"2"), ("b/t", b"3")]
    assert store.delete_retained("a/t") is True
    assert store.delete_retained("a/t") is False
    assert store.list_retained() == [("b/t", b"3")]


def test_delayed_messages_due_in_time_order(store: SqliteMetadataStore) -> None:
    store.put_delayed("late", 3_000, b"c")
    store.put_delayed("early", 1_000, b"a")
    store.put_delayed("mid", 2_000, b"b")
    assert store.due_delayed(999) == []
    assert store.due_delayed(2_000) == [
        DelayedRecord("early", 1_000, b"a"),
        DelayedRecord("mid", 2_000, b"b"),
    ]
    assert [d.id for d in store.due_delayed(10_000, limit=1)] == ["early"]
    assert store.delete_delayed("early") is True
    assert store.delete_delayed("early") is False
    assert [d.id for d in store.due_delayed(10_000)] == ["mid", "late"]


def test_users_put_get_list_delete(store: SqliteMetadataStore) -> None:
    store.put_user(UserRecord("bob", "h1", ["publisher", "subscriber"]))
    store.put_user(UserRecord("alice", "h2"))
    assert store.get_user("bob") == UserRecord("bob", "h1", ["publisher", "subscriber"])
    assert store.get_user("carol") is None
    assert [u.name for u in store.list_users()] == ["alice", "bob"]
    store.put_user(UserRecord("bob", "h3", ["admin"]))
    assert store.get_user("bob") == UserRecord("bob", "h3", ["admin"])
    assert store.delete_user("bob") is True
    assert store.delete_user("bob") is False


def test_transaction_rolls_back_every_write_on_exception(store: SqliteMetadataStore) -> None:
    store.put_stream(stream("kept"))
    with pytest.raises(RuntimeError, match="boom"):
        with store.transaction():
            store.put_stream(stream("lost"))
            store.put_subscription(subscription())
            store.put_cursors([CursorRecord("orders", "lost", 0, 1)])
            store.delete_stream("kept")
            raise RuntimeError("boom")
    assert [s.name for s in store.list_streams()] == ["kept"]
    assert store.list_subscriptions() == []
    assert store.get_cursors("orders") == []


def test_transaction_commits_many_writes_together(store: SqliteMetadataStore) -> None:
    with store.transaction():
        fill(store)
        assert store.get_stream("telemetry") is not None  # reads see the pending writes
    assert store.get_cursors("orders") == [CursorRecord("orders", "telemetry", 0, 42, b"\x01\x02")]


def test_failed_inner_transaction_rolls_back_only_itself(store: SqliteMetadataStore) -> None:
    with store.transaction():
        store.put_stream(stream("outer"))
        with pytest.raises(KeyError):
            with store.transaction():
                store.put_stream(stream("inner"))
                raise KeyError("inner")
        store.put_retained("t", b"x")
    assert [s.name for s in store.list_streams()] == ["outer"]
    assert store.list_retained() == [("t", b"x")]


def test_everything_is_back_after_reopen(db_path: Path) -> None:
    first = SqliteMetadataStore(db_path)
    fill(first)
    first.close()

    store = SqliteMetadataStore(db_path)
    try:
        assert store.list_streams() == [stream()]
        assert store.list_routes() == [RouteRecord("sensors/#", "telemetry", 10)]
        assert store.list_subscriptions() == [subscription()]
        assert store.get_cursors("orders") == [
            CursorRecord("orders", "telemetry", 0, 42, b"\x01\x02")
        ]
        assert store.min_cursor("telemetry", 0) == 42
        assert store.list_sessions() == [SessionRecord("device-1", 3600, 1_000, b"session-blob")]
        assert store.expired_sessions(3_601_000) == ["device-1"]
        assert store.list_qos2_inbound("device-1") == {7}
        assert store.list_retained() == [("sensors/1/temp", b"21.5")]
        assert store.due_delayed(5_000) == [DelayedRecord("d1", 5_000, b"later")]
        assert store.list_users() == [UserRecord("alice", "$argon2id$hash", ["admin"])]
    finally:
        store.close()


def test_database_uses_wal_and_a_write_returns_once_fsynced(
    store: SqliteMetadataStore, db_path: Path
) -> None:
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()
    syncer = store._syncer
    assert syncer is not None
    before = syncer.fsyncs
    store.put_session(SessionRecord("a", 60, None, b""))
    assert syncer.fsyncs > before  # the sync thread fsynced the WAL before put_session returned


def test_commit_group_does_not_wait_and_its_future_resolves_after_the_fsync(
    store: SqliteMetadataStore, db_path: Path
) -> None:
    syncer = store._syncer
    assert syncer is not None
    store.group_writes(True)
    store.put_session(SessionRecord("a", 60, None, b""))
    store.group_writes(False)
    waiter = store.durable_waiter()
    assert waiter is not None and not waiter.done()
    released = threading.Event()
    syncer.fsync_file = lambda fd: (released.wait(30), os.fsync(fd))
    before = syncer.fsyncs
    durable = store.commit_group()
    assert durable is waiter
    assert _sessions_seen_by_another_connection(db_path) == ["a"]  # committed at once
    assert not durable.done()  # but not durable until the sync thread has fsynced
    released.set()
    durable.result(timeout=10)
    assert syncer.fsyncs > before
    assert store.durable_waiter() is None


def test_deferred_writes_commit_without_waiting_and_become_durable(
    store: SqliteMetadataStore, db_path: Path
) -> None:
    syncer = store._syncer
    assert syncer is not None
    released = threading.Event()
    syncer.fsync_file = lambda fd: (released.wait(30), os.fsync(fd))
    with store.deferred_sync():  # returns while the fsync is held
        store.put_cursors([CursorRecord("s", "st", 0, 5, b"x")])
    waiter = store.durable_waiter()
    assert waiter is not None and not waiter.done()
    released.set()
    waiter.result(timeout=10)
    assert store.durable_waiter() is None


def test_the_wal_is_checkpointed_off_the_writer(db_path: Path) -> None:
    store = SqliteMetadataStore(db_path)
    try:
        assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        for index in range(durability.CHECKPOINT_EVERY + 1):
            store.put_session(SessionRecord(f"c{index}", 60, None, b"x" * 100))
        assert store._syncer is not None and store._syncer.checkpoints >= 1
    finally:
        store.close()
    assert _sessions_seen_by_another_connection(db_path)[:2] == ["c0", "c1"]


def test_closed_store_raises_metadata_error(db_path: Path) -> None:
    store = SqliteMetadataStore(db_path)
    store.close()
    store.close()
    with pytest.raises(MetadataError, match="closed"):
        store.list_streams()


def test_database_from_newer_schema_version_is_refused(db_path: Path) -> None:
    SqliteMetadataStore(db_path).close()
    conn = sqlite3.connect(db_path)
    with conn:
        conn.execute(
            "INSERT INTO schema_version (version, applied_ms) VALUES (?, 0)", (SCHEMA_VERSION + 1,)
        )
    conn.close()
    with pytest.raises(SchemaVersionError, match=f"schema version {SCHEMA_VERSION + 1}"):
        SqliteMetadataStore(db_path)


def test_file_that_is_not_a_database_is_refused(db_path: Path) -> None:
    db_path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(MetadataError):
        SqliteMetadataStore(db_path)


def test_migrations_apply_by_version_number_and_keep_data(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = SqliteMetadataStore(db_path)
    fill(old)
    old.close()

    next_version = SCHEMA_VERSION + 1
    migrations = {
        **sqlite_engine.MIGRATIONS,
        next_version: ("ALTER TABLE users ADD COLUMN disabled INTEGER NOT NULL DEFAULT 0",),
    }
    monkeypatch.setattr(sqlite_engine, "MIGRATIONS", migrations)
    monkeypatch.setattr(sqlite_engine, "SCHEMA_VERSION", next_version)
    store = SqliteMetadataStore(db_path)
    try:
        assert store.schema_version == next_version
        assert store.list_users() == [UserRecord("alice", "$argon2id$hash", ["admin"])]
        assert store._db.execute("SELECT disabled FROM users").fetchall() == [(0,)]
    finally:
        store.close()


WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from shardgate.storage.metadata import (
        CursorRecord, SessionRecord, SqliteMetadataStore, StreamRecord, SubscriptionRecord,
    )

    store = SqliteMetadataStore(Path(sys.argv[1]))
    i = 0
    while True:
        with store.transaction():
            store.put_stream(StreamRecord(f"s{i:06}", "reliable", 1, None, None, "bytes", None, i))
            store.put_subscription(SubscriptionRecord(f"sub{i:06}", "exclusive", ["#"], True, {}, i))
            store.put_cursors(
                [CursorRecord(f"sub{i:06}", f"s{i:06}", shard, i, b"x" * 64) for shard in range(50)]
            )
            store.put_session(SessionRecord(f"c{i:06}", 60, None, b"y" * 512))
        print(i, flush=True)
        i += 1
    """
)


def test_killed_writer_leaves_a_consistent_database(db_path: Path) -> None:
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db_path)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None
    last_committed = -1
    try:
        while last_committed < 30:
            line = writer.stdout.readline()
            assert line, "the writer exited early"
            last_committed = int(line)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()

    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
    store = SqliteMetadataStore(db_path)
    try:
        streams = store.list_streams()
        count = len(streams)
        assert count > last_committed  # every acknowledged commit survived
        assert [s.name for s in streams] == [f"s{i:06}" for i in range(count)]
        assert len(store.list_subscriptions()) == count
        assert len(store.list_sessions()) == count
        for i in (0, count // 2, count - 1):  # each transaction is all or nothing
            cursors = store.get_cursors(f"sub{i:06}")
            assert [c.shard for c in cursors] == list(range(50))
            assert store.min_cursor(f"s{i:06}", 49) == i
        store.put_stream(stream())  # and it is writable again
    finally:
        store.close()


def _sessions_seen_by_another_connection(db_path: Path) -> list[str]:
    other = sqlite3.connect(db_path)
    try:
        return [row[0] for row in other.execute("SELECT client_id FROM sessions ORDER BY client_id")]
    finally:
        other.close()


def test_grouped_writes_become_durable_together_at_commit_group(store, db_path) -> None:
    store.group_writes(True)
    store.put_session(SessionRecord("a", 60, None, b"1"))
    store.put_session(SessionRecord("b", 60, None, b"2"))
    store.add_qos2_inbound("a", 7)
    store.group_writes(False)
    assert store.group_pending
    assert store.get_session("a") is not None  # the writer reads its own writes at once
    assert _sessions_seen_by_another_connection(db_path) == []  # not committed yet
    store.commit_group()
    assert not store.group_pending
    assert _sessions_seen_by_another_connection(db_path) == ["a", "b"]
    assert store.list_qos2_inbound("a") == {7}


def test_a_failed_write_in_a_group_undoes_only_itself(store, db_path) -> None:
    store.group_writes(True)
    store.put_session(SessionRecord("kept", 60, None, b""))
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.put_session(SessionRecord("undone", 60, None, b""))
            raise RuntimeError("the caller failed half way")
    store.group_writes(False)
    store.commit_group()
    assert _sessions_seen_by_another_connection(db_path) == ["kept"]


def test_a_write_outside_the_group_commits_the_open_group_with_it(store, db_path) -> None:
    store.group_writes(True)
    store.put_session(SessionRecord("grouped", 60, None, b""))
    store.group_writes(False)
    store.put_session(SessionRecord("direct", 60, None, b""))  # e.g. another protocol's write
    assert not store.group_pending
    assert _sessions_seen_by_another_connection(db_path) == ["direct", "grouped"]


def test_close_commits_an_open_group(db_path) -> None:
    store = SqliteMetadataStore(db_path)
    store.group_writes(True)
    store.put_session(SessionRecord("last", 60, None, b""))
    store.close()
    assert _sessions_seen_by_another_connection(db_path) == ["last"]
