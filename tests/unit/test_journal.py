"""The journal engine: framing, segments and indexes, group commit under each fsync policy,
recovery after a crash, corruption reports, retention and write failures."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardgate.storage.interfaces import CorruptRecord, StorageFull, StoredRecord
from shardgate.storage.journal import (
    FORMAT_VERSION,
    VERSION_FILE,
    JournalClosed,
    JournalLocked,
    JournalShardLog,
    JournalStorage,
    JournalVersionError,
)
from shardgate.storage.journal import log as log_module
from shardgate.storage.journal import segment as segment_module
from shardgate.storage.journal.record import HEADER_SIZE

T0 = 1_700_000_000_000


def payload(offset: int) -> bytes:
    return b"record-%d-" % offset + bytes(offset % 7)


def records(first: int, count: int, ts: int = T0) -> list[tuple[int, bytes]]:
    return [(ts + first + i, payload(first + i)) for i in range(count)]


def check_dense(
    got: list[StoredRecord], first: int, count: int, skipped: range = range(0)
) -> None:
    """Offsets first..first+count-1, each with its payload, except the `skipped` offsets,
    which hold empty records (offsets handed out once and never reused)."""
    assert [r.offset for r in got] == list(range(first, first + count))
    assert all(r.data == (b"" if r.offset in skipped else payload(r.offset)) for r in got)


@pytest.fixture
def journal_dir(tmp_path: Path) -> Path:
    return tmp_path / "journal"


@pytest.fixture
def storage(journal_dir: Path) -> Iterator[JournalStorage]:
    store = JournalStorage(journal_dir, segment_bytes=4096, index_interval_bytes=256)
    yield store
    store.close()


def shard_files(
    store: JournalStorage, suffix: str, stream: str = "s", shard: int = 0
) -> list[Path]:
    return sorted(store.shard_directory(stream, shard).glob(f"*{suffix}"))


# -- round trips, segments, indexes -----------------------------------------------------------


def test_append_read_round_trip_across_segment_rolls(journal_dir: Path) -> None:
    store = JournalStorage(journal_dir, segment_bytes=2048, index_interval_bytes=128)
    shard = store.open_shard("s", 0)
    for first in range(0, 600, 50):
        assert shard.append(records(first, 50)) == first
        store.flush_sync()
    assert shard.next_offset == shard.committed_offset == 600
    assert len(shard.segments) > 5
    check_dense(shard.read(0, 10_000), 0, 600)
    check_dense(shard.read(333, 10), 333, 10)
    check_dense(shard.read(599, 10), 599, 1)
    assert shard.read(600) == []
    store.close()

    logs = shard_files(store, ".log")
    assert logs[0].name == "00000000000000000000.log"
    # every sealed segment got its index files; the active one keeps them in memory
    assert len(shard_files(store, ".index")) == len(logs) - 1
    assert len(shard_files(store, ".timeindex")) == len(logs) - 1

    reopened = JournalStorage(journal_dir, segment_bytes=2048, index_interval_bytes=128)
    shard = reopened.open_shard("s", 0)
    assert (shard.low_watermark, shard.next_offset) == (0, 600)
    check_dense(shard.read(0, 10_000), 0, 600)
    for start in (0, 1, 127, 300, 598):
        check_dense(shard.read(start, 3), start, min(3, 600 - start))
    shard.append(records(600, 5))
    reopened.flush_sync()
    check_dense(shard.read(590, 100), 590, 15)
    reopened.close()


def test_segment_rolls_by_age_of_its_first_record(storage: JournalStorage) -> None:
    storage.close()
    store = JournalStorage(storage.directory, segment_ms=1000)
    shard = store.open_shard("s", 0)
    shard.append([(T0, b"a"), (T0 + 999, b"b")])
    store.flush_sync()
    shard.append([(T0 + 999, b"c")])
    store.flush_sync()
    assert [s.base_offset for s in shard.segments] == [0]
    shard.append([(T0 + 1000, b"d")])
    store.flush_sync()
    assert [s.base_offset for s in shard.segments] == [0, 3]
    assert [r.data for r in shard.read(0)] == [b"a", b"b", b"c", b"d"]
    store.close()


def test_missing_or_damaged_index_files_are_rebuilt(journal_dir: Path) -> None:
    store = JournalStorage(journal_dir, segment_bytes=2048, index_interval_bytes=128)
    shard = store.open_shard("s", 0)
    for first in range(0, 300, 30):
        shard.append(records(first, 30))
        store.flush_sync()
    store.close()
    indexes = shard_files(store, ".index")
    indexes[0].unlink()
    indexes[1].write_bytes(indexes[1].read_bytes()[:-3])
    shard_files(store, ".timeindex")[2].write_bytes(b"")

    reopened = JournalStorage(journal_dir, segment_bytes=2048, index_interval_bytes=128)
    shard = reopened.open_shard("s", 0)
    check_dense(shard.read(0, 1000), 0, 300)
    assert shard.offset_for_timestamp(T0 + 150) == 150
    reopened.close()
    assert len(shard_files(reopened, ".index")) == len(shard_files(reopened, ".log")) - 1


def test_read_clamps_to_low_watermark_and_respects_max_records(storage: JournalStorage) -> None:
    shard = storage.open_shard("s", 0)
    for first in range(0, 400, 20):
        shard.append(records(first, 20))
        storage.flush_sync()
    low = shard.delete_before(150)
    assert 0 < low <= 150
    got = shard.read(0, 5)
    check_dense(got, low, 5)
    assert shard.read(10, 0) == []


def test_offset_for_timestamp_uses_time_index(journal_dir: Path) -> None:
    store = JournalStorage(journal_dir, segment_bytes=1024, index_interval_bytes=64)
    shard = store.open_shard("s", 0)
    # timestamps mostly rising, with stragglers that arrive late
    stamps = [T0 + 10 * i - (25 if i % 9 == 0 else 0) for i in range(300)]
    for first in range(0, 300, 20):
        shard.append([(stamps[i], payload(i)) for i in range(first, first + 20)])
        store.flush_sync()
    assert len(shard.segments) > 3

    def expected(target: int) -> int:
        return next((i for i, ts in enumerate(stamps) if ts >= target), 300)

    for target in (0, T0 - 25, T0, T0 + 1, T0 + 500, T0 + 1234, T0 + 2990, T0 + 2991, T0 + 10**9):
        assert shard.offset_for_timestamp(target) == expected(target), target
    store.close()
    reopened = JournalStorage(journal_dir, segment_bytes=1024, index_interval_bytes=64)
    shard = reopened.open_shard("s", 0)
    for target in (T0 - 25, T0 + 777, T0 + 2985, T0 + 10**9):
        assert shard.offset_for_timestamp(target) == expected(target), target
    reopened.close()


def test_shards_are_listed_and_deleted(storage: JournalStorage) -> None:
    storage.open_shard("orders", 0)
    storage.open_shard("orders", 3)
    storage.open_shard("a/b c", 1)
    storage.open_shard(".hidden", 0)
    assert storage.list_shards() == [(".hidden", 0), ("a/b c", 1), ("orders", 0), ("orders", 3)]
    storage.delete_shard("orders", 3)
    assert ("orders", 3) not in storage.list_shards()
    storage.close()
    reopened = JournalStorage(storage.directory)
    assert reopened.list_shards() == [(".hidden", 0), ("a/b c", 1), ("orders", 0)]
    reopened.close()


def test_a_journal_directory_is_opened_by_one_storage_at_a_time(storage: JournalStorage) -> None:
    with pytest.raises(JournalLocked):
        JournalStorage(storage.directory)
    storage.close()
    JournalStorage(storage.directory).close()


def test_records_larger_than_a_read_chunk(journal_dir: Path) -> None:
    store = JournalStorage(journal_dir, segment_bytes=300_000)
    shard = store.open_shard("s", 0)
    big = [(T0 + i, os.urandom(size)) for i, size in enumerate([5, 200_000, 70_000, 1, 1 << 20])]
    shard.append(big)
    store.flush_sync()
    shard.append([(T0, b"after")])
    store.flush_sync()
    assert [(r.timestamp_ms, r.data) for r in shard.read(0)] == [*big, (T0, b"after")]
    assert shard.read(2, 1)[0].data == big[2][1]
    store.close()
    reopened = JournalStorage(journal_dir, segment_bytes=300_000)
    shard = reopened.open_shard("s", 0)
    assert [r.data for r in shard.read(1, 2)] == [big[1][1], big[2][1]]
    assert shard.offset_for_timestamp(T0 + 4) == 4
    reopened.close()


async def test_deleting_a_shard_fails_its_unwritten_appends(storage: JournalStorage) -> None:
    shard = storage.open_shard("s", 0)
    shard.append(records(0, 3))
    waiter = shard.commit_waiter()
    storage.delete_shard("s", 0)
    with pytest.raises(JournalClosed):
        await waiter  # type: ignore[misc]
    assert ("s", 0) not in storage.list_shards()
    assert storage.open_shard("s", 0).next_offset == 0


def test_closed_shard_refuses_appends(storage: JournalStorage) -> None:
    shard = storage.open_shard("s", 0)
    shard.close()
    with pytest.raises(JournalClosed):
        shard.append(records(0, 1))


def test_append_of_bad_record_leaves_the_group_untouched(storage: JournalStorage) -> None:
    shard = storage.open_shard("s", 0)
    shard.append(records(0, 3))
    with pytest.raises(TypeError):
        shard.append([(T0, b"ok"), (T0, "not bytes")])  # type: ignore[list-item]
    assert shard.next_offset == 3
    storage.flush_sync()
    check_dense(shard.read(0), 0, 3)


# -- group commit and fsync policies ------------------------------------------------------


@pytest.fixture
def fsync_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The fsyncs of segment files: `sync_file` calls, and writes made durable in the same
    call (`write_durably`, under the `always` policy)."""
    calls: list[int] = []
    real = log_module.sync_file
    real_durably = log_module.write_durably

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    def counting_durably(fd: int, data: bytes, position: int, appending: bool = True) -> None:
        calls.append(fd)
        real_durably(fd, data, position, appending)

    monkeypatch.setattr(log_module, "sync_file", counting)
    monkeypatch.setattr(log_module, "write_durably", counting_durably)
    return calls


