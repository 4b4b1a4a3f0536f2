"""The Parquet archiver on a real journal: Hive layout and file names, columns and types,
atomic files, progress derived from the files (no duplicates after a crash), retries of a
failing store, retention up to the archived offset and reads back for tiered replay."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st
from shardgate.core.records import MessageRecord, decode_message, encode_message
from shardgate.storage.archive import (
    ARROW_SCHEMA,
    ArchiveConfigError,
    Archiver,
    ArchiveReader,
    ArchiveSettings,
    ArchiveUnavailable,
    build_table,
    list_stream_files,
    local_files,
    open_filesystem,
    parse_file_name,
    records_from_table,
)
from shardgate.storage.interfaces import StoredRecord
from shardgate.storage.journal import JournalStorage

HOUR = 3_600_000
T0 = 1_700_000_000_000 - 1_700_000_000_000 % HOUR + 30 * 60_000  # 2023-11-14 22:30 UTC


def message(i: int, ts: int, topic: str = "sensors/dev-1/temp", **fields: Any) -> bytes:
    return encode_message(MessageRecord(
        topic=topic, payload=b"payload-%d" % i, qos=1, retain=False, publish_time_ms=ts,
        producer_protocol="mqtt", producer_id="dev-1", **fields,
    ))


async def append(journal: JournalStorage, stream: str, shard: int, count: int,
                 ts: int = T0, step_ms: int = 1, **fields: Any) -> None:
    log = journal.open_shard(stream, shard)
    first = log.next_offset
    log.append([(ts + i * step_ms, message(first + i, ts + i * step_ms, **fields))
                for i in range(count)])
    await log.flush()


def read_rows(root: Path, stream: str) -> pa.Table:
    fs = LocalFileSystem()
    tables = [pq.read_table(entry.path) for entry in list_stream_files(fs, str(root), stream)]
    return pa.concat_tables(tables) if tables else ARROW_SCHEMA.empty_table()


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[JournalStorage]:
    store = JournalStorage(tmp_path / "journal", fsync="os", segment_bytes=4096)
    yield store
    store.close()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "archive"


def streams(*entries: tuple[str, int, str]) -> Any:
    return lambda: list(entries)


FAST = ArchiveSettings(target_rows=100, poll_interval_s=0.02, max_delay_s=3600,
                       retry_initial_s=0.02, retry_max_s=0.1, stop_timeout_s=2)


async def test_flush_writes_hive_partitions_and_files_named_by_offset_range(
        journal: JournalStorage, root: Path) -> None:
    # 250 records, the last 50 in the next hour: files of at most 100 rows, cut at the hour.
    await append(journal, "default", 0, 200, ts=T0)
    await append(journal, "default", 0, 50, ts=T0 + HOUR)
    archiver = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")), FAST)
    await archiver.flush()

    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert names == [
        "stream=default/date=2023-11-14/hour=22/shard0000/shard0000-00000000000000000000-00000000000000000099.parquet",
        "stream=default/date=2023-11-14/hour=22/shard0000/shard0000-00000000000000000100-00000000000000000199.parquet",
        "stream=default/date=2023-11-14/hour=23/shard0000/shard0000-00000000000000000200-00000000000000000249.parquet",
    ]
    table = read_rows(root, "default")
    assert table.schema.equals(ARROW_SCHEMA)
    assert table.column("offset").to_pylist() == list(range(250))
    assert archiver.archived_offset("default", 0) == 250
    [status] = archiver.status()
    assert status["journal_next"] == 250 and status["archived_up_to"] == 249
    assert status["lag_records"] == 0 and status["files"] == 3 and status["bytes"] > 0
    parquet = pq.ParquetFile(next(root.rglob("*.parquet")))
    assert parquet.metadata.row_group(0).column(0).compression == "ZSTD"


async def test_every_message_field_round_trips_through_parquet(
        journal: JournalStorage, root: Path) -> None:
    fields = dict(
        key=b"\x00key", headers=[("unit", "°C"), ("site", "b/2")], content_type="application/json",
        correlation_data=b"\xffcorr", reply_to="replies/x", payload_format=1,
        expires_at_ms=T0 + 60_000,
    )
    topic = "a/b c/+/ünï/#x"
    log = journal.open_shard("default", 0)
    data = [message(0, T0, topic=topic, **fields), message(1, T0 + 1)]
    log.append([(T0, data[0]), (T0 + 1, data[1])])
    await log.flush()
    archiver = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")), FAST)
    await archiver.flush()

    row = read_rows(root, "default").to_pylist()[0]
    assert row["shard"] == 0 and row["offset"] == 0
    assert row["topic"] == topic and row["payload"] == b"payload-0" and row["key"] == b"\x00key"
    assert row["headers"] == [("unit", "°C"), ("site", "b/2")]
    assert row["publish_time"].timestamp() * 1000 == T0 and row["publish_time"].tzinfo is not None
    assert row["expires_at"].timestamp() * 1000 == T0 + 60_000
    assert (row["content_type"], row["producer_protocol"], row["producer_id"]) == (
        "application/json", "mqtt", "dev-1")
    assert (row["qos"], row["retain"], row["correlation_data"], row["reply_to"]) == (
        1, False, b"\xffcorr", "replies/x")
    assert row["payload_string"] is None and row["payload_int64"] is None

    # Tiered replay gets the journal's exact record bytes back.
    replayed = ArchiveReader(f"file://{root}").read("default", 0, 0, 10)
    assert [(r.offset, r.timestamp_ms, r.data) for r in replayed] == [
        (0, T0, data[0]), (1, T0 + 1, data[1])]
    assert decode_message(replayed[0].data).headers == fields["headers"]


async def test_schema_streams_get_a_decoded_payload_column(
        journal: JournalStorage, root: Path) -> None:
    def put(stream: str, payloads: list[bytes]) -> None:
        journal.open_shard(stream, 0).append([
            (T0, encode_message(MessageRecord("t", p, 0, False, T0))) for p in payloads])

    put("text", ["héllo".encode(), b"\xff"])
    put("numbers", [(-5).to_bytes(8, "big", signed=True), b"short"])
    put("readings", [b'{"device": "d1", "temp": 21.5}'])
    await journal.flush()
    archiver = Archiver(journal, f"file://{root}", streams(
        ("text", 1, "string"), ("numbers", 1, "int64"), ("readings", 1, "json")), FAST)
    await archiver.flush()
    assert read_rows(root, "text").column("payload_string").to_pylist() == ["héllo", None]
    assert read_rows(root, "numbers").column("payload_int64").to_pylist() == [-5, None]
    readings = read_rows(root, "readings")
    assert readings.column("payload_json").to_pylist() == ['{"device": "d1", "temp": 21.5}']
    assert readings.column("payload_string").null_count == 1


async def test_restarted_archiver_continues_after_the_files_present_without_duplicates(
        journal: JournalStorage, root: Path) -> None:
    await append(journal, "default", 0, 150)
    first = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")), FAST)
    await first.flush()
    # A crash right after the upload: the first archiver vanishes without any bookkeeping.
    del first
    await append(journal, "default", 0, 30)
    second = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")), FAST)
    await second.start()
    assert second.archived_offset("default", 0) == 150
    await second.stop(flush=True)
    offsets = read_rows(root, "default").column("offset").to_pylist()
    assert offsets == list(range(180))
    assert second.status()[0]["files"] == 3


class FlakyLocalFileSystem(LocalFileSystem):
    """A local filesystem whose uploads fail `failures` times (after writing, if `late`)."""

    cachable = False

    def __init__(self, failures: int, late: bool = False) -> None:
        super().__init__()
        self.failures = failures
        self.late = late
        self.calls = 0

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            if self.late:
                super().pipe_file(path, value, **kwargs)
                raise TimeoutError("response lost after the upload")
            raise ConnectionError("object store unreachable")
        super().pipe_file(path, value, **kwargs)


class ObjectStoreLike(FlakyLocalFileSystem):
    """Taken for a remote store by the archiver (uploads go through pipe_file)."""

    protocol = ("flaky",)


async def test_upload_retried_after_a_lost_response_replaces_the_same_file(
        journal: JournalStorage, root: Path) -> None:
    await append(journal, "default", 0, 60)
    fs = ObjectStoreLike(failures=2, late=True)
    fs.mkdirs(str(root), exist_ok=True)
    archiver = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")), FAST,
                        filesystem=fs)
    await archiver.flush(timeout=5)
    assert fs.calls == 3
    assert len(list(root.rglob("*.parquet"))) == 1
    assert read_rows(root, "default").column("offset").to_pylist() == list(range(60))


async def test_unreachable_store_is_retried_with_backoff_and_lag_shows_in_status(
        journal: JournalStorage, root: Path) -> None:
    fs = ObjectStoreLike(failures=10**9)
    archiver = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")),
                        ArchiveSettings(target_rows=10, poll_interval_s=0.01, retry_initial_s=0.02,
                                        retry_max_s=0.05), filesystem=fs)
    await archiver.start()
    await append(journal, "default", 0, 25, ts=int(time.time() * 1000))
    # Wait on the archiver's own count: the store's call counter moves before the failure is
    # recorded.
    for _ in range(3000):
        if archiver.status()[0]["failures"] >= 3:
            break
        await asyncio.sleep(0.01)
    [status] = archiver.status()
    assert status["lag_records"] == 25 and status["failures"] >= 3
    assert "unreachable" in status["last_error"] and status["lag_ms"] is not None
    assert archiver.archived_offset("default", 0) == 0
    with pytest.raises(ArchiveUnavailable, match="unreachable"):
        await archiver.flush(timeout=0.2)

    fs.failures = 0  # the store comes back
    await archiver.flush(timeout=5)
    await archiver.stop()
    assert archiver.status()[0]["lag_records"] == 0 and archiver.status()[0]["last_error"] is None
    assert read_rows(root, "default").column("offset").to_pylist() == list(range(25))


async def test_a_write_that_fails_midway_leaves_no_visible_file(
        journal: JournalStorage, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await append(journal, "default", 0, 20)
    archiver = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")), FAST)
    real_fsync = os.fsync
    seen: list[list[str]] = []

    def failing_fsync(fd: int) -> None:
        # The temporary file is complete on disk but not yet renamed: nothing is visible.
        seen.append([p.name for p in root.rglob("*") if p.is_file()])
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(local_files.os, "fsync", failing_fsync)
    with pytest.raises(ArchiveUnavailable):
        await archiver.flush(timeout=0.1)
    assert seen and all(name.startswith(".shard") for names in seen for name in names)
    assert [p for p in root.rglob("*") if p.is_file()] == []  # the temporary was removed
    assert list_stream_files(LocalFileSystem(), str(root), "default") == []

    monkeypatch.setattr(local_files.os, "fsync", real_fsync)
    await archiver.flush(timeout=5)
    assert read_rows(root, "default").column("offset").to_pylist() == list(range(20))


async def test_stale_temporaries_are_invisible_and_removed_at_start(
        journal: JournalStorage, root: Path) -> None:
    directory = root / "stream=default" / "date=2023-11-14" / "hour=22"
    directory.mkdir(parents=True)
    stale = directory / ".shard0000-00000000000000000000-00000000000000000009.parquet.abc.tmp"
    stale.write_bytes(b"PAR1 half a file")
    assert list_stream_files(LocalFileSystem(), str(root), "default") == []
    await append(journal, "default", 0, 10)
    archiver = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")), FAST)
    await archiver.start()
    await archiver.stop()
    assert not stale.exists()
    assert read_rows(root, "default").num_rows == 10


async def test_polars_reads_the_root_while_a_file_is_being_written(
        journal: JournalStorage, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The temporary of a file being written lies outside the root: polars, which refuses a
    directory holding a `.tmp` beside `.parquet` files, reads the root meanwhile."""
    import polars as pl

    await append(journal, "default", 0, 10)
    archiver = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")), FAST)
    await archiver.flush(timeout=5)
    real_fsync = os.fsync
    counts: list[int] = []

    def fsync_after_a_read(fd: int) -> None:
        if not counts:  # the temporary is written, not yet renamed into place
            counts.append(pl.read_parquet(str(root), hive_partitioning=True).height)
        real_fsync(fd)

    await append(journal, "default", 0, 5, ts=T0 + 10)
    monkeypatch.setattr(local_files.os, "fsync", fsync_after_a_read)
    await archiver.flush(timeout=5)
    monkeypatch.setattr(local_files.os, "fsync", real_fsync)
    assert counts == [10]
    assert pl.read_parquet(str(root), hive_partitioning=True).height == 15
    assert [p for p in root.parent.rglob("*.tmp")] == []


