"""The memory and disk alarms raise and clear with hysteresis, telling their listeners once per
change (`shardgate/resources.py`); the journal refuses appends while the disk alarm holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from shardgate.storage.interfaces import StorageFull
from shardgate.storage.journal import JournalStorage

from shardgate.resources import ResourceAlarms, physical_memory, watermark_bytes


async def test_each_alarm_is_told_once_when_raised_and_once_when_cleared(tmp_path: Path) -> None:
    memory = [100]
    free = [10_000]
    told_memory: list[bool] = []
    told_disk: list[str | None] = []
    alarms = ResourceAlarms(tmp_path, 1_000.0, 1_000, told_memory.append, told_disk.append,
                            resident=lambda: memory[0], free_disk=lambda: free[0])
    for used, room in ((100, 10_000), (1_001, 999), (1_200, 500), (950, 1_050), (899, 1_101)):
        memory[0], free[0] = used, room
        alarms.check()
    alarms.stop()
    # raised above the watermark, cleared only below 90 % of it; the disk likewise above +10 %
    assert told_memory == [True, False]
    assert [reason is not None for reason in told_disk] == [True, False]
    assert "disk_free_limit" in str(told_disk[0])


def test_the_watermark_is_a_share_of_memory_or_bytes() -> None:
    assert watermark_bytes(0) == 0
    assert watermark_bytes(0.5) == physical_memory() // 2
    assert watermark_bytes(4096) == 4096


def test_the_journal_refuses_appends_while_the_disk_alarm_holds(tmp_path: Path) -> None:
    journal = JournalStorage(tmp_path / "j")
    try:
        log = journal.open_shard("s", 0)
        journal.refuse_appends("the disk is nearly full")
        with pytest.raises(StorageFull, match="nearly full"):
            log.append([(1, b"x")])
        journal.refuse_appends(None)
        assert log.append([(1, b"x")]) == 0
        log.flush_sync()
    finally:
        journal.close()