async def test_group_commit_shares_one_future_among_concurrent_appenders(
    storage: JournalStorage, fsync_calls: list[int]
) -> None:
    shard = storage.open_shard("s", 0)
    other = storage.open_shard("s", 1)
    waiters = []
    for i in range(50):
        shard.append(records(i, 1))
        other.append(records(i, 1))
        waiters.append(shard.commit_waiter())
    assert all(w is waiters[0] for w in waiters)
    assert shard.read(0) == []  # appended, not yet durable: not visible
    await asyncio.gather(*waiters)
    assert shard.committed_offset == 50
    check_dense(shard.read(0), 0, 50)
    # one pass wrote and fsynced both shards
    assert storage.stats.passes == 1 and len(fsync_calls) == 2
    await other.flush()
    assert shard.commit_waiter() is None and other.commit_waiter() is None


async def test_appends_during_a_commit_form_the_next_group(storage: JournalStorage) -> None:
    shard = storage.open_shard("s", 0)

    async def appender(k: int) -> list[int]:
        done = []
        for j in range(40):
            offset = shard.append([(T0, b"%d-%d" % (k, j))])
            waiter = shard.commit_waiter()
            assert waiter is not None
            await waiter
            assert shard.committed_offset > offset
            done.append(offset)
        return done

    results = await asyncio.gather(*(appender(k) for k in range(25)))
    assert sorted(o for r in results for o in r) == list(range(1000))
    stats = storage.stats
    assert stats.records == 1000
    assert stats.groups < 200  # appends were batched into groups
    got = shard.read(0, 2000)
    assert [r.offset for r in got] == list(range(1000))