async def test_stale_temporaries_beside_the_root_are_removed_once_an_hour_old(
        journal: JournalStorage, root: Path) -> None:
    writing = root.parent / f".{root.name}.writing"
    writing.mkdir(parents=True)
    name = ".shard0000-00000000000000000000-00000000000000000009.parquet.{}.tmp"
    stale, young = writing / name.format("old"), writing / name.format("new")
    for path in (stale, young):
        path.write_bytes(b"PAR1 half a file")
    hour_ago = time.time() - 3700
    os.utime(stale, (hour_ago, hour_ago))
    await append(journal, "default", 0, 10)
    archiver = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")), FAST)
    await archiver.start()
    await archiver.stop()
    assert not stale.exists() and young.exists()  # another node may be writing the young one
    assert read_rows(root, "default").num_rows == 10


async def test_max_delay_seals_a_partial_file_without_flush(
        journal: JournalStorage, root: Path) -> None:
    archiver = Archiver(journal, f"file://{root}", streams(("default", 2, "bytes")),
                        ArchiveSettings(target_rows=1000, max_delay_s=0.05, poll_interval_s=0.01))
    await archiver.start()
    await append(journal, "default", 1, 7, ts=int(time.time() * 1000))
    for _ in range(500):
        if archiver.archived_offset("default", 1) == 7:
            break
        await asyncio.sleep(0.01)
    await archiver.stop(flush=False)
    assert archiver.archived_offset("default", 1) == 7
    [entry] = list_stream_files(LocalFileSystem(), str(root), "default")
    assert (entry.shard, entry.first_offset, entry.last_offset) == (1, 0, 6)


