"""The archiver reads the next file's records from the journal, and builds its table, while the
previous file is encoded and uploaded: a failed upload drops what was read ahead and retries
the same file, so that the archive still holds every offset once, in files cut at the same
places."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem
from shardgate.core.records import MessageRecord, encode_message
from shardgate.storage.archive import Archiver, ArchiveSettings, list_stream_files
from shardgate.storage.archive import archiver as archiver_module
from shardgate.storage.journal import JournalStorage

T0 = 1_700_000_000_000 - 1_700_000_000_000 % 3_600_000


class FailingNthUpload(LocalFileSystem):
    """Taken for a remote store; upload number `fail_at` (1-based) fails once."""

    cachable = False
    protocol = ("failnth",)

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.calls: list[str] = []

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self.calls.append(path.rsplit("/", 1)[1])
        if len(self.calls) == self.fail_at:
            raise ConnectionError("object store unreachable")
        super().pipe_file(path, value, **kwargs)


async def test_failed_upload_drops_the_read_ahead_and_loses_nothing(tmp_path: Path) -> None:
    journal = JournalStorage(tmp_path / "journal", fsync="os", segment_bytes=8192)
    try:
        log = journal.open_shard("s", 0)
        log.append([(T0 + i, encode_message(MessageRecord(
            f"t/{i}", b"p" + bytes(str(i), "ascii"), 1, False, T0 + i, producer_id="me"))) for i in range(350)])
        await log.flush()
        root = tmp_path / "archive"
        fs = FailingNthUpload(fail_at=2)
        fs.mkdirs(str(root), exist_ok=True)
        settings = ArchiveSettings(target_rows=100, read_batch=30, max_delay_s=3600,
                                   retry_initial_s=0.01, retry_max_s=0.02)
        archiver = Archiver(journal, f"file://{root}", lambda: [("s", 1, "bytes")], settings,
                            filesystem=fs)
        await archiver.flush(timeout=5)

        # the second file failed once and was uploaded again under the same name
        assert fs.calls[1] == fs.calls[2]
        entries = list_stream_files(fs, str(root), "s")
        assert [(e.first_offset, e.last_offset) for e in entries] == [
            (0, 99), (100, 199), (200, 299), (300, 349)]
        offsets = [o for e in entries for o in pq.read_table(e.path).column("offset").to_pylist()]
        assert offsets == list(range(350))
        status = archiver.status()[0]
        assert status["archived_next"] == 350 and status["buffered"] == 0
        assert status["lag_records"] == 0 and status["failures"] == 0
    finally:
        journal.close()


async def test_what_was_read_ahead_goes_back_to_the_journal_until_a_file_is_due(
    tmp_path: Path,
) -> None:
    """A broker idle after a burst holds no records in memory: the read-ahead of an upload is
    dropped when the next file is not due yet, and read again once it is."""
    hour = int(time.time() * 1000) // 3_600_000 * 3_600_000  # records of this hour
    journal = JournalStorage(tmp_path / "journal", fsync="os", segment_bytes=8192)
    try:
        log = journal.open_shard("s", 0)
        log.append([(hour + i, encode_message(MessageRecord(
            f"t/{i}", b"p" * 100, 1, False, hour + i, producer_id="me"))) for i in range(150)])
        await log.flush()
        root = tmp_path / "archive"
        settings = ArchiveSettings(target_rows=100, read_batch=30, max_delay_s=7200,
                                   poll_interval_s=0.01)
        archiver = Archiver(journal, f"file://{root}", lambda: [("s", 1, "bytes")], settings)
        await archiver.start()
        try:
            deadline = asyncio.get_running_loop().time() + 10
            while archiver.status()[0]["files"] < 1:
                assert asyncio.get_running_loop().time() < deadline, archiver.status()
                await asyncio.sleep(0.01)
            status = archiver.status()[0]
            assert status["buffered"] == 0 and status["lag_records"] == 50
            log.append([(hour + 150 + i, encode_message(MessageRecord(
                f"t/{i}", b"p", 1, False, hour + 150 + i, producer_id="me"))) for i in range(60)])
            await log.flush()
            while archiver.status()[0]["files"] < 2:  # 110 committed: due, read again
                assert asyncio.get_running_loop().time() < deadline, archiver.status()
                await asyncio.sleep(0.01)
        finally:
            await archiver.stop(flush=False)
        entries = list_stream_files(LocalFileSystem(), str(root), "s")
        assert [(e.first_offset, e.last_offset) for e in entries] == [(0, 99), (100, 199)]
    finally:
        journal.close()


class WaitsForTheNextBuild(LocalFileSystem):
    """Taken for a remote store; the first upload waits until the next file's table is being
    built (or 10 s)."""

    cachable = False
    protocol = ("waitsnext",)

    def __init__(self, next_build: threading.Event) -> None:
        super().__init__()
        self.next_build = next_build
        self.waited: list[bool] = []

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        if not self.waited:
            self.waited.append(self.next_build.wait(10))
        super().pipe_file(path, value, **kwargs)


async def test_the_next_files_table_is_built_while_a_file_uploads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = JournalStorage(tmp_path / "journal", fsync="os")
    try:
        log = journal.open_shard("s", 0)
        log.append([(T0 + i, encode_message(MessageRecord(
            f"t/{i}", b"p%d" % i, 1, False, T0 + i, producer_id="me"))) for i in range(250)])
        await log.flush()
        builds: list[int] = []
        second_build = threading.Event()
        real_build = archiver_module.build_table

        def build_table(stream: str, shard: int, schema: str, records: Any, *rest: Any) -> Any:
            builds.append(records[0].offset)
            if len(builds) == 2:
                second_build.set()
            return real_build(stream, shard, schema, records, *rest)

        monkeypatch.setattr(archiver_module, "build_table", build_table)
        root = tmp_path / "archive"
        fs = WaitsForTheNextBuild(second_build)
        fs.mkdirs(str(root), exist_ok=True)
        settings = ArchiveSettings(target_rows=100, read_batch=40, max_delay_s=3600)
        archiver = Archiver(journal, f"file://{root}", lambda: [("s", 1, "bytes")], settings,
                            filesystem=fs)
        await archiver.flush(timeout=20)

        assert fs.waited == [True], "the second table was built during the first upload"
        assert builds == [0, 100, 200], "each file's table was built once"
        entries = list_stream_files(fs, str(root), "s")
        offsets = [o for e in entries for o in pq.read_table(e.path).column("offset").to_pylist()]
        assert offsets == list(range(250))
    finally:
        journal.close()