async def test_policy_always_fsyncs_before_resolving(
    journal_dir: Path, fsync_calls: list[int]
) -> None:
    store = JournalStorage(journal_dir, fsync="always")
    shard = store.open_shard("s", 0)
    shard.append(records(0, 3))
    await shard.commit_waiter()  # type: ignore[misc]
    assert len(fsync_calls) == 1
    store.close()


async def test_policy_os_resolves_after_write_without_fsync(
    journal_dir: Path, fsync_calls: list[int]
) -> None:
    store = JournalStorage(journal_dir, fsync="os")
    shard = store.open_shard("s", 0)
    for first in range(0, 30, 10):
        shard.append(records(first, 10))
        await shard.commit_waiter()  # type: ignore[misc]
    check_dense(shard.read(0), 0, 30)
    assert fsync_calls == []
    store.close()  # close fsyncs what the OS holds
    assert len(fsync_calls) == 1


async def test_policy_interval_resolves_after_the_next_timed_fsync(
    journal_dir: Path, fsync_calls: list[int]
) -> None:
    store = JournalStorage(journal_dir, fsync="interval", fsync_interval_ms=400)
    shard = store.open_shard("s", 0)
    await asyncio.sleep(0.45)  # let the first interval elapse: the next sync is due at once
    loop = asyncio.get_running_loop()
    # Timed from before the first fsync's pass began (however late this coroutine learns of
    # it on a loaded machine): the next fsync is due no sooner than 0.4 s after `started`.
    started = loop.time()
    shard.append(records(0, 1))
    await shard.commit_waiter()  # type: ignore[misc]
    assert len(fsync_calls) == 1
    writes = store.stats.passes
    for first in range(1, 6):
        shard.append(records(first, 1))
        waiter = shard.commit_waiter()
        assert waiter is not None
        await asyncio.sleep(0.01)
        if loop.time() - started < 0.3:  # well before the next fsync is due
            assert not waiter.done()
            assert shard.read(first) == []  # written, not yet fsynced: not visible
    assert store.stats.passes > writes  # the groups were written meanwhile
    await waiter
    assert loop.time() - started > 0.3
    assert len(fsync_calls) == 2  # several write passes, one fsync
    check_dense(shard.read(0), 0, 6)
    store.close()


async def test_flush_does_not_wait_for_the_interval_timer(journal_dir: Path) -> None:
    store = JournalStorage(journal_dir, fsync="interval", fsync_interval_ms=60_000)
    shard = store.open_shard("s", 0)
    shard.append(records(0, 3))
    await asyncio.wait_for(store.flush(), 10)
    assert shard.committed_offset == 3
    store.close()


def test_commit_survives_the_event_loop_that_started_it(journal_dir: Path) -> None:
    store = JournalStorage(journal_dir)
    shard = store.open_shard("s", 0)

    async def append_and_leave() -> None:
        shard.append(records(0, 5))
        for _ in range(3):
            await asyncio.sleep(0)  # the pass is in the worker thread when this loop ends

    async def append_and_wait() -> None:
        shard.append(records(5, 5))
        await shard.flush()

    asyncio.run(append_and_leave())
    asyncio.run(append_and_wait())
    check_dense(shard.read(0), 0, 10)
    store.close()


def test_flush_sync_without_event_loop(storage: JournalStorage) -> None:
    shard = storage.open_shard("s", 0)
    shard.append(records(0, 10))
    assert shard.read(0) == []
    shard.flush_sync()
    check_dense(shard.read(0), 0, 10)
    assert shard.commit_waiter() is None


# -- write failures -------------------------------------------------------------------------


def failing_write(monkeypatch: pytest.MonkeyPatch, *, partial: int = 0) -> list[int]:
    """Make the journal's writes (os.write, and os.pwritev, which writes and syncs in one call)
    fail with ENOSPC (after writing `partial` bytes once)."""
    real, real_pwritev = os.write, os.pwritev
    calls: list[int] = []

    def write(fd: int, data: bytes) -> int:
        calls.append(fd)
        if partial and len(calls) == 1:
            return real(fd, memoryview(data)[:partial])
        raise OSError(errno.ENOSPC, "No space left on device")

    def pwritev(fd: int, buffers: list[bytes], position: int, flags: int = 0) -> int:
        calls.append(fd)
        if partial and len(calls) == 1:
            return real_pwritev(fd, [memoryview(buffers[0])[:partial]], position, flags)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_module.os, "write", write)
    monkeypatch.setattr(segment_module.os, "pwritev", pwritev)
    return calls


