"""Spark reads exactly the files `archive_files` names, also in the state an object-store
compaction passes through where a merged file is still staged beside the root and its inputs
are deleted (`storage.archive.compaction`): `read_archive_files` counts every row once, with
the partition columns and the typed columns, where `read.parquet(*files)` with the root as
`basePath` refuses the staged path and `read_archive` (which lists the root) counts short.

A local SparkSession reads a local archive laid out as that state leaves an object store
(the staged file written where `layout.staging_root` puts it, the inputs deleted): Spark
reaches S3 only through the hadoop-aws connector, which pyspark does not ship. The list of
files is the one the project's listing gives an object store in that state. Skipped only
when pyspark or Java is missing."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark")
# A local JVM's first jobs: minutes on a loaded 2-core machine (still bounded, to catch a hang)
pytestmark = pytest.mark.timeout(360)
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Java is not installed", allow_module_level=True)

from pyspark.errors import IllegalArgumentException  # noqa: E402
from shardgate.core.records import MessageRecord, encode_message  # noqa: E402
from shardgate.storage.archive import (  # noqa: E402
    Archiver,
    ArchiveSettings,
    archive_files,
    compaction,
    list_stream_files,
)
from shardgate.storage.archive.layout import merged_file_name, staging_root  # noqa: E402
from shardgate.storage.journal import JournalStorage  # noqa: E402
from shardgate.storage.spark import read_archive, read_archive_files  # noqa: E402

from tests.e2e.test_spark_archive import spark_session  # noqa: E402

HOUR = 3_600_000
T0 = 1_700_000_000_000 - 1_700_000_000_000 % HOUR  # 2023-11-14 22:00 UTC
SCHEMA = {"type": "object", "properties": {"device": {"type": "string"},
                                           "temp": {"type": "number"}}}
ROWS = 12


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as environment:  # for this module's tests only
        environment.setenv("SPARK_LOCAL_IP", "127.0.0.1")
        environment.setenv("PYSPARK_PYTHON", os.environ.get("PYSPARK_PYTHON", sys.executable))
        yield from spark_session(tmp_path_factory)


def archive(root: Path, journal_dir: Path) -> None:
    """Three files of four typed readings each, in one hour of shard 0 of `readings`."""

    async def run() -> None:
        journal = JournalStorage(journal_dir, fsync="os")
        try:
            journal.open_shard("readings", 0).append([
                (T0 + i, encode_message(MessageRecord(
                    f"sensors/d{i % 3}", b'{"device": "d%d", "temp": %d.5}' % (i % 3, i), 1,
                    False, T0 + i)))
                for i in range(ROWS)])
            await journal.flush()
            await Archiver(journal, root.as_uri(), lambda: [("readings", 1, "json")],
                           ArchiveSettings(target_rows=4, max_delay_s=3600, compaction=False),
                           registered_schema=lambda _s: ("json", SCHEMA, 1)).flush()
        finally:
            journal.close()

    asyncio.run(run())


def test_spark_reads_the_staged_merged_file_and_the_rest_each_row_once(
        spark: Any, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    archive(root, tmp_path / "journal")
    url = root.as_uri()
    from fsspec.implementations.local import LocalFileSystem

    fs = LocalFileSystem()
    files = list_stream_files(fs, str(root), "readings")
    assert [(f.first_offset, f.last_offset) for f in files] == [(0, 3), (4, 7), (8, 11)]
    assert sorted(archive_files(url, "readings")) == sorted(f.path for f in files)
    whole = read_archive_files(spark, url, "readings")
    assert whole.count() == ROWS

    # An object-store compaction of the first two files, stopped after the inputs' deletion:
    # the merged file is staged beside the root, and the listing names it and the third file.
    directory = files[0].path.rsplit("/", 1)[0]
    staged = f"{staging_root(str(root))}{directory[len(str(root)):]}/{merged_file_name(0, 0, 7)}"
    os.makedirs(staged.rsplit("/", 1)[0])
    Path(staged).write_bytes(compaction.merge(files[:2], "readings", 3, 1000))
    for entry in files[:2]:
        os.remove(entry.path)
    listed = [staged, files[2].path]

    frame = read_archive_files(spark, url, "readings", files=listed)
    rows = frame.select("offset", "stream", "date", "hour", "device", "temp").collect()
    assert sorted(row["offset"] for row in rows) == list(range(ROWS))
    assert {(row["stream"], str(row["date"]), row["hour"]) for row in rows} == {
        ("readings", "2023-11-14", 22)}
    assert {row["offset"]: (row["device"], row["temp"]) for row in rows} == {
        i: (f"d{i % 3}", i + 0.5) for i in range(ROWS)}
    assert dict(frame.dtypes)["temp"] == "double"
    assert frame.where("temp > 5").count() == ROWS - 5

    # what a plain read does with the same list, and with the root
    with pytest.raises(IllegalArgumentException, match="Wrong basePath"):
        spark.read.option("basePath", url).parquet(*[f"file://{path}" for path in listed]).count()
    assert read_archive(spark, url, "readings").count() == ROWS - 8
