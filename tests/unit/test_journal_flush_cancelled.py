"""A flush cancelled while it waits (a replica's follower stopped as its role changes) leaves
the commit group's future alone: the group's other appenders still wait on it, and the node
that leads the log next takes its outcome, not a cancellation it would read as a failed
commit (resigning the shard the placement just gave it, or ending its role change)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from shardgate.storage.journal import JournalStorage


async def test_a_cancelled_log_flush_leaves_the_group_future_to_its_other_appenders(tmp_path: Path) -> None:
    storage = JournalStorage(tmp_path)
    try:
        log = storage.open_shard("s", 0)
        log.append([(0, b"kept")])
        group = log.commit_waiter()
        assert group is not None
        flush = asyncio.ensure_future(log.flush())
        await asyncio.sleep(0)  # waiting for the group now
        flush.cancel()
        await asyncio.wait((flush,), timeout=5)
        assert flush.cancelled()
        await asyncio.wait((group,), timeout=10)
        assert group.done() and not group.cancelled() and group.exception() is None
        assert log.committed_offset == 1
    finally:
        storage.close()


async def test_a_cancelled_storage_flush_leaves_every_group_future_alone(tmp_path: Path) -> None:
    storage = JournalStorage(tmp_path)
    try:
        logs = [storage.open_shard("s", index) for index in range(2)]
        for log in logs:
            log.append([(0, b"kept")])
        groups = [log.commit_waiter() for log in logs]
        flush = asyncio.ensure_future(storage.flush())
        await asyncio.sleep(0)
        flush.cancel()
        await asyncio.wait((flush,), timeout=5)
        assert flush.cancelled()
        await asyncio.wait(groups, timeout=10)  # type: ignore[arg-type]
        assert all(g is not None and g.done() and not g.cancelled() for g in groups)
    finally:
        storage.close()