async def test_byte_target_cuts_files(journal: JournalStorage, root: Path) -> None:
    await append(journal, "default", 0, 100)
    size = len(message(0, T0))
    archiver = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")),
                        ArchiveSettings(target_bytes=size * 30, read_batch=7))
    await archiver.flush()
    files = list_stream_files(LocalFileSystem(), str(root), "default")
    assert [(f.first_offset, f.last_offset) for f in files] == [
        (0, 29), (30, 59), (60, 89), (90, 99)]


async def test_retention_below_the_archived_offset_and_replay_from_archive_then_journal(
        tmp_path: Path, root: Path) -> None:
    journal = JournalStorage(tmp_path / "j2", fsync="os", segment_bytes=2048, retention_bytes=1)
    try:
        for _ in range(10):  # one segment per commit group at most: several groups
            await append(journal, "default", 0, 30)
        log = journal.open_shard("default", 0)
        original = log.read(0, 1000)
        archiver = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")),
                            ArchiveSettings(target_rows=120))
        # Nothing archived yet: retention keeps everything.
        journal.apply_retention({("default", 0): archiver.archived_offset("default", 0)})
        assert log.low_watermark == 0
        await archiver.flush()
        low = journal.apply_retention({("default", 0): archiver.archived_offset("default", 0)})
        assert 0 < low[("default", 0)] <= 300

        # A consumer at offset 0: the archive up to the low watermark, then the journal.
        reader = ArchiveReader(f"file://{root}")
        replay, cursor = [], 0
        while cursor < log.committed_offset:
            batch = (reader.read("default", 0, cursor, 50) if cursor < log.low_watermark
                     else log.read(cursor, 50))
            replay += batch
            cursor = batch[-1].offset + 1
        assert [(r.offset, r.data) for r in replay] == [(r.offset, r.data) for r in original]
        assert reader.offset_range("default", 0) == (0, 300)
    finally:
        journal.close()


