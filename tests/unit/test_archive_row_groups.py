"""A file of several row groups is built a row group's records at a time, in parallel, while
the row groups already built are encoded, two at once, each as a Parquet file of its own that
is then stitched into the file: the file is byte for byte the whole table written at once
(rows, row groups, footer), its first row group is encoded before its last is built, and
a part that cannot be built fails the file as a whole, which is retried. Whole row groups are
built as soon as their records are read, before the file is sealed, each once, and encoded
then, the footer's last offset added at the close; a part built with a schema version that is
no longer the latest at the seal is built again."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem
from shardgate.core.records import MessageRecord, encode_message
from shardgate.storage.archive import Archiver, ArchiveSettings, list_stream_files
from shardgate.storage.archive import archiver as archiver_module
from shardgate.storage.archive.buffer import RecordBuffer
from shardgate.storage.archive.columns import RESERVED, FileEncoder, build_table, encode_parquet
from shardgate.storage.archive.typed import TypedSchema
from shardgate.storage.journal import JournalStorage

T0 = 1_700_000_000_000 - 1_700_000_000_000 % 3_600_000
SCHEMA = {"type": "object", "properties": {"device": {"type": "string"},
                                           "temp": {"type": "number"}}}
ROWS = 1000
GROUP = 128


def payload(i: int) -> bytes:
    if i % 97 == 5:
        return b"not json"  # no typed columns: its bytes are kept
    return json.dumps({"device": f"d{i % 7}", "temp": i / 4}).encode()


def fill(journal: JournalStorage, count: int = ROWS) -> None:
    log = journal.open_shard("s", 0)
    log.append([(T0 + i, encode_message(MessageRecord(
        f"t/{i % 5}", payload(i), 1, False, T0 + i, producer_id="me"))) for i in range(count)])
    journal.flush_sync()


def archiver(journal: JournalStorage, root: Path, **settings: Any) -> Archiver:
    return Archiver(journal, root.as_uri(), lambda: [("s", 1, "json")],
                    ArchiveSettings(target_rows=ROWS, row_group_rows=GROUP, max_delay_s=3600,
                                    compaction=False, retry_initial_s=0.01, retry_max_s=0.02,
                                    **settings),
                    registered_schema=lambda _s: ("json", SCHEMA, 1))


def only_file(root: Path) -> Any:
    entries = list_stream_files(LocalFileSystem(), str(root), "s")
    assert len(entries) == 1
    return entries[0]


async def test_a_file_built_in_parts_is_the_file_of_the_whole_table(tmp_path: Path) -> None:
    journal = JournalStorage(tmp_path / "journal", fsync="os")
    try:
        fill(journal)
        await archiver(journal, tmp_path / "archive").flush(timeout=30)
        entry = only_file(tmp_path / "archive")
        assert (entry.first_offset, entry.last_offset) == (0, ROWS - 1)
        written = pq.ParquetFile(entry.path)

        records = RecordBuffer([journal.open_shard("s", 0).read_block(0, ROWS)])
        whole = build_table("s", 0, "json", records, TypedSchema("json", SCHEMA, 1, RESERVED))
        whole_file = encode_parquet(
            whole, row_group_rows=GROUP, metadata=Archiver._file_metadata("s", 0, 0, ROWS - 1))
        assert Path(entry.path).read_bytes() == whole_file  # footer entries included
        expected = pq.ParquetFile(pa.BufferReader(whole_file))

        assert written.metadata.num_row_groups == -(-ROWS // GROUP)
        assert [written.metadata.row_group(i).num_rows for i in range(written.metadata.num_row_groups)] \
            == [expected.metadata.row_group(i).num_rows for i in range(expected.metadata.num_row_groups)]
        assert written.schema_arrow == expected.schema_arrow
        assert written.schema_arrow.metadata == expected.schema_arrow.metadata
        assert written.read().equals(expected.read())
        table = written.read()
        assert table.column("offset").to_pylist() == list(range(ROWS))
        kept = [i for i, p in enumerate(table.column("payload").to_pylist()) if p is not None]
        assert kept == [i for i in range(ROWS) if i % 97 == 5]
    finally:
        journal.close()


async def test_the_first_row_group_is_encoded_before_the_last_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    lock = threading.Lock()
    real_build, real_write = archiver_module.build_table, FileEncoder.write

    def build_table_logged(stream: str, shard: int, schema: str, records: Any, *rest: Any) -> Any:
        with lock:
            events.append(f"build {records[0].offset}")
        return real_build(stream, shard, schema, records, *rest)

    def write_logged(self: FileEncoder, table: pa.Table, index: int | None = None) -> None:
        with lock:
            events.append(f"encode {table.column('offset')[0].as_py()}")
        real_write(self, table, index)

    monkeypatch.setattr(archiver_module, "build_table", build_table_logged)
    monkeypatch.setattr(FileEncoder, "write", write_logged)
    journal = JournalStorage(tmp_path / "journal", fsync="os")
    try:
        fill(journal)
        await archiver(journal, tmp_path / "archive").flush(timeout=30)
    finally:
        journal.close()
    parts = list(range(0, ROWS, GROUP))
    assert sorted(e for e in events if e.startswith("build")) == sorted(f"build {p}" for p in parts)
    # two parts are encoded at once: in any order, each once
    assert sorted(e for e in events if e.startswith("encode")) == sorted(f"encode {p}" for p in parts)
    # Up to BUILDS_AHEAD parts built ahead plus as many more may be queued before the first
    # encode; the last part is submitted only after that encode has finished, whatever the
    # threads' timing (a loaded machine started parts[3] first).
    assert events.index("encode 0") < events.index(f"build {parts[-1]}"), events


async def test_row_groups_are_built_while_the_file_is_still_being_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_build, real_seal = archiver_module.build_table, Archiver._seal

    def build_table_logged(stream: str, shard: int, schema: str, records: Any, *rest: Any) -> Any:
        events.append(f"build {records[0].offset}")
        return real_build(stream, shard, schema, records, *rest)

    async def seal_logged(self: Archiver, *args: Any) -> bool:
        events.append("seal")
        return await real_seal(self, *args)

    monkeypatch.setattr(archiver_module, "build_table", build_table_logged)
    monkeypatch.setattr(Archiver, "_seal", seal_logged)
    journal = JournalStorage(tmp_path / "journal", fsync="os")
    try:
        fill(journal)
        # journal reads of 100 records: the first row groups are whole long before the file
        await archiver(journal, tmp_path / "archive", read_batch=100).flush(timeout=30)
    finally:
        journal.close()
    assert events.index("build 0") < events.index("seal"), events
    parts = list(range(0, ROWS, GROUP))
    assert sorted(e for e in events if e.startswith("build")) == sorted(f"build {p}" for p in parts)
    table = pq.read_table(only_file(tmp_path / "archive").path)
    assert table.column("offset").to_pylist() == list(range(ROWS))


async def test_a_file_is_begun_before_its_last_record_is_read_and_ends_as_one_written_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row groups built while the buffer fills are encoded then, before the last offset
    (a footer entry) is known; the entries known only at the seal are added at the close, so
    that the file is the one written at once, and readers find the last offset in the footer
    and in the Arrow schema as before."""
    events: list[str] = []
    lock = threading.Lock()
    real_write, real_seal = FileEncoder.write, Archiver._seal

    def write_logged(self: FileEncoder, table: pa.Table, index: int | None = None) -> None:
        with lock:
            events.append(f"encode {table.column('offset')[0].as_py()}")
        real_write(self, table, index)

    async def seal_logged(self: Archiver, state: Any, *rest: Any) -> bool:
        begun = state.buffer.encoding
        assert begun is not None and begun.parts >= 1
        await asyncio.shield(begun.tail)  # handed over before the seal: it encodes meanwhile
        events.append("seal")
        return await real_seal(self, state, *rest)

    monkeypatch.setattr(FileEncoder, "write", write_logged)
    monkeypatch.setattr(Archiver, "_seal", seal_logged)
    journal = JournalStorage(tmp_path / "journal", fsync="os")
    try:
        fill(journal)
        await archiver(journal, tmp_path / "archive", read_batch=100).flush(timeout=30)
        records = RecordBuffer([journal.open_shard("s", 0).read_block(0, ROWS)])
        whole = build_table("s", 0, "json", records, TypedSchema("json", SCHEMA, 1, RESERVED))
    finally:
        journal.close()
    assert events.index("encode 0") < events.index("seal"), events
    assert sorted(e for e in events if e.startswith("encode")) == sorted(
        f"encode {p}" for p in range(0, ROWS, GROUP))
    path = only_file(tmp_path / "archive").path
    assert Path(path).read_bytes() == encode_parquet(
        whole, row_group_rows=GROUP, metadata=Archiver._file_metadata("s", 0, 0, ROWS - 1))
    for entries in (pq.read_metadata(path).metadata, pq.read_schema(path).metadata):
        assert entries[b"shardgate.first_offset"] == b"0"
        assert entries[b"shardgate.last_offset"] == str(ROWS - 1).encode()


