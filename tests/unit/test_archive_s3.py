"""The archiver and the archive reader against a real S3 API on loopback (`moto_server`)
through s3fs: uploads, layout, restart without duplicates, and a missing bucket refused at
start with a clear error."""

from __future__ import annotations

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
    return ArchiveSettings(
        endpoint_url=endpoint, region="us-east-1", access_key_id="testing",
        secret_access_key="testing", target_rows=40, retry_initial_s=0.05, retry_max_s=0.2,
        **overrides,  # type: ignore[arg-type]
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