async def test_journal_gap_before_archiving_is_skipped_and_reported(
        tmp_path: Path, root: Path) -> None:
    journal = JournalStorage(tmp_path / "j3", fsync="os", segment_bytes=1024)
    try:
        for _ in range(10):
            await append(journal, "default", 0, 10)
        log = journal.open_shard("default", 0)
        low = log.delete_before(60)
        assert low > 0
        archiver = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")), FAST)
        await archiver.flush()
        assert read_rows(root, "default").column("offset").to_pylist() == list(range(low, 100))
        assert archiver.status()[0]["skipped"] == low
    finally:
        journal.close()


def test_unknown_url_scheme_is_a_clear_error(journal: JournalStorage) -> None:
    with pytest.raises(ArchiveConfigError, match="unknown scheme 'nosuch'"):
        Archiver(journal, "nosuch://bucket/x", streams())
    with pytest.raises(ArchiveConfigError, match="empty"):
        open_filesystem("")


def test_file_names_sort_by_offset_and_parse_back() -> None:
    assert parse_file_name("shard0003-00000000000000001000-00000000000000001999.parquet") == (
        3, 1000, 1999)
    for name in (".shard0003-00000000000000001000-00000000000000001999.parquet.x.tmp",
                 "shard0003-00000000000000002000-00000000000000001999.parquet", "_SUCCESS"):
        assert parse_file_name(name) is None