async def test_a_part_that_fails_to_encode_before_the_seal_fails_the_file_which_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = FileEncoder.write
    failures: list[int] = []

    def write_failing_once(self: FileEncoder, table: pa.Table, index: int | None = None) -> None:
        if table.column("offset")[0].as_py() == 0 and not failures:  # the first part, once
            failures.append(0)
            raise MemoryError("a part could not be encoded")
        real_write(self, table, index)

    monkeypatch.setattr(FileEncoder, "write", write_failing_once)
    journal = JournalStorage(tmp_path / "journal", fsync="os")
    try:
        fill(journal)
        archive = archiver(journal, tmp_path / "archive", read_batch=100)
        await archive.flush(timeout=30)
    finally:
        journal.close()
    assert failures == [0]
    assert pq.read_table(only_file(tmp_path / "archive").path).column("offset").to_pylist() \
        == list(range(ROWS))
    assert archive.status()[0]["files"] == 1


async def test_parts_built_before_a_new_schema_version_are_built_again_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A version registered between a part's early build and the seal: the file is typed by
    the version the seal sees, in every row group, at the first attempt (parts of two
    versions would not make one file)."""
    wider = {"type": "object", "properties": {**SCHEMA["properties"], "site": {"type": "string"}}}
    registered = {"version": ("json", SCHEMA, 1)}
    real_seal = Archiver._seal

    async def seal_after_registering(self: Archiver, *args: Any) -> bool:
        registered["version"] = ("json", wider, 2)
        return await real_seal(self, *args)

    monkeypatch.setattr(Archiver, "_seal", seal_after_registering)
    journal = JournalStorage(tmp_path / "journal", fsync="os")
    try:
        fill(journal)
        archive = Archiver(journal, (tmp_path / "archive").as_uri(), lambda: [("s", 1, "json")],
                           ArchiveSettings(target_rows=ROWS, row_group_rows=GROUP,
                                           max_delay_s=3600, compaction=False, read_batch=100),
                           registered_schema=lambda _s: registered["version"])
        await archive.flush(timeout=30)
    finally:
        journal.close()
    written = pq.ParquetFile(only_file(tmp_path / "archive").path)
    assert written.schema_arrow.metadata[b"shardgate.schema.version"] == b"2"
    table = written.read()
    assert "site" in table.column_names and table.column("offset").to_pylist() == list(range(ROWS))
    assert table.column("device").null_count == ROWS // 97 + 1  # the "not json" payloads only
    assert "failed" not in caplog.text and archive.status()[0]["files"] == 1


async def test_a_part_that_fails_to_build_fails_the_file_which_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build = archiver_module.build_table
    failures: list[int] = []

    def build_table_failing_once(stream: str, shard: int, schema: str, records: Any,
                                 *rest: Any) -> Any:
        if records[0].offset == 2 * GROUP and not failures:
            failures.append(records[0].offset)
            raise MemoryError("a part could not be built")
        return real_build(stream, shard, schema, records, *rest)

    monkeypatch.setattr(archiver_module, "build_table", build_table_failing_once)
    journal = JournalStorage(tmp_path / "journal", fsync="os")
    try:
        fill(journal)
        archive = archiver(journal, tmp_path / "archive")
        await archive.flush(timeout=30)
    finally:
        journal.close()
    assert failures == [2 * GROUP]
    entry = only_file(tmp_path / "archive")
    assert pq.read_table(entry.path).column("offset").to_pylist() == list(range(ROWS))
    assert archive.status()[0]["files"] == 1


def test_a_record_buffer_splits_at_row_group_boundaries_inside_blocks(tmp_path: Path) -> None:
    journal = JournalStorage(tmp_path / "journal", fsync="os")
    try:
        fill(journal, 300)
        log = journal.open_shard("s", 0)
        buffer = RecordBuffer()
        for start in range(0, 300, 70):  # blocks of 70 records, cut by parts of 128
            buffer.extend(log.read_block(start, min(70, 300 - start)))
        parts = buffer.split(GROUP)
        assert [len(p) for p in parts] == [128, 128, 44]
        assert [r.offset for p in parts for r in p] == list(range(300))
        assert [r.data for p in parts for r in p] == [r.data for r in buffer]
    finally:
        journal.close()


def test_a_file_encoder_given_only_empty_parts_writes_the_empty_file() -> None:
    empty = build_table("s", 0, "bytes", [])
    encoder = FileEncoder(metadata={"shardgate.stream": "s"})
    encoder.write(empty)
    encoder.write(empty)
    data = encoder.finish({"shardgate.last_offset": "0"})
    assert data == encode_parquet(empty, metadata={"shardgate.stream": "s",
                                                   "shardgate.last_offset": "0"})
    assert pq.read_table(pa.BufferReader(data)).num_rows == 0
