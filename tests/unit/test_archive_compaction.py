"""Compaction of the archive: a shard's small files of an hour become files of the target size,
exactly once: readers that list and count the archive in a loop while compactions run (pyarrow
on the root, DuckDB's `**/*.parquet` glob) never count a message twice, and all of them after;
progress, tiered replay and a restart after a crash mid-compaction keep working."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from shardgate.core.records import MessageRecord, encode_message
from shardgate.storage.archive import (
    Archiver,
    ArchiveReader,
    ArchiveSettings,
    archive_files,
    compaction,
    list_stream_files,
)
from shardgate.storage.archive.layout import ArchiveFile
from shardgate.storage.journal import JournalStorage

HOUR = 3_600_000
T0 = 1_700_000_000_000 - 1_700_000_000_000 % HOUR  # 2023-11-14 22:00 UTC
SMALL = ArchiveSettings(target_rows=3, poll_interval_s=0.02, max_delay_s=3600,
                        compact_after_s=0, compact_interval_s=3600)


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[JournalStorage]:
    store = JournalStorage(tmp_path / "journal", fsync="os")
    yield store
    store.close()


async def fill(journal: JournalStorage, shards: int, hours: int, per_hour: int) -> int:
    for shard in range(shards):
        log = journal.open_shard("s", shard)
        log.append([
            (T0 + h * HOUR + i, encode_message(MessageRecord(
                f"s/{shard}", b'{"n": %d}' % i, 1, False, T0 + h * HOUR + i)))
            for h in range(hours) for i in range(per_hour)
        ])
    await journal.flush()
    return shards * hours * per_hour


def test_plan_merges_runs_of_small_files_up_to_the_target() -> None:
    def entry(first: int, size: int) -> ArchiveFile:
        return ArchiveFile(0, first, first + 9, f"/x/{first}", size)

    files = [entry(0, 10), entry(10, 10), entry(20, 100), entry(30, 30), entry(40, 30),
             entry(50, 30), entry(60, 5)]
    runs = compaction.plan(files, target_bytes=60)
    assert [[f.first_offset for f in run] for run in runs] == [[0, 10], [30, 40], [50, 60]]
    assert compaction.plan(files[:1], 60) == []


async def test_small_files_of_an_hour_become_one_file(journal: JournalStorage,
                                                      tmp_path: Path) -> None:
    root = tmp_path / "archive"
    total = await fill(journal, shards=2, hours=2, per_hour=10)
    archiver = Archiver(journal, root.as_uri(), lambda: [("s", 2, "json")], SMALL)
    await archiver.flush()
    before = list_stream_files(archiver.fs, archiver.root, "s")
    assert len(before) == 2 * 2 * 4  # 10 rows in files of 3: four files per shard and hour

    assert await archiver.compact() == len(before)
    after = list_stream_files(archiver.fs, archiver.root, "s")
    assert len(after) == 4 and all(e.path.endswith(".c.parquet") for e in after)
    assert pq.read_table(root).num_rows == total
    # The files the listing names, for any tool: the merged ones, of every stream or of one.
    assert archive_files(root.as_uri()) == archive_files(root.as_uri(), "s") == [
        e.path for e in after]
    assert archive_files(root.as_uri(), "other") == []
    assert await archiver.compact() == 0  # nothing small left
    assert not os.listdir(compaction.staging_root(str(root)))

    # Progress and tiered replay read merged files as any other.
    reader = ArchiveReader(root.as_uri())
    assert [r.offset for r in reader.read("s", 1, 5, 100)] == list(range(5, 20))
    await fill(journal, shards=1, hours=1, per_hour=2)
    await archiver.flush()
    assert archiver.archived_offset("s", 0) == 22


async def test_readers_counting_in_a_loop_never_count_twice_during_compactions(
        journal: JournalStorage, tmp_path: Path) -> None:
    duckdb = pytest.importorskip("duckdb")
    root = tmp_path / "archive"
    total = await fill(journal, shards=4, hours=12, per_hour=9)
    archiver = Archiver(journal, root.as_uri(), lambda: [("s", 4, "json")], SMALL)
    await archiver.flush()
    files = len(list_stream_files(archiver.fs, archiver.root, "s"))
    assert files == 4 * 12 * 3

    counts: list[tuple[str, int]] = []
    misses = []
    stop = threading.Event()

    def count_in_a_loop() -> None:
        connection = duckdb.connect()
        query = f"select count(*) from read_parquet('{root}/**/*.parquet', hive_partitioning=true)"
        while not stop.is_set():
            for name, read in (
                ("pyarrow", lambda: pq.read_table(root, columns=["offset"]).num_rows),
                ("duckdb", lambda: connection.sql(query).fetchall()[0][0]),
            ):
                try:
                    counts.append((name, read()))
                except (FileNotFoundError, OSError, duckdb.IOException) as exc:
                    misses.append(exc)  # listed before an exchange, opened after: list again

    reader = threading.Thread(target=count_in_a_loop)
    reader.start()
    try:
        replaced = 0
        for _ in range(48):  # one shard directory per round: many exchanges while reading
            listed = list_stream_files(archiver.fs, archiver.root, "s")
            directories = compaction.shard_directories(listed)
            small = [(d, e) for d, e in directories.items() if len(e) > 1]
            if not small:
                break
            directory, entries = small[0]
            replaced += await asyncio.to_thread(
                compaction.compact_directory, archiver.root, "s", directory, entries,
                SMALL.file_target_bytes)
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.to_thread(reader.join, 60)
    assert replaced == files
    # Never above the total. A reader that lists a shard directory as it is swapped may find
    # neither its old files nor the merged one (pyarrow skips an entry gone before its stat):
    # short for that moment, never twice.
    assert counts and max(count for _name, count in counts) <= total, (counts, misses)
    assert {name for name, _count in counts} == {"pyarrow", "duckdb"}
    connection = duckdb.connect()
    assert pq.read_table(root, columns=["offset"]).num_rows == total
    assert connection.sql(f"select count(*) from read_parquet('{root}/**/*.parquet', "
                          "hive_partitioning=true)").fetchall()[0][0] == total


async def test_a_crash_mid_compaction_leaves_nothing_a_reader_sees(journal: JournalStorage,
                                                                   tmp_path: Path) -> None:
    root = tmp_path / "archive"
    total = await fill(journal, shards=1, hours=1, per_hour=9)
    archiver = Archiver(journal, root.as_uri(), lambda: [("s", 1, "json")], SMALL)
    await archiver.flush()
    # What a compaction that died before its exchange leaves: a built directory in staging.
    leftover = Path(compaction.staging_root(str(root))) / "dead"
    leftover.mkdir(parents=True)
    entry = list_stream_files(archiver.fs, archiver.root, "s")[0]
    os.link(entry.path, leftover / os.path.basename(entry.path))
    assert pq.read_table(root).num_rows == total
    restarted = Archiver(journal, root.as_uri(), lambda: [("s", 1, "json")], SMALL)
    await restarted.start()
    await restarted.stop()
    assert not leftover.exists()
    assert pq.read_table(root).num_rows == total


async def test_a_flush_during_traffic_writes_one_file_per_shard(journal: JournalStorage,
                                                                tmp_path: Path) -> None:
    """A flush seals what was committed when it began: records that arrive during its upload
    wait for their own file, rather than become one more file of a row or two each."""
    import time

    root = tmp_path / "archive"
    settings = ArchiveSettings(poll_interval_s=3600, max_delay_s=3600, compaction=False)
    archiver = Archiver(journal, root.as_uri(), lambda: [("s", 1, "bytes")], settings)
    log = journal.open_shard("s", 0)
    stop = asyncio.Event()

    async def publish() -> None:
        while not stop.is_set():
            now = int(time.time() * 1000)
            log.append([(now, encode_message(MessageRecord("s/x", b"x", 1, False, now)))])
            await log.flush()
            await asyncio.sleep(0.002)

    producer = asyncio.create_task(publish())
    try:
        for flushes in range(1, 6):
            await asyncio.sleep(0.05)
            await archiver.flush()
            files = list_stream_files(archiver.fs, archiver.root, "s")
            assert len(files) == flushes, [f.last_offset - f.first_offset + 1 for f in files]
    finally:
        stop.set()
        await producer


async def test_the_readme_snippet_reads_the_files_archive_files_names(
        journal: JournalStorage, tmp_path: Path) -> None:
    """The README's snippet for counting exactly at any moment runs as printed (in a directory
    holding `shardgate-data/archive`): pyarrow and DuckDB count every row once."""
    import subprocess
    import sys

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("```python\nfrom pathlib import Path\nimport duckdb\n")
    code = readme[start + len("```python\n"):readme.index("```\n", start + 10)]
    root = tmp_path / "shardgate-data" / "archive"
    log = journal.open_shard("default", 0)
    log.append([(T0 + i, encode_message(MessageRecord("d", b"x", 1, False, T0 + i)))
                for i in range(7)])
    await journal.flush()
    archiver = Archiver(journal, root.as_uri(), lambda: [("default", 1, "bytes")], SMALL)
    await archiver.flush()
    assert await archiver.compact() == 3  # (files of 3, 3 and 1 rows become one)
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code], cwd=tmp_path,
                                   capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["7", "7"]