@pytest.mark.parametrize("partial", [0, 10, HEADER_SIZE + 3])
async def test_write_error_fails_the_waiter_and_rolls_back(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch, partial: int
) -> None:
    store = JournalStorage(journal_dir)
    shard = store.open_shard("s", 0)
    shard.append(records(0, 5))
    await shard.flush()
    size = shard.segments[-1].size

    with monkeypatch.context() as patch:
        failing_write(patch, partial=partial)
        assert shard.append(records(5, 3)) == 5
        waiter = shard.commit_waiter()
        with pytest.raises(StorageFull, match="No space left"):
            await waiter  # type: ignore[misc]
    # Offsets 5..7 may have been seen: they are never handed out again.
    assert (shard.next_offset, shard.committed_offset) == (8, 5)
    log_path = shard.segments[-1].path()
    assert log_path.stat().st_size == size
    check_dense(shard.read(0), 0, 5)

    # the log carries on after the failed offsets, which the next append fills empty
    assert shard.append(records(8, 3)) == 8
    await shard.flush()
    check_dense(shard.read(0), 0, 11, skipped=range(5, 8))
    store.close()
    reopened = JournalStorage(journal_dir)
    check_dense(reopened.open_shard("s", 0).read(0), 0, 11, skipped=range(5, 8))
    reopened.close()


