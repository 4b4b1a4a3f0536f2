"""The journal keeps at most `max_open_files` segment and reservation files open, every shard
together (`storage/journal/handles.py`): a journal of many shards does not hold a descriptor
per file (19 streams of 1,024 partitions held 19,488, after which no client could connect),
and every record stays readable, written, fsynced and recovered as before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from shardgate.storage.journal import JournalStorage
from shardgate.storage.journal.handles import OpenFiles


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc")


def fill(journal: JournalStorage, shards: int, records: int) -> None:
    for shard in range(shards):
        log = journal.open_shard("wide", shard)
        for index in range(records):
            log.append([(1_000 + index, f"s{shard}-r{index}".encode() * 20)])
        log.flush_sync()


def test_many_shards_hold_at_most_max_open_files_descriptors(tmp_path: Path) -> None:
    before = open_descriptors()
    journal = JournalStorage(tmp_path / "j", segment_bytes=4096, max_open_files=16)
    try:
        fill(journal, shards=200, records=30)  # several segments per shard, 200 reservations
        assert open_descriptors() - before <= 16 + 4  # (+ the lock file, the committer's thread)
        for shard in range(200):
            log = journal.open_shard("wide", shard)
            records = log.read(0, 100)
            assert [r.offset for r in records] == list(range(30))
            assert records[-1].data == f"s{shard}-r29".encode() * 20
        assert open_descriptors() - before <= 16 + 4
    finally:
        journal.close()
    assert open_descriptors() <= before
    reopened = JournalStorage(tmp_path / "j", segment_bytes=4096, max_open_files=16)
    try:
        for shard in (0, 99, 199):
            log = reopened.open_shard("wide", shard)
            assert log.next_offset == 30
            log.append([(5_000, b"after restart")])
            log.flush_sync()
            assert log.read(30, 1)[0].data == b"after restart"
        assert open_descriptors() - before <= 16 + 4
    finally:
        reopened.close()


def test_a_file_in_use_is_never_closed_under_its_user(tmp_path: Path) -> None:
    files = OpenFiles(limit=1)
    paths = [tmp_path / f"f{i}" for i in range(3)]
    for path in paths:
        path.write_bytes(path.name.encode())
    handles = [files.handle(path, os.O_RDONLY) for path in paths]
    with handles[0] as first, handles[1] as second:
        # both pinned: two open for a moment, over the limit
        assert os.pread(first, 2, 0) == b"f0" and os.pread(second, 2, 0) == b"f1"
        assert len(files) == 2
    assert len(files) == 1  # back to the limit once released
    with handles[2] as third:
        assert os.pread(third, 2, 0) == b"f2"
    assert not handles[0].is_open and not handles[1].is_open
    with handles[0] as again:  # opened again when used again
        assert os.pread(again, 2, 0) == b"f0"
    for handle in handles:
        handle.close()
    assert len(files) == 0
