"""The archiver and the archive reader against a real S3 API on loopback (`moto_server`)
through s3fs: uploads, layout, restart without duplicates, and a missing bucket refused at
start with a clear error."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs")
boto3 = pytest.importorskip("boto3")

from fsspec import AbstractFileSystem  # noqa: E402
from shardgate.core.records import MessageRecord, encode_message  # noqa: E402
from shardgate.storage.archive import (  # noqa: E402
    ArchiveConfigError,
    Archiver,
    ArchiveReader,
    ArchiveSettings,
)
from shardgate.storage.journal import JournalStorage  # noqa: E402

T0 = 1_700_000_000_000
BUCKETS = itertools.count()


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
    name = ("archive-" + request.node.name.replace("_", "-")[:40].lower().strip("-")
            + f"-{next(BUCKETS)}")  # (parametrized tests share the start of their names)
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


def plain_readers(endpoint: str, bucket: str) -> list[tuple[str, Callable[[], int]]]:
    """Tools that list the root themselves, with no knowledge of the project's layout:
    pyarrow's own S3 filesystem and pandas through s3fs."""
    import pandas as pd
    import pyarrow.dataset as ds
    from pyarrow import fs as pafs

    s3 = pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1",
                           endpoint_override=endpoint.removeprefix("http://"), scheme="http")
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
               "use_listings_cache": False}
    return [
        ("pyarrow.dataset", lambda: ds.dataset(f"{bucket}/archive", filesystem=s3,
                                               partitioning="hive").count_rows()),
        ("pandas", lambda: len(pd.read_parquet(f"s3://{bucket}/archive", columns=["offset"],
                                               storage_options=options))),
    ]


class CountingReaders:
    """Readers that count the archive's rows in a loop on a thread, each as it lists it: the
    project's listing, pyarrow reading the files `archive_files` names, and the plain tools
    (`plain_readers`). A file deleted between a listing
    and its read is a miss: the reader lists again."""

    def __init__(self, url: str, small: ArchiveSettings, endpoint: str, bucket: str) -> None:
        import pyarrow.parquet as pq
        from shardgate.storage.archive import list_stream_files

        reader = ArchiveReader(url, small)

        def project() -> int:
            files = list_stream_files(reader.fs, reader.root, "sensors")
            return sum(pq.read_metadata(f.path, filesystem=reader.fs).num_rows for f in files)

        def listed() -> int:  # a plain tool given the files the project's listing names
            import pyarrow.dataset as ds
            from shardgate.storage.archive import archive_files

            return ds.dataset(archive_files(url, "sensors", small), filesystem=reader.fs,
                              partitioning="hive").count_rows()

        self.readers = [("project", project), ("archive_files", listed),
                        *plain_readers(endpoint, bucket)]
        self.root = f"{bucket}/archive"
        self.counts: dict[str, list[int]] = {name: [] for name, _read in self.readers}
        self.misses: list[BaseException] = []
        self.steps = 0
        self.calls: list[str] = []
        self._generation = 0
        """Incremented at each step; each reader notes it when it begins to count."""
        self._latest = {name: -1 for name, _read in self.readers}
        self._counted = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop)

    def _loop(self) -> None:
        import pyarrow as pa

        while not self._stop.is_set():
            for name, read in self.readers:
                generation = self._generation
                try:
                    count = read()
                except FileNotFoundError as exc:
                    if str(exc).rstrip("/") != self.root:
                        self.misses.append(exc)
                        continue
                    count = 0  # no object left under the root: it is not there at all
                except (OSError, pa.ArrowException) as exc:
                    self.misses.append(exc)
                    continue
                with self._counted:
                    self.counts[name].append(count)
                    self._latest[name] = generation
                    self._counted.notify_all()

    def seen_by_all(self) -> None:
        """Wait until every reader has counted from a listing begun after this call."""
        with self._counted:
            self._generation += 1
            assert self._counted.wait_for(
                lambda: min(self._latest.values()) >= self._generation, timeout=120
            ), "the readers stopped counting"

    @contextlib.contextmanager
    def at_every_step(self, fs: AbstractFileSystem) -> Iterator[None]:
        """Each change `fs` makes that a listing can see (an upload, a delete, a copy, the
        completion of a multipart upload) waits until every reader has counted what the
        archive holds after it: every state a compaction passes through is counted by every
        reader. `calls` notes each of them, and the S3 requests of multipart uploads."""
        steps = ("pipe_file", "rm", "rm_file", "copy", "call_s3")

        def pausing(method: Callable[..., Any], name: str) -> Callable[..., Any]:
            def step(*args: Any, **kwargs: Any) -> Any:
                result = method(*args, **kwargs)
                request = args[0] if name == "call_s3" else name
                self.calls.append(request)
                if name == "call_s3" and request != "complete_multipart_upload":
                    return result  # (nothing a listing sees)
                self.steps += 1
                self.seen_by_all()
                return result
            return step

        own = {name: fs.__dict__[name] for name in steps if name in fs.__dict__}
        for name in steps:  # (fsspec makes an async filesystem's sync methods per instance)
            setattr(fs, name, pausing(getattr(fs, name), name))
        try:
            yield
        finally:
            for name in steps:
                if name in own:
                    setattr(fs, name, own[name])
                else:
                    delattr(fs, name)

    def __enter__(self) -> CountingReaders:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


