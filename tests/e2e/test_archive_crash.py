"""SIGKILL an archiver process in the middle of archiving, archive again from the same journal:
every journal record is in the archive exactly once, and nothing half-written is visible."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.dataset as ds
from shardgate.core.records import MessageRecord, encode_message
from shardgate.storage.archive import Archiver, ArchiveSettings
from shardgate.storage.journal import JournalStorage

RECORDS = 6000
T0 = 1_700_000_000_000

ARCHIVE_FOREVER = textwrap.dedent("""
    import asyncio, sys, time
    from shardgate.storage.archive import Archiver, ArchiveSettings, archiver
    from shardgate.storage.journal import JournalStorage

    real_put = archiver.Archiver._put
    def slow_put(self, path, data):
        time.sleep(0.01)
        real_put(self, path, data)
        print(path, flush=True)
    archiver.Archiver._put = slow_put

    async def main():
        journal = JournalStorage(sys.argv[1], fsync="os")
        a = Archiver(journal, sys.argv[2], lambda: [("crash", 2, "string")],
                     ArchiveSettings(target_rows=97, poll_interval_s=0.01))
        await a.flush()
        print("done", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def fill(journal_dir: Path) -> None:
    async def run() -> None:
        journal = JournalStorage(journal_dir, fsync="os")
        for shard in (0, 1):
            log = journal.open_shard("crash", shard)
            log.append([(T0 + i * 1000, encode_message(MessageRecord(
                f"crash/{shard}/{i}", b"%d" % i, 1, False, T0 + i * 1000)))
                for i in range(RECORDS // 2)])
        await journal.flush()
        journal.close()

    asyncio.run(run())


def test_sigkill_during_archiving_then_restart_archives_each_record_once(tmp_path: Path) -> None:
    journal_dir, root = tmp_path / "journal", tmp_path / "archive"
    fill(journal_dir)
    process = subprocess.Popen(
        [sys.executable, "-c", ARCHIVE_FOREVER, str(journal_dir), f"file://{root}"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        uploaded = 0
        deadline = time.monotonic() + 60
        assert process.stdout is not None
        while uploaded < 12:  # kill once a dozen files are visible, mid-way
            line = process.stdout.readline()
            assert line and line != "done\n", "the archiver finished before it was killed"
            uploaded += 1
            assert time.monotonic() < deadline
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait(10)

    def visible_offsets() -> list[tuple[int, int]]:
        table = ds.dataset(str(root), format="parquet", partitioning="hive").to_table(
            columns=["shard", "offset"])
        return sorted(zip(table.column("shard").to_pylist(), table.column("offset").to_pylist(),
                          strict=True))

    before = visible_offsets()
    assert len(before) == len(set(before)) and 12 * 97 <= len(before) < RECORDS

    async def resume() -> None:
        journal = JournalStorage(journal_dir, fsync="os")
        archiver = Archiver(journal, f"file://{root}", lambda: [("crash", 2, "string")],
                            ArchiveSettings(target_rows=1000))
        await archiver.start()
        await archiver.stop(flush=True)
        assert sum(s["lag_records"] for s in archiver.status()) == 0
        journal.close()

    asyncio.run(resume())
    after = visible_offsets()
    assert after == [(shard, i) for shard in (0, 1) for i in range(RECORDS // 2)]
    assert not [p for p in root.rglob(".*") if p.is_file()]  # no temporary left behind
