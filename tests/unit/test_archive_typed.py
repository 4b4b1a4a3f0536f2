"""Typed columns: a stream with a registered schema is archived with one column per field
(objects as structs, arrays as lists), without the payload bytes unless asked; tiered replay
rebuilds the payloads (Avro byte for byte); a second schema version adds nullable columns that
pyarrow reads across files; compaction never merges files of two versions."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastavro
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from shardgate.core.records import MessageRecord, encode_message
from shardgate.storage.archive import Archiver, ArchiveReader, ArchiveSettings, list_stream_files
from shardgate.storage.journal import JournalStorage

HOUR = 3_600_000
T0 = 1_700_000_000_000 - 1_700_000_000_000 % HOUR
V1 = {"type": "object", "properties": {
    "device": {"type": "string"}, "temp": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "pos": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}},
    "offset": {"type": "integer"}}}
V2 = {**V1, "properties": {**V1["properties"], "humidity": {"type": ["number", "null"]}}}
AVRO = {"type": "record", "name": "Reading", "fields": [
    {"name": "device", "type": "string"}, {"name": "temp", "type": "double"},
    {"name": "count", "type": "long"}]}
SETTINGS = ArchiveSettings(poll_interval_s=0.02, max_delay_s=3600, compact_after_s=0)


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[JournalStorage]:
    store = JournalStorage(tmp_path / "journal", fsync="os")
    yield store
    store.close()


async def append(journal: JournalStorage, payloads: list[bytes], ts: int = T0) -> None:
    log = journal.open_shard("readings", 0)
    log.append([(ts + i, encode_message(MessageRecord("readings/d", p, 1, False, ts + i)))
                for i, p in enumerate(payloads)])
    await log.flush()


def reading(i: int, **extra: Any) -> bytes:
    return json.dumps({"device": f"d{i % 2}", "temp": 20.0 + i, "tags": ["a", str(i)],
                       "pos": {"lat": 1.5, "lon": -i}, "offset": i, **extra}).encode()


async def test_json_fields_become_typed_columns_and_payloads_are_not_kept_twice(
        journal: JournalStorage, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    payloads = [reading(i) for i in range(5)] + [b"not json: published before the schema"]
    await append(journal, payloads)
    archiver = Archiver(journal, root.as_uri(), lambda: [("readings", 1, "bytes")], SETTINGS,
                        registered_schema=lambda s: ("json", V1, 1))
    await archiver.flush()

    table = pq.read_table(root / "stream=readings")
    types = {f.name: f.type for f in table.schema}
    assert types["temp"] == pa.float64() and types["device"] == pa.string()
    assert types["tags"] == pa.list_(pa.string())
    assert types["pos"] == pa.struct([("lat", pa.float64()), ("lon", pa.float64())])
    assert types["value_offset"] == pa.int64()  # a field named like an archive column
    rows = table.sort_by("offset").to_pylist()
    assert [r["temp"] for r in rows[:5]] == [20.0, 21.0, 22.0, 23.0, 24.0]
    assert rows[2]["pos"] == {"lat": 1.5, "lon": -2.0} and rows[2]["tags"] == ["a", "2"]
    assert all(r["payload"] is None and r["payload_json"] is None for r in rows[:5])
    assert rows[5]["payload"] == payloads[5] and rows[5]["temp"] is None
    hot = ds.dataset(root / "stream=readings", partitioning="hive").to_table(
        filter=ds.field("temp") > 22)
    assert hot.num_rows == 2

    # Tiered replay gives back the same documents (compact JSON) and the untyped bytes.
    replayed = ArchiveReader(root.as_uri()).read("readings", 0, 0, 100)
    from shardgate.core.records import decode_message

    back = [decode_message(r.data).payload for r in replayed]
    assert [json.loads(p) for p in back[:5]] == [json.loads(p) for p in payloads[:5]]
    assert back[5] == payloads[5]


async def test_avro_payloads_replay_byte_for_byte(journal: JournalStorage, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    parsed = fastavro.parse_schema(AVRO)
    payloads = []
    for i in range(4):
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, {"device": f"d{i}", "temp": i / 3, "count": 2**40 + i})
        payloads.append(out.getvalue())
    await append(journal, payloads)
    archiver = Archiver(journal, root.as_uri(), lambda: [("readings", 1, "bytes")], SETTINGS,
                        registered_schema=lambda s: ("avro", AVRO, 1))
    await archiver.flush()
    table = pq.read_table(root / "stream=readings")
    assert table.schema.field("count").type == pa.int64()
    assert table.column("payload").null_count == 4
    from shardgate.core.records import decode_message

    replayed = ArchiveReader(root.as_uri()).read("readings", 0, 0, 100)
    assert [decode_message(r.data).payload for r in replayed] == payloads


async def test_keep_typed_payload_keeps_the_bytes(journal: JournalStorage, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    await append(journal, [reading(1)])
    settings = ArchiveSettings(max_delay_s=3600, keep_typed_payload=True)
    archiver = Archiver(journal, root.as_uri(), lambda: [("readings", 1, "bytes")], settings,
                        registered_schema=lambda s: ("json", V1, 1))
    await archiver.flush()
    [row] = pq.read_table(root / "stream=readings").to_pylist()
    assert row["payload"] == reading(1) and row["temp"] == 21.0


async def test_a_second_version_adds_a_nullable_column_read_across_files(
        journal: JournalStorage, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    version = {"now": 1}

    def registered(stream: str) -> tuple[str, Any, int]:
        return ("json", V1 if version["now"] == 1 else V2, version["now"])

    archiver = Archiver(journal, root.as_uri(), lambda: [("readings", 1, "bytes")], SETTINGS,
                        registered_schema=registered)
    await append(journal, [reading(i) for i in range(3)])
    await archiver.flush()
    version["now"] = 2
    await append(journal, [reading(i, humidity=40.0 + i) for i in range(3, 6)], ts=T0 + 10)
    await archiver.flush()
    files = list_stream_files(archiver.fs, archiver.root, "readings")
    assert len(files) == 2
    schemas = [pq.read_schema(f.path) for f in files]
    unified = pa.unify_schemas(schemas)
    assert unified.field("humidity").nullable
    table = ds.dataset(root / "stream=readings", schema=unified, partitioning="hive").to_table()
    humidity = dict(zip(table.column("offset").to_pylist(), table.column("humidity").to_pylist(),
                        strict=True))
    assert humidity == {0: None, 1: None, 2: None, 3: 43.0, 4: 44.0, 5: 45.0}
    # Compaction keeps the two versions apart (payloads are rebuilt with a file's own schema).
    assert await archiver.compact(now_ms=T0 + 10 * HOUR) == 0
