"""One archive root that every reader opens without options: pyarrow (`pq.read_table`,
`pyarrow.dataset`), pandas, DuckDB and polars read the whole archive, or one stream, with the
partition columns typed once and no warning; files of the older format (a `stream` column
beside the `stream=` directory) are rewritten in place and read the same. The broker-level
run, with Spark, is tests/e2e/test_spark_archive.py."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from shardgate.core.records import MessageRecord, encode_message
from shardgate.storage.archive import Archiver, ArchiveSettings, list_stream_files
from shardgate.storage.archive.columns import ARROW_SCHEMA
from shardgate.storage.journal import JournalStorage

HOUR = 3_600_000
T0 = 1_700_000_000_000 - 1_700_000_000_000 % HOUR  # 2023-11-14 22:00 UTC
FAST = ArchiveSettings(target_rows=50, poll_interval_s=0.02, max_delay_s=3600)


async def build_archive(journal: JournalStorage, url: str) -> int:
    """180 JSON readings over three hours (one crossing midnight) and a stream named `007`."""
    readings = journal.open_shard("history", 0)
    readings.append([
        (T0 + i * 60_000, encode_message(MessageRecord(
            f"history/dev-{i % 3}", b'{"temperature": %d}' % i, 1, False, T0 + i * 60_000)))
        for i in range(180)
    ])
    journal.open_shard("007", 0).append(
        [(T0, encode_message(MessageRecord("007/x", b"bond", 0, False, T0)))])
    await journal.flush()
    archiver = Archiver(journal, url, lambda: [("history", 1, "json"), ("007", 1, "string")],
                        FAST)
    await archiver.flush()
    return 181


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[JournalStorage]:
    store = JournalStorage(tmp_path / "journal", fsync="os")
    yield store
    store.close()


@pytest.fixture(autouse=True)
def warnings_are_errors() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


async def test_pyarrow_and_pandas_read_the_root_and_one_stream(journal: JournalStorage,
                                                               tmp_path: Path) -> None:
    import pandas as pd

    root = tmp_path / "archive"
    total = await build_archive(journal, root.as_uri())

    table = pq.read_table(root)
    assert table.num_rows == total
    assert table.column_names.count("stream") == 1
    assert set(table.column("stream").to_pylist()) == {"history", "007"}
    assert sorted(set(table.column("hour").to_pylist())) == [0, 22, 23]
    dataset = ds.dataset(root, partitioning="hive")
    assert dataset.count_rows() == total
    assert dataset.to_table(filter=ds.field("stream") == "007").num_rows == 1

    frame = pd.read_parquet(root)
    assert len(frame) == total and set(frame["stream"]) == {"history", "007"}
    one = pd.read_parquet(root / "stream=history")
    assert len(one) == 180 and sorted(one["offset"]) == list(range(180))


async def test_duckdb_reads_the_glob_with_hive_partitions_typed(journal: JournalStorage,
                                                                tmp_path: Path) -> None:
    duckdb = pytest.importorskip("duckdb")
    root = tmp_path / "archive"
    total = await build_archive(journal, root.as_uri())
    source = f"read_parquet('{root}/**/*.parquet', hive_partitioning=true)"
    [(count, rows)] = duckdb.sql(
        f"select count(*), count(distinct (stream, shard, \"offset\")) from {source}").fetchall()
    assert count == rows == total
    types = dict(duckdb.sql(f"select column_name, column_type from (describe select * from {source})")
                 .fetchall())
    assert types["stream"] == "VARCHAR" and types["date"] == "DATE" and types["hour"] == "BIGINT"
    assert types["payload"] == "BLOB" and types["publish_time"] == "TIMESTAMP WITH TIME ZONE"
    per_hour = duckdb.sql(
        f"select hour, count(*) from {source} where stream = 'history' group by 1 order by 1"
    ).fetchall()
    assert per_hour == [(0, 60), (22, 60), (23, 60)]


async def test_polars_reads_the_glob_with_hive_partitions(journal: JournalStorage,
                                                          tmp_path: Path) -> None:
    pl = pytest.importorskip("polars")
    root = tmp_path / "archive"
    total = await build_archive(journal, root.as_uri())
    frame = pl.read_parquet(f"{root}/**/*.parquet", hive_partitioning=True)
    assert frame.height == total
    assert frame.schema["stream"] == pl.String and frame.schema["hour"] in (pl.Int64, pl.Int32)
    assert frame.filter(pl.col("stream") == "007").height == 1


async def test_older_files_are_rewritten_in_place_and_archiving_continues(
        journal: JournalStorage, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    # A file as the archiver wrote it before: directly in the hour directory (hour=22, with
    # a leading zero where it has one), with a `stream` column, format 2.
    old_dir = root / "stream=history" / "date=2023-11-14" / "hour=22"
    old_dir.mkdir(parents=True)
    journal.open_shard("history", 0).append([
        (T0 + i, encode_message(MessageRecord("history/x", b"{}", 0, False, T0 + i)))
        for i in range(10)
    ])
    await journal.flush()
    from shardgate.storage.archive.columns import build_table

    table = build_table("history", 0, "json", journal.open_shard("history", 0).read(0, 5))
    legacy = table.add_column(0, "stream", pa.array(["history"] * 5, pa.string()))
    legacy_path = old_dir / "shard0000-00000000000000000000-00000000000000000004.parquet"
    pq.write_table(legacy.replace_schema_metadata({"shardgate.archive.format": "2"}), legacy_path)
    with pytest.raises(pa.ArrowTypeError):
        pq.read_table(root)  # what the older format did to readers of the root

    archiver = Archiver(journal, root.as_uri(), lambda: [("history", 1, "json")], FAST)
    await archiver.flush()  # continues after the older file: offsets 5..9
    assert await archiver.upgrade() == 1
    assert await archiver.upgrade() == 0  # once per process
    whole = pq.read_table(root)
    assert sorted(whole.column("offset").to_pylist()) == list(range(10))
    assert pq.read_schema(legacy_path).equals(ARROW_SCHEMA)
    assert [e.first_offset for e in list_stream_files(archiver.fs, archiver.root, "history")] == [0, 5]
