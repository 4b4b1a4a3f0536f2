"""The archiver and the archive reader against a real S3 API on loopback (`moto_server`)
through s3fs: uploads, layout, restart without duplicates, and a missing bucket refused at
start with a clear error."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
boto3 = pytest.importorskip("boto3")

from shardgate.core.records import MessageRecord, encode_message  # noqa: E402
from shardgate.storage.archive import (  # noqa: E402
    ArchiveConfigError,
    Archiver,
    ArchiveReader,
    ArchiveSettings,
)
from shardgate.storage.journal import JournalStorage  # noqa: E402

T0 = 1_700_000_000_000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    if shutil.which("moto_server") is None:
        pytest.skip("moto_server (moto[server]) is not installed")
    port = free_port()
    process = subprocess.Popen(
        ["moto_server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                pytest.fail("moto_server did not start")
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(10)


@pytest.fixture
def bucket(moto_endpoint: str, request: pytest.FixtureRequest) -> str:
    name = "archive-" + request.node.name.replace("_", "-")[:40].lower().strip("-")
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket=name)
    return name


def settings(endpoint: str, **overrides: object) -> ArchiveSettings:
    values: dict[str, object] = {"target_rows": 40, **overrides}
    return ArchiveSettings(
        endpoint_url=endpoint, region="us-east-1", access_key_id="testing",
        secret_access_key="testing", retry_initial_s=0.05, retry_max_s=0.2,
        **values,  # type: ignore[arg-type]
    )


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[JournalStorage]:
    store = JournalStorage(tmp_path / "journal", fsync="os")
    yield store
    store.close()


async def append(journal: JournalStorage, count: int) -> list[bytes]:
    log = journal.open_shard("sensors", 0)
    first = log.next_offset
    data = [encode_message(MessageRecord(f"s/{first + i}", b"p%d" % (first + i), 1, False, T0 + i))
            for i in range(count)]
    log.append([(T0 + i, item) for i, item in enumerate(data)])
    await log.flush()
    return data


async def test_archive_to_s3_and_read_back_without_duplicates_after_restart(
        journal: JournalStorage, moto_endpoint: str, bucket: str) -> None:
    url = f"s3://{bucket}/shardgate/archive"
    first_batch = await append(journal, 100)
    archiver = Archiver(journal, url, lambda: [("sensors", 1, "bytes")], settings(moto_endpoint))
    await archiver.start()
    await archiver.stop(flush=True)

    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == [
        "shardgate/archive/stream=sensors/date=2023-11-14/hour=22/shard0000/"
        f"shard0000-{a:020d}-{b:020d}.parquet" for a, b in ((0, 39), (40, 79), (80, 99))
    ]

    # Restart: progress comes from the object listing, not from local state.
    second_batch = await append(journal, 30)
    again = Archiver(journal, url, lambda: [("sensors", 1, "bytes")], settings(moto_endpoint))
    await again.start()
    assert again.archived_offset("sensors", 0) == 100
    await again.stop(flush=True)
    status = again.status()[0]
    assert status["files"] == 4 and status["lag_records"] == 0

    reader = ArchiveReader(url, settings(moto_endpoint))
    records = reader.read("sensors", 0, 0, 1000)
    assert [r.offset for r in records] == list(range(130))
    assert [r.data for r in records] == first_batch + second_batch
    assert [r.offset for r in reader.read("sensors", 0, 95, 10)] == list(range(95, 105))


async def test_missing_bucket_is_refused_at_start(
        journal: JournalStorage, moto_endpoint: str) -> None:
    archiver = Archiver(journal, "s3://no-such-bucket/x", lambda: [("sensors", 1, "bytes")],
                        settings(moto_endpoint))
    with pytest.raises(ArchiveConfigError, match="no-such-bucket.*does not exist"):
        await archiver.start()


async def test_unreachable_endpoint_does_not_fail_start_and_shows_in_status(
        journal: JournalStorage) -> None:
    await append(journal, 5)
    dead = f"http://127.0.0.1:{free_port()}"
    archiver = Archiver(
        journal, "s3://bucket/x", lambda: [("sensors", 1, "bytes")],
        settings(dead, storage_options={"config_kwargs": {"connect_timeout": 0.2,
                                                          "retries": {"max_attempts": 1}}}),
    )
    await archiver.start()
    await archiver.stop(flush=False)
    [status] = archiver.status()
    assert status["archived_next"] is None and status["last_error"]
    assert archiver.archived_offset("sensors", 0) == 0


async def test_compaction_on_s3_merges_small_files_and_readers_never_count_twice(
        journal: JournalStorage, moto_endpoint: str, bucket: str) -> None:
    """On an object store the merged file is uploaded first and hides the files its name
    covers from the project's listing (the archiver, tiered replay) at once; then the inputs
    are deleted. A reader counting through that listing in a loop never counts a row twice."""
    import threading

    import pyarrow.parquet as pq
    from shardgate.storage.archive import compaction, list_stream_files

    url = f"s3://{bucket}/archive"
    data = await append(journal, 60)
    small = settings(moto_endpoint, target_rows=4, compact_after_s=0, compact_interval_s=3600)
    archiver = Archiver(journal, url, lambda: [("sensors", 1, "bytes")], small)
    await archiver.start()
    await archiver.flush()
    assert len(list_stream_files(archiver.fs, archiver.root, "sensors")) == 15

    counts: list[int] = []
    misses: list[BaseException] = []
    stop = threading.Event()
    reader = ArchiveReader(url, small)

    def count_in_a_loop() -> None:
        while not stop.is_set():
            try:
                files = list_stream_files(reader.fs, reader.root, "sensors")
                counts.append(sum(pq.read_metadata(f.path, filesystem=reader.fs).num_rows
                                  for f in files))
            except FileNotFoundError as exc:
                misses.append(exc)  # listed before a delete, opened after: list again

    thread = threading.Thread(target=count_in_a_loop)
    thread.start()
    try:
        # runs of five files first (several uploads and deletes while the reader counts)
        files = list_stream_files(archiver.fs, archiver.root, "sensors")
        replaced = 0
        for start in range(0, 15, 5):
            run = files[start:start + 5]
            replaced += await asyncio.to_thread(
                compaction.compact_object_store, archiver.fs, "sensors", run,
                sum(f.size for f in run) + 1)
        assert replaced == 15
        # the archiver's own round merges the three merged files into one
        assert await archiver.compact() == 3
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 60)
    await archiver.stop(flush=True)
    assert counts and set(counts) == {60}, (sorted(set(counts)), misses[:3])
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert [key.rsplit("/", 1)[-1] for key in keys] == [
        f"shard0000-{0:020d}-{59:020d}.c.parquet"]
    assert [r.data for r in ArchiveReader(url, small).read("sensors", 0, 0, 100)] == data
    # progress after a restart comes from the merged file's name
    again = Archiver(journal, url, lambda: [("sensors", 1, "bytes")], small)
    await again.start()
    assert again.archived_offset("sensors", 0) == 60
    await again.stop(flush=False)


async def test_a_compaction_stopped_between_upload_and_delete_is_finished_later(
        journal: JournalStorage, moto_endpoint: str, bucket: str) -> None:
    from shardgate.storage.archive import compaction, list_stream_files
    from shardgate.storage.archive.layout import merged_file_name

    url = f"s3://{bucket}/archive"
    await append(journal, 12)
    small = settings(moto_endpoint, target_rows=4, compact_after_s=0, compact_interval_s=3600)
    archiver = Archiver(journal, url, lambda: [("sensors", 1, "bytes")], small)
    await archiver.start()
    await archiver.flush()
    files = list_stream_files(archiver.fs, archiver.root, "sensors")
    directory = files[0].path.rsplit("/", 1)[0]
    # the merged file of the first two uploaded, its inputs not deleted (a crash in between)
    archiver.fs.pipe_file(f"{directory}/{merged_file_name(0, 0, 7)}",
                          compaction.merge(files[:2], "sensors", 3, 1000, archiver.fs))
    listed = list_stream_files(archiver.fs, archiver.root, "sensors")
    assert [(f.first_offset, f.last_offset) for f in listed] == [(0, 7), (8, 11)]
    assert len(list_stream_files(archiver.fs, archiver.root, "sensors", include_superseded=True)) == 4
    assert compaction.remove_superseded(archiver.fs, archiver.root, "sensors") == 2
    assert len(list_stream_files(archiver.fs, archiver.root, "sensors", include_superseded=True)) == 2
    reader = ArchiveReader(url, small)
    assert [r.offset for r in reader.read("sensors", 0, 0, 100)] == list(range(12))
    await archiver.stop(flush=False)
