"""A Parquet file stitched from parts encoded apart (`footer.stitch`, `FileEncoder`) is byte for
byte the file one writer writes of the whole table: for tables of every column kind the archive
writes (strings with dictionary pages, nested structs, lists and maps, all-null columns), parts
of one or many row groups (more than 15: the long form of Thrift's list header), and parts
encoded on several threads in any order, and parts whose columns of nulls only (a message's
unused fields) are taken from a part of those columns encoded once for as many rows. Readers
(pyarrow, DuckDB) read it as that file."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shardgate.core.records import MessageRecord, encode_message
from shardgate.storage.archive import columns
from shardgate.storage.archive.columns import (
    PARQUET_OPTIONS,
    RESERVED,
    FileEncoder,
    _file_schema,
    _footer_entries,
    build_table,
    encode_parquet,
)
from shardgate.storage.archive.footer import FooterError, stitch
from shardgate.storage.archive.typed import TypedSchema
from shardgate.storage.interfaces import StoredRecord

SCHEMA = {"type": "object", "properties": {
    "device": {"type": "string"}, "temp": {"type": "number"}, "count": {"type": "integer"},
    "pos": {"type": "object", "properties": {"lat": {"type": "number"}}},
    "tags": {"type": "array", "items": {"type": "string"}}}}
START = {"shardgate.stream": "s", "shardgate.shard": "0", "shardgate.first_offset": "0"}


def records(count: int) -> list[StoredRecord]:
    out = []
    for i in range(count):
        payload = (b"not json" if i % 31 == 3 else json.dumps({
            "device": f"d{i % 7}", "temp": i / 4, "count": i,
            "pos": {"lat": i / 8} if i % 5 else None, "tags": [str(i % 3)] * (i % 4)}).encode())
        message = MessageRecord(
            f"t/{i % 5}", payload, i % 3, i % 2 == 0, 1_000 + i, producer_id=f"p{i % 4}",
            headers=[("h", str(i))] if i % 6 == 0 else None,
            native_properties={"n": b"v"} if i % 9 == 0 else None)
        out.append(StoredRecord(i, 1_000 + i, encode_message(message)))
    return out


def table(count: int, typed: bool = True) -> pa.Table:
    schema = TypedSchema("json", SCHEMA, 1, RESERVED) if typed else None
    return build_table("s", 0, "json", records(count), schema)


def part(rows: pa.Table, group: int) -> bytes:
    sink = pa.BufferOutputStream()
    writer = pq.ParquetWriter(sink, _file_schema(rows.schema, START),
                              compression_level=3, **PARQUET_OPTIONS)
    writer.write_table(rows, row_group_size=group)
    writer.close()
    return sink.getvalue().to_pybytes()


def template(schema: pa.Schema, entries: dict[str, str]) -> bytes:
    sink = pa.BufferOutputStream()
    writer = pq.ParquetWriter(sink, _file_schema(schema, START), compression_level=3,
                              **PARQUET_OPTIONS)
    writer.add_key_value_metadata(_footer_entries(_file_schema(schema, entries)))
    writer.close()
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize(("rows", "group", "per_part", "typed"), [
    (1000, 128, 1, True), (1000, 128, 3, True), (700, 10, 20, False), (1, 64, 1, True),
])
def test_stitched_parts_are_the_file_written_at_once(rows: int, group: int, per_part: int,
                                                      typed: bool) -> None:
    whole = table(rows, typed)
    entries = {**START, "shardgate.last_offset": str(rows - 1)}
    expected = encode_parquet(whole, row_group_rows=group, metadata=entries)
    step = group * per_part
    parts = [part(whole.slice(start, step), group) for start in range(0, rows, step)]
    stitched = stitch(parts, template(whole.schema, entries))
    assert stitched == expected
    assert pq.read_table(pa.BufferReader(stitched)).equals(whole)


@pytest.mark.parametrize("cached_nulls_from", [1, 10**9])
def test_a_file_encoder_stitches_parts_encoded_on_threads_in_any_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached_nulls_from: int
) -> None:
    monkeypatch.setattr(columns, "CACHED_NULLS_FROM", cached_nulls_from)
    whole = table(1000)
    entries = {"shardgate.last_offset": "999"}
    encoder = FileEncoder(row_group_rows=128, metadata=START)
    slices = [(index, whole.slice(start, 128)) for index, start in enumerate(range(0, 1000, 128))]
    threads = [threading.Thread(target=encoder.write, args=(rows, index))
               for index, rows in reversed(slices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    data = encoder.finish(entries)
    assert data == encode_parquet(whole, row_group_rows=128, metadata={**START, **entries})
    path = tmp_path / "stitched.parquet"
    path.write_bytes(data)
    duckdb = pytest.importorskip("duckdb")
    assert duckdb.sql(f"select count(*), sum(temp), max(\"offset\") from '{path}'").fetchall()[0] == (
        1000, pytest.approx(sum(i / 4 for i in range(1000) if i % 31 != 3)), 999)
    assert pq.read_metadata(path).metadata[b"shardgate.last_offset"] == b"999"


def test_a_file_encoder_refuses_a_part_of_another_schema() -> None:
    encoder = FileEncoder(metadata=START)
    encoder.write(table(10))
    with pytest.raises(ValueError, match="another schema"):
        encoder.write(table(10, typed=False))


def test_what_is_not_a_parquet_file_is_refused() -> None:
    done = template(table(1).schema, START)
    with pytest.raises(FooterError):
        stitch([b"PAR1 not a footer PAR1"], done)
    good = part(table(10), 64)
    size = int.from_bytes(good[-8:-4], "little")
    for keep in (1, 7, 40):  # a footer garbled from `keep` on (before its row groups end)
        cut = (good[:-8 - size] + good[-8 - size:-8 - size + keep] + b"\xff" * (size - keep)
               + good[-8:])
        with pytest.raises(FooterError):
            stitch([cut], done)


def test_columns_of_nulls_are_encoded_once_for_parts_of_as_many_rows(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(columns, "CACHED_NULLS_FROM", 1)
    monkeypatch.setattr(columns, "_REPEATED_PARTS", {})
    whole = table(1000, typed=False)  # key, correlation data, ... are null in every row
    assert [name for name in whole.column_names if whole.column(name).null_count == 1000]
    encoder = FileEncoder(row_group_rows=100, metadata=START)
    for index, start in enumerate(range(0, 1000, 100)):
        encoder.write(whole.slice(start, 100), index)
    assert len(columns._REPEATED_PARTS) == 1  # ten parts of 100 rows: one part of them
    assert encoder.finish() == encode_parquet(whole, row_group_rows=100, metadata=START)


def test_a_footer_that_cannot_be_stitched_is_encoded_by_one_writer(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should a part's footer hold what the stitching does not know (a later pyarrow), the
    file is still written: the parts are read back and encoded at once, the same bytes."""
    def refuse(*_args: object) -> bytes:
        raise FooterError("not known here")

    monkeypatch.setattr(columns, "CACHED_NULLS_FROM", 1)
    monkeypatch.setattr(columns.footer, "stitch", refuse)
    monkeypatch.setattr(columns.footer, "merge_columns", refuse)
    whole = table(1000)
    encoder = FileEncoder(row_group_rows=128, metadata=START)
    for index, start in enumerate(range(0, 1000, 128)):
        encoder.write(whole.slice(start, 128), index)
    entries = {"shardgate.last_offset": "999"}
    assert encoder.finish(entries) == encode_parquet(
        whole, row_group_rows=128, metadata={**START, **entries})