async def test_streams_with_unsafe_names_are_not_archived(
        journal: JournalStorage, root: Path) -> None:
    archiver = Archiver(journal, f"file://{root}", streams(("../evil", 1, "bytes")), FAST)
    await archiver.start()
    await archiver.stop(flush=True)
    await archiver.flush(timeout=0.2)
    assert not root.exists() or not any(root.rglob("*.parquet"))
    assert "cannot be archived" in archiver.status()[0]["last_error"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.builds(
    MessageRecord,
    topic=st.text(min_size=1, max_size=20),
    payload=st.binary(max_size=40),
    qos=st.integers(0, 2),
    retain=st.booleans(),
    publish_time_ms=st.integers(0, 2**41),
    key=st.none() | st.binary(max_size=8),
    headers=st.none() | st.lists(st.tuples(st.text(max_size=5), st.text(max_size=5)), max_size=3),
    content_type=st.none() | st.text(max_size=10),
    correlation_data=st.none() | st.binary(max_size=8),
    reply_to=st.none() | st.text(max_size=10),
    payload_format=st.none() | st.integers(0, 1),
    expires_at_ms=st.none() | st.integers(0, 2**41),
    producer_protocol=st.sampled_from(["mqtt", "amqp", "grpc", ""]),
    producer_id=st.text(max_size=10),
), max_size=8))
def test_archive_table_decodes_like_decode_message_and_rebuilds_the_same_bytes(
        messages: list[MessageRecord]) -> None:
    records = [StoredRecord(i, m.publish_time_ms, encode_message(m)) for i, m in enumerate(messages)]
    table = build_table("s", 0, "bytes", records)
    rows = table.to_pylist()
    for row, record in zip(rows, records, strict=True):
        expected = decode_message(record.data)
        assert (row["topic"], row["payload"], row["key"], row["qos"], row["retain"]) == (
            expected.topic, expected.payload, expected.key, expected.qos, expected.retain)
        assert (row["headers"] or None) == expected.headers
        assert (row["content_type"], row["reply_to"], row["payload_format"]) == (
            expected.content_type, expected.reply_to, expected.payload_format)
    assert [(r.offset, r.data) for r in records_from_table(table)] == [
        (r.offset, r.data) for r in records]


async def test_offsets_the_journal_skipped_have_no_row(
    journal: JournalStorage, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed commit leaves offsets that subscribers may have seen; the journal fills them
    with empty records, which the archive skips (and its progress passes)."""
    import errno

    from shardgate.storage.journal import segment as segment_module

    await append(journal, "default", 0, 5)
    log = journal.open_shard("default", 0)
    with monkeypatch.context() as patch:
        def disk_full(fd: int, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        patch.setattr(segment_module.os, "write", disk_full)
        patch.setattr(segment_module.os, "pwritev", lambda fd, buffers, position, flags=0: (
            disk_full(fd, buffers[0])))
        log.append([(T0 + 5, message(5, T0 + 5))])
        with pytest.raises(Exception, match="No space left"):
            await log.flush()
    await append(journal, "default", 0, 3, ts=T0 + 10)
    assert log.committed_offset == 9

    archiver = Archiver(journal, f"file://{root}", streams(("default", 1, "bytes")), FAST)
    await archiver.flush()
    table = read_rows(root, "default")
    assert table.column("offset").to_pylist() == [0, 1, 2, 3, 4, 6, 7, 8]
    assert archiver.archived_offset("default", 0) == 9