async def test_write_error_also_fails_appends_made_during_the_failed_pass(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = JournalStorage(journal_dir)
    shard = store.open_shard("s", 0)
    failing_write(monkeypatch)
    shard.append(records(0, 2))
    first = shard.commit_waiter()
    await asyncio.sleep(0)  # the pass takes the first group
    shard.append(records(2, 2))
    second = shard.commit_waiter()
    assert second is not first
    results = await asyncio.gather(first, second, return_exceptions=True)  # type: ignore[arg-type]
    assert all(isinstance(r, StorageFull) for r in results)
    assert (shard.next_offset, shard.committed_offset) == (4, 0)
    monkeypatch.undo()
    store.close()


async def test_fsync_error_rolls_back_unsynced_groups(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = JournalStorage(journal_dir, fsync="interval", fsync_interval_ms=30)
    shard = store.open_shard("s", 0)
    shard.append(records(0, 4))
    await store.flush()
    size = shard.segments[-1].size

    def broken_sync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(log_module, "sync_file", broken_sync)
    shard.append(records(4, 2))
    first = shard.commit_waiter()
    await asyncio.sleep(0.005)
    shard.append(records(6, 2))
    second = shard.commit_waiter()
    results = await asyncio.gather(first, second, return_exceptions=True)  # type: ignore[arg-type]
    assert all(isinstance(r, StorageFull) for r in results)
    assert (shard.next_offset, shard.committed_offset) == (8, 4)
    assert shard.segments[-1].path().stat().st_size == size
    monkeypatch.undo()
    shard.append(records(8, 1))
    await store.flush()
    check_dense(shard.read(0), 0, 9, skipped=range(4, 8))
    store.close()


def test_flush_sync_raises_storage_full(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = JournalStorage(journal_dir)
    shard = store.open_shard("s", 0)
    failing_write(monkeypatch)
    shard.append(records(0, 2))
    with pytest.raises(StorageFull):
        store.flush_sync()
    assert (shard.next_offset, shard.committed_offset) == (2, 0)
    monkeypatch.undo()
    store.close()


def test_write_error_during_roll_removes_the_new_segment(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = JournalStorage(journal_dir, segment_bytes=256)
    shard = store.open_shard("s", 0)
    shard.append(records(0, 10))
    store.flush_sync()
    with monkeypatch.context() as patch:
        failing_write(patch)
        shard.append(records(10, 2))
        with pytest.raises(StorageFull):
            store.flush_sync()
    assert [s.base_offset for s in shard.segments] == [0]
    assert len(shard_files(store, ".log")) == 1
    shard.append(records(12, 2))
    store.flush_sync()
    assert [s.base_offset for s in shard.segments] == [0, 10]
    check_dense(shard.read(0), 0, 14, skipped=range(10, 12))
    store.close()


def test_too_much_pending_data_is_refused(journal_dir: Path) -> None:
    store = JournalStorage(journal_dir, max_pending_bytes=1000)
    shard = store.open_shard("s", 0)
    shard.append([(T0, bytes(1200))])
    with pytest.raises(StorageFull):
        shard.append([(T0, b"x")])
    store.flush_sync()
    shard.append([(T0, b"x")])
    store.close()


# -- recovery and corruption ------------------------------------------------------------------


def write_closed_journal(journal_dir: Path, count: int, **options: int) -> list[int]:
    """Append `count` records one group at a time; returns each record's end position in the
    active segment."""
    store = JournalStorage(journal_dir, **options)
    shard = store.open_shard("s", 0)
    ends = []
    for i in range(count):
        shard.append(records(i, 1))
        store.flush_sync()
        ends.append(shard.segments[-1].size)
    store.close()
    return ends


@pytest.mark.parametrize("cut", ["header", "crc", "data", "last-byte", "boundary"])
def test_recovery_cuts_a_torn_tail(journal_dir: Path, cut: str) -> None:
    ends = write_closed_journal(journal_dir, 40, index_interval_bytes=100)
    active = journal_dir / "s" / "0" / "00000000000000000000.log"
    last_good = ends[-2]
    position = {
        "header": last_good + 3,
        "crc": last_good + 6,
        "data": last_good + HEADER_SIZE + 2,
        "last-byte": ends[-1] - 1,
        "boundary": last_good,
    }[cut]
    os.truncate(active, position)

    store = JournalStorage(journal_dir, index_interval_bytes=100)
    shard = store.open_shard("s", 0)
    # Record 39 is lost, but its offset was handed out (the clean close reserved up to 40):
    # it is never given to another record.
    assert (shard.next_offset, shard.committed_offset) == (40, 39)
    assert active.stat().st_size == last_good
    check_dense(shard.read(0, 100), 0, 39)
    check_dense(shard.read(25, 100), 25, 14)
    assert shard.offset_for_timestamp(T0 + 30) == 30
    shard.append(records(40, 3))
    store.flush_sync()
    check_dense(shard.read(0, 100), 0, 43, skipped=range(39, 40))
    store.close()


def test_recovery_cuts_at_a_corrupt_record_in_the_active_segment(journal_dir: Path) -> None:
    ends = write_closed_journal(journal_dir, 10)
    active = journal_dir / "s" / "0" / "00000000000000000000.log"
    data = bytearray(active.read_bytes())
    data[ends[6] + HEADER_SIZE] ^= 0xFF  # the data of record 7
    active.write_bytes(bytes(data))
    store = JournalStorage(journal_dir)
    shard = store.open_shard("s", 0)
    assert (shard.next_offset, shard.committed_offset) == (10, 7)
    check_dense(shard.read(0), 0, 7)
    store.close()


def test_recovery_cuts_garbage_after_the_last_record(journal_dir: Path) -> None:
    ends = write_closed_journal(journal_dir, 5)
    active = journal_dir / "s" / "0" / "00000000000000000000.log"
    with active.open("ab") as f:
        f.write(bytes(100))
    store = JournalStorage(journal_dir)
    shard = store.open_shard("s", 0)
    assert shard.next_offset == 5 and active.stat().st_size == ends[-1]
    store.close()


def test_crc_flip_in_sealed_segment_raises_corrupt_record(journal_dir: Path) -> None:
    store = JournalStorage(journal_dir, segment_bytes=1024, index_interval_bytes=128)
    shard = store.open_shard("s", 0)
    for first in range(0, 200, 20):
        shard.append(records(first, 20))
        store.flush_sync()
    first_segment = shard.segments[0]
    assert first_segment.sealed and len(shard.segments) > 2
    store.close()

    path = first_segment.path()
    data = bytearray(path.read_bytes())
    # find the byte position of record 10 by walking the headers
    position = 0
    for _ in range(10):
        position += HEADER_SIZE + int.from_bytes(data[position : position + 4], "little")
    data[position + HEADER_SIZE + 1] ^= 0x01
    path.write_bytes(bytes(data))

    reopened = JournalStorage(journal_dir, segment_bytes=1024, index_interval_bytes=128)
    shard = reopened.open_shard("s", 0)
    assert shard.next_offset == 200  # a sealed segment is not cut
    check_dense(shard.read(0, 10), 0, 10)
    with pytest.raises(CorruptRecord) as info:
        shard.read(0, 100)
    message = str(info.value)
    assert str(path) in message and f"byte {position}" in message
    with pytest.raises(CorruptRecord):
        shard.read(10, 1)
    later = shard.segments[1].base_offset
    check_dense(shard.read(later, 5), later, 5)
    reopened.close()


def test_sealed_segment_missing_its_last_records_is_reported(journal_dir: Path) -> None:
    store = JournalStorage(journal_dir, segment_bytes=1024, index_interval_bytes=128)
    shard = store.open_shard("s", 0)
    for first in range(0, 100, 10):
        shard.append(records(first, 10))
        store.flush_sync()
    sealed = shard.segments[0]
    end = sealed.next_offset
    store.close()
    path = sealed.path()
    data = path.read_bytes()
    cut = len(data) - (HEADER_SIZE + len(payload(end - 1)))
    os.truncate(path, cut)  # as if the disk lost the last record of a sealed segment
    for suffix in (".index", ".timeindex"):
        path.with_suffix(suffix).unlink()

    reopened = JournalStorage(journal_dir, segment_bytes=1024, index_interval_bytes=128)
    shard = reopened.open_shard("s", 0)
    check_dense(shard.read(0, end - 1), 0, end - 1)
    with pytest.raises(CorruptRecord, match=f"no record for offset {end - 1}"):
        shard.read(0, 1000)
    check_dense(shard.read(end, 5), end, 5)
    reopened.close()


def test_newer_format_version_is_refused(journal_dir: Path) -> None:
    JournalStorage(journal_dir).close()
    assert (journal_dir / VERSION_FILE).read_text().split()[0] == str(FORMAT_VERSION)
    (journal_dir / VERSION_FILE).write_text(f"{FORMAT_VERSION + 1}\ncrc32c\n")
    with pytest.raises(JournalVersionError, match="format version 2"):
        JournalStorage(journal_dir)


def test_unknown_checksum_is_refused(journal_dir: Path) -> None:
    JournalStorage(journal_dir).close()
    (journal_dir / VERSION_FILE).write_text(f"{FORMAT_VERSION}\nsha1\n")
    with pytest.raises(JournalVersionError, match="sha1"):
        JournalStorage(journal_dir)


def test_a_journal_keeps_the_checksum_it_was_created_with(journal_dir: Path) -> None:
    journal_dir.mkdir()
    (journal_dir / VERSION_FILE).write_text(f"{FORMAT_VERSION}\ncrc32\n")
    store = JournalStorage(journal_dir)
    shard = store.open_shard("s", 0)
    shard.append([(T0, b"hello")])
    store.close()
    data = shard.segments[0].path().read_bytes()
    assert int.from_bytes(data[4:8], "little") == zlib.crc32(data[8:])
    reopened = JournalStorage(journal_dir)
    assert reopened.open_shard("s", 0).read(0)[0].data == b"hello"
    reopened.close()


# -- retention ------------------------------------------------------------------------------


def fill_segments(store: JournalStorage, count: int, per_group: int = 10) -> JournalShardLog:
    shard = store.open_shard("s", 0)
    for first in range(0, count, per_group):
        shard.append([(T0 + 1000 * (first + i), payload(first + i)) for i in range(per_group)])
        store.flush_sync()
    return shard


def test_delete_before_drops_whole_sealed_segments(journal_dir: Path) -> None:
    store = JournalStorage(journal_dir, segment_bytes=512)
    shard = fill_segments(store, 200)
    bases = [s.base_offset for s in shard.segments]
    assert shard.delete_before(bases[3] + 1) == bases[3]
    assert shard_files(store, ".log")[0].name == f"{bases[3]:020d}.log"
    assert shard.delete_before(10**9) == bases[-1]  # the active segment stays
    check_dense(shard.read(0), bases[-1], 200 - bases[-1])
    store.close()
    reopened = JournalStorage(journal_dir, segment_bytes=512)
    assert reopened.open_shard("s", 0).low_watermark == bases[-1]
    reopened.close()


def test_retention_by_size_never_passes_min_needed_offset(journal_dir: Path) -> None:
    store = JournalStorage(journal_dir, segment_bytes=512, retention_bytes=1500)
    shard = fill_segments(store, 200)
    bases = [s.base_offset for s in shard.segments]
    needed = bases[4] + 3
    assert shard.apply_retention(needed) == bases[4]
    assert shard.apply_retention(0) == bases[4]
    low = shard.apply_retention(10**9)
    assert sum(s.size for s in shard.segments) <= 1500 or len(shard.segments) == 1
    assert low > bases[4]
    check_dense(shard.read(0, 1000), low, 200 - low)
    store.close()


def test_retention_by_age_never_passes_min_needed_offset(journal_dir: Path) -> None:
    store = JournalStorage(journal_dir, segment_bytes=512, retention_ms=50_000)
    shard = fill_segments(store, 200)
    now = T0 + 1000 * 120  # records 0..69 are older than 50 s
    segments = shard.segments
    old_enough = [s for s in segments if s.max_timestamp < now - 50_000]
    assert 1 < len(old_enough) < len(segments)
    assert shard.apply_retention(old_enough[1].base_offset, now_ms=now) == old_enough[1].base_offset
    expected_low = old_enough[-1].next_offset
    assert shard.apply_retention(10**9, now_ms=now) == expected_low
    assert shard.read(0, 1)[0].offset == expected_low
    store.close()


# -- a crash of the process --------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from shardgate.storage.journal import JournalStorage

    async def main() -> None:
        store = JournalStorage(sys.argv[1], segment_bytes=8192, index_interval_bytes=512)
        shard = store.open_shard("s", 0)

        async def appender(k: int) -> None:
            while True:
                offset = shard.next_offset
                data = b"%d:%d:" % (offset, k) + bytes(k * 7)
                assert shard.append([(offset, data)]) == offset
                await shard.commit_waiter()
                sys.stdout.write(f"{offset}\\n")
                sys.stdout.flush()

        await asyncio.gather(*(appender(k) for k in range(16)))

    asyncio.run(main())
    """
)


def test_sigkill_loses_nothing_that_was_committed(journal_dir: Path) -> None:
    committed: list[int] = []
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, str(journal_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as child:
        assert child.stdout is not None and child.stderr is not None
        try:
            for line in child.stdout:
                committed.append(int(line))
                if len(committed) >= 3000:
                    break
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        errors = child.stderr.read().decode()
    assert len(committed) >= 3000, errors
    assert child.returncode == -signal.SIGKILL

    store = JournalStorage(journal_dir, segment_bytes=8192, index_interval_bytes=512)
    shard = store.open_shard("s", 0)
    assert len(shard.segments) > 3
    assert shard.committed_offset > max(committed)
    assert shard.next_offset >= shard.committed_offset
    got = {r.offset: r for r in shard.read(0, shard.next_offset)}
    assert sorted(got) == list(range(shard.committed_offset))
    for offset in committed:
        record = got[offset]
        assert record.timestamp_ms == offset
        assert record.data.startswith(b"%d:" % offset)
        k = int(record.data.split(b":")[1])
        assert record.data == b"%d:%d:" % (offset, k) + bytes(k * 7)
    store.close()


# -- a model of the log, driven by Hypothesis ---------------------------------------------------

operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("append"),
            st.integers(1, 6),
            st.integers(0, 90),
            st.integers(-50, 200),
        ),
        st.tuples(st.just("flush")),
        st.tuples(st.just("reopen")),
        st.tuples(st.just("crash-cut"), st.integers(1, 200)),
        st.tuples(st.just("delete-before"), st.integers(0, 400)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(ops=operations)
def test_journal_behaves_like_a_list_of_durable_records(
    ops: list[tuple[str | int, ...]],
) -> None:
    options = {"segment_bytes": 400, "index_interval_bytes": 64}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        store = JournalStorage(directory, **options)
        shard = store.open_shard("s", 0)
        durable: dict[int, tuple[int, bytes]] = {}
        pending: list[tuple[int, bytes]] = []
        # Offsets handed out before a crash whose records were lost: never reused, the next
        # append fills them with empty records.
        hole = 0
        clock = T0
        try:
            for op in ops:
                if op[0] == "append":
                    _, count, size, step = op
                    batch = []
                    for _ in range(int(count)):
                        clock += int(step)
                        batch.append((clock, bytes([len(durable) % 251]) * int(size)))
                    assert shard.append(batch) == shard.next_offset - len(batch)
                    pending.extend([(batch[0][0], b"")] * hole)
                    hole = 0
                    pending.extend(batch)
                elif op[0] == "flush":
                    store.flush_sync()
                    first = shard.committed_offset - len(pending)
                    durable.update(enumerate(pending, start=first))
                    pending = []
                elif op[0] == "reopen":
                    store.close()
                    first = shard.committed_offset - len(pending)
                    durable.update(enumerate(pending, start=first))
                    pending = []
                    store = JournalStorage(directory, **options)
                    shard = store.open_shard("s", 0)
                    assert shard.next_offset - shard.committed_offset == hole
                elif op[0] == "crash-cut":
                    # a crash: what was not written is gone, and the active file lost a tail
                    store.flush_sync()
                    first = shard.committed_offset - len(pending)
                    durable.update(enumerate(pending, start=first))
                    pending = []
                    active = shard.segments[-1]
                    store.close()
                    cut = max(0, active.size - int(op[1]))
                    os.truncate(active.path(), cut)
                    store = JournalStorage(directory, **options)
                    shard = store.open_shard("s", 0)
                    for offset in [o for o in durable if o >= shard.committed_offset]:
                        del durable[offset]
                    assert shard.committed_offset >= active.base_offset
                    hole = shard.next_offset - shard.committed_offset
                else:
                    low = shard.delete_before(int(op[1]))
                    assert low <= max(int(op[1]), shard.low_watermark)
                    for offset in [o for o in durable if o < low]:
                        del durable[offset]

                # the published log is exactly the durable records, densely numbered
                low, end = shard.low_watermark, shard.committed_offset
                assert sorted(durable) == list(range(low, end))
                got = shard.read(0, 10_000)
                assert [(r.offset, r.timestamp_ms, r.data) for r in got] == [
                    (o, *durable[o]) for o in range(low, end)
                ]
                for start in range(low, end, 7):
                    assert [r.offset for r in shard.read(start, 3)] == list(
                        range(start, min(start + 3, end))
                    )
                for target in {ts for ts, _ in durable.values()} | {clock + 1, 0}:
                    expected = next((o for o in range(low, end) if durable[o][0] >= target), end)
                    assert shard.offset_for_timestamp(target) == expected
        finally:
            store.close()


@pytest.mark.parametrize("policy", ["always", "interval", "os"])
async def test_acknowledged_records_survive_random_io_failures(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    rng = random.Random(policy)
    real_write, real_sync, real_pwritev = os.write, log_module.sync_file, os.pwritev

    def flaky_write(fd: int, data: bytes) -> int:
        roll = rng.random()
        if roll < 0.08:
            raise OSError(errno.ENOSPC, "No space left on device")
        if roll < 0.16:  # a short write, then (usually) a failure on the retry
            return real_write(fd, memoryview(data)[: max(1, len(data) // 3)])
        return real_write(fd, data)

    def flaky_pwritev(fd: int, buffers: list[bytes], position: int, flags: int = 0) -> int:
        """A write that also syncs (the `always` policy): fails as a write or an fsync."""
        roll = rng.random()
        if roll < 0.08:
            raise OSError(errno.ENOSPC, "No space left on device")
        if roll < 0.12:
            raise OSError(errno.EIO, "Input/output error")
        data = memoryview(buffers[0])
        if roll < 0.2:  # a short write, then (usually) a failure on the retry
            return real_pwritev(fd, [data[: max(1, len(data) // 3)]], position, flags)
        return real_pwritev(fd, [data], position, flags)

    def flaky_sync(fd: int) -> None:
        if rng.random() < 0.08:
            raise OSError(errno.EIO, "Input/output error")
        real_sync(fd)

    options = {
        "fsync": policy,
        "fsync_interval_ms": 5,
        "segment_bytes": 2048,
        "index_interval_bytes": 128,
    }
    store = JournalStorage(journal_dir, **options)  # type: ignore[arg-type]
    shard = store.open_shard("s", 0)
    monkeypatch.setattr(segment_module.os, "write", flaky_write)
    monkeypatch.setattr(segment_module.os, "pwritev", flaky_pwritev)
    monkeypatch.setattr(log_module, "sync_file", flaky_sync)
    acked: dict[int, bytes] = {}
    failures = 0

    async def appender(k: int) -> None:
        nonlocal failures
        for j in range(40):
            batch = [(T0 + j, b"%d-%d-%d" % (k, j, i)) for i in range(1 + j % 3)]
            first = shard.append(batch)
            try:
                await shard.commit_waiter()  # type: ignore[misc]
            except StorageFull:
                failures += 1
                continue
            for i, (_, data) in enumerate(batch):
                acked[first + i] = data

    await asyncio.gather(*(appender(k) for k in range(12)))
    monkeypatch.undo()
    await store.flush()
    assert failures > 0 and acked

    def check(shard: JournalShardLog) -> None:
        got = shard.read(0, 100_000)
        assert [r.offset for r in got] == list(range(shard.committed_offset))
        by_offset = {r.offset: r.data for r in got}
        for offset, data in acked.items():
            assert by_offset[offset] == data

    check(shard)
    store.close()
    reopened = JournalStorage(journal_dir, **options)  # type: ignore[arg-type]
    check(reopened.open_shard("s", 0))
    reopened.close()


# -- bulk reads ---------------------------------------------------------------------------------


def test_read_block_returns_what_read_returns_without_an_object_per_record(
    storage: JournalStorage,
) -> None:
    shard = storage.open_shard("s", 0)
    for first in range(0, 300, 37):  # several groups, several segments (4 KiB each)
        shard.append(records(first, min(37, 300 - first)))
        storage.flush_sync()
    assert len(shard.segments) >= 3
    for start in (0, 1, 36, 150, 299, 300, 1000):
        got: list[StoredRecord] = []
        position = start
        while True:
            block = shard.read_block(position, 64)
            if not block:
                assert block.first_offset == max(position, 0)
                break
            assert block.first_offset == position and len(block) <= 64
            assert block.end_offset == position + len(block)
            assert [block.data(i) for i in range(len(block))] == [r.data for r in block]
            got.extend(block)
            position = block.end_offset
        assert got == shard.read(start, 1000)


def test_read_block_of_a_single_record_larger_than_its_chunk(journal_dir: Path) -> None:
    store = JournalStorage(journal_dir)
    shard = store.open_shard("s", 0)
    big = os.urandom(300_000)
    shard.append([(T0, b"small"), (T0 + 1, big), (T0 + 2, b"after")])
    store.flush_sync()
    segment = shard.segments[-1]
    block = segment.read_block(1, 10, chunk=1024)
    assert block.first_offset == 1 and block.data(0) == big
    assert [r.data for r in segment.read_block(0, 10, chunk=1024)] == [b"small"]
    store.close()


def test_read_block_raises_on_a_corrupt_record(journal_dir: Path) -> None:
    ends = write_closed_journal(journal_dir, 10)
    store = JournalStorage(journal_dir)
    shard = store.open_shard("s", 0)
    path = shard.segments[-1].path()
    data = bytearray(path.read_bytes())
    data[ends[3] + HEADER_SIZE] ^= 0xFF  # the data of record 4, behind the published end
    path.write_bytes(bytes(data))
    assert len(shard.read_block(0, 4)) == 4
    with pytest.raises(CorruptRecord, match="checksum"):
        shard.read_block(2, 10)
    store.close()


# -- one system call per durable write ----------------------------------------------------------


def test_a_durable_write_falls_back_to_write_and_fdatasync_where_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where pwritev2(RWF_DSYNC) is refused (old kernel, file system without it), the write
    and an fdatasync do the same, and the flag is not tried again."""
    refused: list[int] = []
    synced: list[int] = []

    def pwritev(fd: int, buffers: list[bytes], position: int, flags: int = 0) -> int:
        refused.append(fd)
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    real_sync = segment_module.sync_file
    monkeypatch.setattr(segment_module.os, "pwritev", pwritev)
    monkeypatch.setattr(segment_module, "sync_file", lambda fd: (synced.append(fd), real_sync(fd)))
    monkeypatch.setattr(segment_module, "_durable_writes", True)
    path = tmp_path / "file"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        segment_module.write_durably(fd, b"one", 0)
        segment_module.write_durably(fd, b"two", 3)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"onetwo"
    assert len(refused) == 1 and len(synced) == 2
    assert segment_module._durable_writes is False


@pytest.mark.skipif(not hasattr(os, "RWF_DSYNC"), reason="no pwritev2(RWF_DSYNC) here")
async def test_policy_always_writes_and_syncs_a_group_in_one_call(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, int]] = []
    real_pwritev, real_write, real_sync = os.pwritev, os.write, segment_module.sync_file

    def pwritev(fd: int, buffers: list[bytes], position: int, flags: int = 0) -> int:
        calls.append(("pwritev", flags))
        return real_pwritev(fd, buffers, position, flags)

    def write(fd: int, data: bytes) -> int:
        calls.append(("write", 0))
        return real_write(fd, data)

    store = JournalStorage(journal_dir, fsync="always")
    shard = store.open_shard("s", 0)
    shard.append(records(0, 3))
    await shard.flush()  # the first pass also makes the offset reservation durable
    monkeypatch.setattr(segment_module.os, "pwritev", pwritev)
    monkeypatch.setattr(segment_module.os, "write", write)
    monkeypatch.setattr(log_module, "sync_file", lambda fd: (calls.append(("sync", 0)), real_sync(fd)))
    shard.append(records(3, 4))
    await shard.flush()
    assert calls == [("pwritev", os.RWF_DSYNC)]
    monkeypatch.undo()
    store.close()
    reopened = JournalStorage(journal_dir)
    check_dense(reopened.open_shard("s", 0).read(0), 0, 7)
    reopened.close()