def test_columns_of_one_value_are_encoded_once_and_the_file_is_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A column holding one value in every row of a part (the shard, a QoS, a protocol) is
    taken from a part of such columns encoded once; a column that differs in a single row, a
    float column (0.0 and -0.0 are equal but other bytes) and parts of other values are not
    mistaken for it: the file is byte for byte the one written at once."""
    monkeypatch.setattr(columns, "CACHED_NULLS_FROM", 1)
    monkeypatch.setattr(columns, "_REPEATED_PARTS", {})
    rows = 1000
    almost = ["same"] * rows
    almost[337] = "other"  # neither the first, the middle nor the last row
    stamp = pa.timestamp("ms", tz="UTC")
    whole = pa.table({
        "shard": pa.array([7] * 500 + [8] * 500, pa.int32()),
        "offset": pa.array(range(rows), pa.int64()),
        "retain": pa.array([False] * rows),
        "at": pa.array([1_700_000_000_000] * rows, stamp),
        "protocol": pa.array(["mqtt"] * rows),
        "key": pa.array([b"k"] * rows),
        "almost": pa.array(almost),
        "zero": pa.array([0.0, -0.0] * (rows // 2)),
        "unused": pa.nulls(rows, pa.string()),
    })
    encoder = FileEncoder(row_group_rows=100, metadata=START)
    for index, start in enumerate(range(0, rows, 100)):
        encoder.write(whole.slice(start, 100), index)
    # two parts' values (shard 7, then 8) for every part of 100 rows, almost's part apart
    assert len(columns._REPEATED_PARTS) == 3
    cached = columns._cacheable_columns(whole.slice(300, 100))
    assert [whole.column_names[i] for i in cached] == ["shard", "retain", "at", "protocol",
                                                      "key", "unused"]
    data = encoder.finish()
    assert data == encode_parquet(whole, row_group_rows=100, metadata=START)
    assert pq.read_table(pa.BufferReader(data)).equals(whole)