@pytest.mark.timeout(600)  # every reader counts after each of 12 steps, on a loaded machine
async def test_compaction_on_s3_never_shows_a_row_twice_to_any_reader(
        journal: JournalStorage, moto_endpoint: str, bucket: str) -> None:
    """On an object store the merged file is staged beside the root first (the project's
    listing lists it and hides its inputs at once), then a multipart upload to its place is
    made ready, then the inputs are deleted, then the upload is completed. Readers counting
    in a loop, the project's, pyarrow given `archive_files`, and plain tools listing the root
    (pyarrow, pandas), never count more rows than were archived; the first two always count
    all of them; at the end every reader counts all of them."""
    from shardgate.storage.archive import compaction, list_stream_files

    url = f"s3://{bucket}/archive"
    data = await append(journal, 40)
    small = settings(moto_endpoint, target_rows=4, compact_after_s=0, compact_interval_s=3600)
    archiver = Archiver(journal, url, lambda: [("sensors", 1, "bytes")], small)
    await archiver.flush()  # (not started: no compaction of its own in the background)
    assert len(list_stream_files(archiver.fs, archiver.root, "sensors")) == 10

    with (CountingReaders(url, small, moto_endpoint, bucket) as readers,
          readers.at_every_step(archiver.fs)):
        # runs of five files first (several uploads, deletes and copies while readers count)
        files = list_stream_files(archiver.fs, archiver.root, "sensors")
        replaced = 0
        for start in range(0, 10, 5):
            run = files[start:start + 5]
            replaced += await asyncio.to_thread(
                compaction.compact_object_store, archiver.fs, archiver.root, "sensors", run,
                sum(f.size for f in run) + 1)
        assert replaced == 10
        # the archiver's own round merges the two merged files into one
        assert await archiver.compact() == 2
    assert readers.steps == 3 * 4
    # Between the deletion of a run's inputs and its merged file's appearance (the moment a
    # plain reader counts short) lies one request that moves no data, whatever the size.
    assert [call for call in readers.calls if call != "list_multipart_uploads"] == 3 * [
        "pipe_file", "create_multipart_upload", "upload_part_copy", "rm",
        "complete_multipart_upload", "rm_file"]
    await archiver.stop(flush=True)
    for name, counts in readers.counts.items():
        assert counts and max(counts) <= 40, (name, sorted(set(counts)), readers.misses[:3])
        assert counts[-1] == 40, (name, counts[-5:])
    assert set(readers.counts["project"]) == {40}
    assert set(readers.counts["archive_files"]) == {40}
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys == ["archive/stream=sensors/date=2023-11-14/hour=22/shard0000/"
                    f"shard0000-{0:020d}-{39:020d}.c.parquet"]  # nothing left staged
    assert [r.data for r in ArchiveReader(url, small).read("sensors", 0, 0, 100)] == data
    # progress after a restart comes from the merged file's name
    again = Archiver(journal, url, lambda: [("sensors", 1, "bytes")], small)
    await again.start()
    assert again.archived_offset("sensors", 0) == 40
    await again.stop(flush=False)


@pytest.mark.parametrize("stopped_after", ["staged", "upload begun", "inputs deleted", "copied"])
async def test_a_compaction_stopped_half_way_is_finished_later(
        journal: JournalStorage, moto_endpoint: str, bucket: str, stopped_after: str) -> None:
    """A compaction that stopped after any of its steps: the project's readers see every row
    once meanwhile, plain readers never more; the next round finishes it."""
    from shardgate.storage.archive import compaction, list_stream_files
    from shardgate.storage.archive.layout import merged_file_name, staging_root

    url = f"s3://{bucket}/archive"
    await append(journal, 12)
    small = settings(moto_endpoint, target_rows=4, compact_after_s=0, compact_interval_s=3600)
    archiver = Archiver(journal, url, lambda: [("sensors", 1, "bytes")], small)
    await archiver.flush()  # (not started: no compaction of its own in the background)
    fs, root = archiver.fs, archiver.root
    files = list_stream_files(fs, root, "sensors")
    directory = files[0].path.rsplit("/", 1)[0]
    name = merged_file_name(0, 0, 7)
    staged = f"{staging_root(root)}{directory[len(root):]}/{name}"
    # the steps of `compact_object_store` for the first two files, up to `stopped_after`
    fs.pipe_file(staged, compaction.merge(files[:2], "sensors", 3, 1000, fs))
    if stopped_after == "upload begun":  # (its place made ready: a multipart upload begun)
        assert compaction.Placement.prepare(fs, staged, f"{directory}/{name}",
                                            fs.size(staged)).upload is not None
    elif stopped_after != "staged":
        fs.rm([f.path for f in files[:2]])
    if stopped_after == "copied":
        fs.copy(staged, f"{directory}/{name}")
    listed = list_stream_files(fs, root, "sensors")
    assert [(f.first_offset, f.last_offset, f.staged) for f in listed] == [
        (0, 7, stopped_after != "copied"), (8, 11, False)]
    reader = ArchiveReader(url, small)
    assert [r.offset for r in reader.read("sensors", 0, 0, 100)] == list(range(12))
    plain = {name: read() for name, read in plain_readers(moto_endpoint, bucket)}
    expected = {"staged": 12, "upload begun": 12, "inputs deleted": 4, "copied": 12}[stopped_after]
    assert plain == {"pyarrow.dataset": expected, "pandas": expected}

    await archiver.compact()  # finishes it first (then merges the rest: 0-7 with 8-11)
    assert not fs.find(staging_root(root))
    assert [(f.first_offset, f.last_offset) for f in list_stream_files(
        fs, root, "sensors", include_superseded=True)] == [(0, 11)]
    assert {name: read() for name, read in plain_readers(moto_endpoint, bucket)} == {
        "pyarrow.dataset": 12, "pandas": 12}
    assert [r.offset for r in ArchiveReader(url, small).read("sensors", 0, 0, 100)] == list(range(12))
    await archiver.stop(flush=False)


