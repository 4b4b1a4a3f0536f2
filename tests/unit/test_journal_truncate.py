"""Journal pieces a replica needs (issue 28): `truncate_to(offset)` cuts a shard log back,
across segments, surviving a reopen; and the leader-epoch checkpoint (Kafka's KIP-101) kept
beside it, persisted atomically."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from shardgate.storage.journal import (
    CorruptCheckpoint,
    EpochEndOffset,
    EpochEntry,
    JournalBusy,
    JournalClosed,
    JournalStorage,
    LeaderEpochCache,
)
from shardgate.storage.journal.epochs import CHECKPOINT_FILE, UNDEFINED

T0 = 1_700_000_000_000


def records(first: int, count: int, tag: str = "r") -> list[tuple[int, bytes]]:
    return [(T0 + first + i, f"{tag}-{first + i}".encode()) for i in range(count)]


def datas(store_log: object, start: int = 0) -> list[bytes]:
    return [record.data for record in store_log.read(start, 100_000)]  # type: ignore[attr-defined]


def filled(directory: Path, count: int = 600) -> tuple[JournalStorage, object]:
    store = JournalStorage(directory, segment_bytes=2048, index_interval_bytes=128)
    shard = store.open_shard("s", 0)
    for first in range(0, count, 50):
        shard.append(records(first, 50))
        store.flush_sync()
    return store, shard


# -- truncate_to ----------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [599, 421, 300, 1])
def test_truncate_cuts_the_log_and_the_next_append_reuses_the_offset(tmp_path: Path, cut: int) -> None:
    store, shard = filled(tmp_path)
    assert len(shard.segments) > 5  # type: ignore[attr-defined]
    assert shard.truncate_to(cut) == cut  # type: ignore[attr-defined]
    assert shard.next_offset == shard.committed_offset == cut  # type: ignore[attr-defined]
    assert datas(shard) == [f"r-{i}".encode() for i in range(cut)]
    assert all(segment.base_offset <= cut for segment in shard.segments)  # type: ignore[attr-defined]
    assert shard.append(records(cut, 3, "new")) == cut  # type: ignore[attr-defined]
    store.flush_sync()
    assert datas(shard, cut) == [f"new-{i}".encode() for i in range(cut, cut + 3)]
    store.close()

    reopened = JournalStorage(tmp_path, segment_bytes=2048, index_interval_bytes=128)
    shard = reopened.open_shard("s", 0)
    assert shard.next_offset == cut + 3  # no gap: the reservation came down with the cut
    assert datas(shard) == [f"r-{i}".encode() for i in range(cut)] + [
        f"new-{i}".encode() for i in range(cut, cut + 3)]
    assert shard.offset_for_timestamp(T0 + cut) == cut
    reopened.close()


def test_truncate_at_a_segment_boundary_and_at_or_past_the_end(tmp_path: Path) -> None:
    store, shard = filled(tmp_path)
    bases = [segment.base_offset for segment in shard.segments]  # type: ignore[attr-defined]
    boundary = bases[3]
    assert shard.truncate_to(10_000) == 600  # type: ignore[attr-defined]
    assert shard.truncate_to(600) == 600  # type: ignore[attr-defined]
    assert shard.truncate_to(boundary) == boundary  # type: ignore[attr-defined]
    assert [segment.base_offset for segment in shard.segments] == bases[:3]  # type: ignore[attr-defined]
    assert datas(shard) == [f"r-{i}".encode() for i in range(boundary)]
    shard.append(records(boundary, 1, "new"))  # type: ignore[attr-defined]
    store.flush_sync()
    assert datas(shard, boundary - 1) == [f"r-{boundary - 1}".encode(), f"new-{boundary}".encode()]
    store.close()


def test_truncate_below_the_low_watermark_empties_the_log_to_start_there(tmp_path: Path) -> None:
    store, shard = filled(tmp_path)
    low = shard.delete_before(250)  # type: ignore[attr-defined]
    assert low > 0
    assert shard.truncate_to(low - 1) == low - 1  # type: ignore[attr-defined]
    assert (shard.low_watermark, shard.next_offset) == (low - 1, low - 1)  # type: ignore[attr-defined]
    assert datas(shard) == []
    shard.append(records(low - 1, 2, "new"))  # type: ignore[attr-defined]
    store.flush_sync()
    store.close()
    reopened = JournalStorage(tmp_path, segment_bytes=2048, index_interval_bytes=128)
    shard = reopened.open_shard("s", 0)
    assert (shard.low_watermark, shard.next_offset) == (low - 1, low + 1)
    assert datas(shard) == [f"new-{i}".encode() for i in (low - 1, low)]
    reopened.close()


def test_truncate_refuses_while_records_wait_for_the_disk_and_once_closed(tmp_path: Path) -> None:
    async def scenario() -> None:
        store, shard = filled(tmp_path, 100)
        shard.append(records(100, 5))  # type: ignore[attr-defined]
        with pytest.raises(JournalBusy):
            shard.truncate_to(50)  # type: ignore[attr-defined]
        await shard.flush()  # type: ignore[attr-defined]
        assert shard.truncate_to(50) == 50  # type: ignore[attr-defined]
        store.close()
        with pytest.raises(JournalClosed):
            shard.truncate_to(10)  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_truncate_drops_the_epochs_that_start_at_or_after_the_cut(tmp_path: Path) -> None:
    store, shard = filled(tmp_path)
    epochs = shard.leader_epochs  # type: ignore[attr-defined]
    epochs.assign(1, 0)
    epochs.assign(2, 200)
    epochs.assign(4, 450)
    shard.truncate_to(450)  # type: ignore[attr-defined]
    assert epochs.entries == (EpochEntry(1, 0), EpochEntry(2, 200))
    store.close()
    reopened = JournalStorage(tmp_path, segment_bytes=2048, index_interval_bytes=128)
    assert reopened.open_shard("s", 0).leader_epochs.entries == (EpochEntry(1, 0), EpochEntry(2, 200))
    reopened.close()


def test_retention_moves_the_first_epoch_to_the_new_low_watermark(tmp_path: Path) -> None:
    store, shard = filled(tmp_path)
    epochs = shard.leader_epochs  # type: ignore[attr-defined]
    epochs.assign(1, 0)
    epochs.assign(3, 100)
    epochs.assign(5, 500)
    low = shard.delete_before(300)  # type: ignore[attr-defined]
    assert 100 < low <= 300
    assert epochs.entries == (EpochEntry(3, low), EpochEntry(5, 500))
    store.close()


# -- LeaderEpochCache -----------------------------------------------------------------------


def test_assign_keeps_epochs_in_order_and_ignores_stale_ones(tmp_path: Path) -> None:
    cache = LeaderEpochCache(tmp_path)
    assert cache.latest_epoch == UNDEFINED and cache.entries == ()
    assert not (tmp_path / CHECKPOINT_FILE).exists()  # no file until an epoch is assigned
    assert cache.assign(1, 0)
    assert cache.assign(3, 10)
    assert not cache.assign(3, 12)  # already known
    assert not cache.assign(2, 20)  # older than the latest
    assert cache.entries == (EpochEntry(1, 0), EpochEntry(3, 10))
    # a new epoch starting before an older one's start replaces it (that part was truncated)
    assert cache.assign(4, 5)
    assert cache.entries == (EpochEntry(1, 0), EpochEntry(4, 5))
    assert cache.latest_epoch == 4
    with pytest.raises(ValueError):
        cache.assign(-1, 0)


def test_end_offset_for_answers_as_a_leader_does_for_a_follower(tmp_path: Path) -> None:
    cache = LeaderEpochCache(tmp_path)
    cache.assign(2, 0)
    cache.assign(5, 100)
    cache.assign(7, 180)
    assert cache.end_offset_for(1, 250) == EpochEndOffset(UNDEFINED, UNDEFINED)
    assert cache.end_offset_for(2, 250) == EpochEndOffset(2, 100)
    assert cache.end_offset_for(3, 250) == EpochEndOffset(2, 100)  # unknown: the one below
    assert cache.end_offset_for(5, 250) == EpochEndOffset(5, 180)
    assert cache.end_offset_for(6, 250) == EpochEndOffset(5, 180)
    assert cache.end_offset_for(7, 250) == EpochEndOffset(7, 250)  # the latest: the log end
    assert cache.end_offset_for(9, 250) == EpochEndOffset(7, 250)
    assert LeaderEpochCache(tmp_path / "none").end_offset_for(3, 0) == EpochEndOffset(UNDEFINED, UNDEFINED)


def test_truncate_from_and_until(tmp_path: Path) -> None:
    cache = LeaderEpochCache(tmp_path)
    for epoch, start in ((1, 0), (2, 40), (3, 90)):
        cache.assign(epoch, start)
    assert not cache.truncate_from(91)
    assert cache.truncate_from(40)
    assert cache.entries == (EpochEntry(1, 0),)
    cache.assign(4, 60)
    assert cache.truncate_until(50)
    assert cache.entries == (EpochEntry(1, 50), EpochEntry(4, 60))
    assert not cache.truncate_until(50)
    assert cache.truncate_until(70)
    assert cache.entries == (EpochEntry(4, 70),)
    cache.clear()
    assert LeaderEpochCache(tmp_path).entries == ()


def test_the_checkpoint_is_kafkas_text_file_and_survives_a_reopen(tmp_path: Path) -> None:
    cache = LeaderEpochCache(tmp_path)
    cache.assign(1, 0)
    cache.assign(3, 1200)
    assert (tmp_path / CHECKPOINT_FILE).read_text() == "0\n2\n1 0\n3 1200\n"
    assert not list(tmp_path.glob("*.tmp"))
    assert LeaderEpochCache(tmp_path).entries == (EpochEntry(1, 0), EpochEntry(3, 1200))


@pytest.mark.parametrize("content", [
    "1\n1\n1 0\n",          # unknown version
    "0\n2\n1 0\n",          # fewer entries than announced
    "0\n2\n3 0\n1 10\n",    # epochs out of order
    "0\n1\none 0\n",        # not a number
    "",
])
def test_a_damaged_checkpoint_is_a_clear_error(tmp_path: Path, content: str) -> None:
    (tmp_path / CHECKPOINT_FILE).write_text(content)
    with pytest.raises(CorruptCheckpoint, match=CHECKPOINT_FILE):
        LeaderEpochCache(tmp_path)


# -- start_at ---------------------------------------------------------------------------------


def test_an_empty_log_starts_at_an_offset_and_keeps_it_across_a_reopen(tmp_path: Path) -> None:
    store = JournalStorage(tmp_path, segment_bytes=2048, index_interval_bytes=128)
    shard = store.open_shard("s", 0)
    assert not shard.holds_records
    assert shard.start_at(0) == 0  # at or before its end: nothing changes
    assert shard.start_at(700) == 700
    assert (shard.low_watermark, shard.next_offset, shard.committed_offset) == (700, 700, 700)
    assert shard.append(records(700, 3, "new")) == 700
    store.flush_sync()
    assert datas(shard, 0) == [f"new-{i}".encode() for i in range(700, 703)]
    assert shard.holds_records
    with pytest.raises(JournalBusy):
        shard.start_at(2000)  # it holds records now
    store.close()
    reopened = JournalStorage(tmp_path, segment_bytes=2048, index_interval_bytes=128)
    shard = reopened.open_shard("s", 0)
    assert (shard.low_watermark, shard.next_offset) == (700, 703)
    reopened.close()