async def test_an_upload_a_stopped_compaction_began_is_aborted_once_old(
        journal: JournalStorage, moto_endpoint: str, bucket: str) -> None:
    """S3 keeps (and bills) the parts of a multipart upload never completed: the next rounds
    abort those of merged files once an hour old by the store's own `Initiated` time (younger
    ones may be another node's compaction at work), never an upload of another object; what
    readers see does not change. (moto dates every upload in 2010, so the clock that the age
    is taken against is the test's: `now`.)"""
    from shardgate.storage.archive import compaction, list_stream_files
    from shardgate.storage.archive.layout import merged_file_name, staging_root

    await append(journal, 8)
    small = settings(moto_endpoint, target_rows=4, compact_after_s=0, compact_interval_s=3600)
    archiver = Archiver(journal, f"s3://{bucket}/archive", lambda: [("sensors", 1, "bytes")],
                        small)
    await archiver.flush()  # (not started: no compaction of its own in the background)
    fs, root = archiver.fs, archiver.root
    files = list_stream_files(fs, root, "sensors")
    directory = files[0].path.rsplit("/", 1)[0]
    staged = f"{staging_root(root)}{directory[len(root):]}/{merged_file_name(0, 0, 7)}"
    fs.pipe_file(staged, compaction.merge(files, "sensors", 3, 1000, fs))
    compaction.Placement.prepare(fs, staged, f"{directory}/{merged_file_name(0, 0, 7)}",
                                 fs.size(staged))
    fs.rm_file(staged)  # (the compaction stopped there; nothing of it is left but the upload)
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    # an upload of an object that is not a merged file, under the same stream: never aborted
    other_key = directory.split("/", 1)[1] + "/shard0000-not-merged.parquet"
    client.create_multipart_upload(Bucket=bucket, Key=other_key)

    def uploads() -> dict[str, float]:
        listed = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        return {upload["Key"].rsplit("/", 1)[1]: upload["Initiated"].timestamp()
                for upload in listed}

    initiated = uploads()[merged_file_name(0, 0, 7)]
    hour = compaction.STALE_UPLOAD_S
    assert hour == 3600
    # a minute short of an hour (and a second): another node's compaction may be at work
    for age in (hour - 60, hour - 1):
        assert compaction.abort_stale_uploads(fs, root, "sensors", now=initiated + age) == 0
        assert set(uploads()) == {merged_file_name(0, 0, 7), "shard0000-not-merged.parquet"}
    assert compaction.abort_stale_uploads(fs, root, "other", now=initiated + hour) == 0
    # an hour old: aborted, the other object's upload left alone
    assert compaction.abort_stale_uploads(fs, root, "sensors", now=initiated + hour) == 1
    assert set(uploads()) == {"shard0000-not-merged.parquet"}
    assert compaction.abort_stale_uploads(fs, root, "sensors", now=initiated + 10 * hour) == 0
    assert set(uploads()) == {"shard0000-not-merged.parquet"}
    assert {name: read() for name, read in plain_readers(moto_endpoint, bucket)} == {
        "pyarrow.dataset": 8, "pandas": 8}
    await archiver.stop(flush=False)


async def test_a_bare_bucket_root_is_archived_without_compaction(
        journal: JournalStorage, moto_endpoint: str, bucket: str) -> None:
    """A root with no parent in its bucket has no place to stage merged files beside it:
    compaction is off there (logged), archiving goes on."""
    from shardgate.storage.archive import list_stream_files

    await append(journal, 12)
    small = settings(moto_endpoint, target_rows=4, compact_after_s=0, compact_interval_s=3600)
    archiver = Archiver(journal, f"s3://{bucket}", lambda: [("sensors", 1, "bytes")], small)
    await archiver.flush()  # (not started: no compaction of its own in the background)
    assert await archiver.compact() == 0
    assert len(list_stream_files(archiver.fs, archiver.root, "sensors")) == 3
    await archiver.stop(flush=False)
