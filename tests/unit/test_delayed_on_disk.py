"""Delayed messages of a single node live in the metadata store, not in memory
(core/delayed.py): a flood of them costs disk, a restart reads none before it is due, and
they are released in deliver-at order, in batches."""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from pathlib import Path

import pytest
from shardgate.core import delayed as delayed_module
from shardgate.core.delayed import DelayedDelivery
from shardgate.core.message import Message, now_ms
from shardgate.storage.metadata.ports import MetadataPorts
from shardgate.storage.metadata.sqlite import SqliteMetadataStore


async def test_a_flood_of_delayed_messages_is_kept_on_disk_not_in_memory(tmp_path: Path) -> None:
    store = SqliteMetadataStore(tmp_path / "meta.db")
    released: list[Message] = []
    delivery = DelayedDelivery(MetadataPorts(store), released.append)
    payload = bytes(1024 * 1024)
    later = now_ms() + 3_600_000
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for number in range(60):
            delivery.hold(Message(f"jobs/{number}", payload + bytes([number])), later + number)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        delivery.close()
    assert len(delivery) == 60
    # 60 MiB held: memory keeps a count and one timer, not the payloads
    assert grown < 8 * 1024 * 1024, grown
    assert released == []
    store.close()


async def test_held_messages_survive_a_restart_and_are_released_in_order_in_batches(
        tmp_path: Path) -> None:
    store = SqliteMetadataStore(tmp_path / "meta.db")
    first = DelayedDelivery(MetadataPorts(store), lambda message: None)
    soon = now_ms() + 300
    count = DelayedDelivery.RELEASE_BATCH * 2 + 5
    for number in range(count):
        # held out of order: released by deliver-at time
        first.hold(Message(f"jobs/{number}", str(number).encode()), soon + (count - number) % 7)
    first.close()  # the run ends before any is due
    store.close()

    store = SqliteMetadataStore(tmp_path / "meta.db")
    released: list[Message] = []
    everything = asyncio.get_running_loop().create_future()

    def publish(message: Message) -> None:
        released.append(message)
        if len(released) == count:
            everything.set_result(None)

    second = DelayedDelivery(MetadataPorts(store), publish)
    assert second.restore() == count and released == []
    await asyncio.wait_for(everything, 30)
    assert sorted(int(m.payload) for m in released) == list(range(count))
    due = [soon + (count - int(m.payload)) % 7 for m in released]
    assert due == sorted(due)
    assert len(second) == 0 and store.delayed_summary(2**62) == (0, None)
    second.close()
    store.close()


async def test_a_record_that_cannot_be_read_is_set_aside_and_the_rest_released(tmp_path: Path) -> None:
    store = SqliteMetadataStore(tmp_path / "meta.db")
    store.put_delayed("garbage", 1, b"\x00not a record")
    released = asyncio.get_running_loop().create_future()
    delivery = DelayedDelivery(MetadataPorts(store), released.set_result)
    assert delivery.restore() == 1
    delivery.hold(Message("jobs/good", b"good"), now_ms() + 50)
    message = await asyncio.wait_for(released, 30)
    assert message.payload == b"good"
    # kept in the store, never due
    assert store.delayed_summary(DelayedDelivery.SET_ASIDE_AT_MS) == (1, None)
    delivery.close()
    store.close()



class _SlowReads:
    """The metadata store, whose reads of due rows take 30 ms (a busy disk)."""

    def __init__(self, ports: MetadataPorts) -> None:
        self.ports = ports

    def __getattr__(self, name: str) -> object:
        return getattr(self.ports, name)

    def due_delayed(self, now: int, limit: int | None = None) -> list:
        records = self.ports.due_delayed(now, limit)
        time.sleep(0.03)
        return records


async def test_a_timer_that_fires_before_the_wall_clock_due_time_still_releases_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The loop's timer runs on the monotonic clock, deliver-at times on the wall clock: the two
    # drift, so the timer can fire when the wall clock is just short of the due time, and the row
    # is due a moment later. That must not pass for a row that cannot be read (looked at again
    # only after a minute): here the wall clock steps back 10 ms after the hold.
    offset_ms = [10]
    monkeypatch.setattr(delayed_module, "now_ms", lambda: now_ms() + offset_ms[0])
    store = SqliteMetadataStore(tmp_path / "meta.db")
    released = asyncio.get_running_loop().create_future()
    delivery = DelayedDelivery(_SlowReads(MetadataPorts(store)), released.set_result)  # type: ignore[arg-type]
    delivery.hold(Message("jobs/soon", b"soon"), delayed_module.now_ms() + 5)
    offset_ms[0] = 0
    message = await asyncio.wait_for(released, 5)
    assert message.payload == b"soon"
    delivery.close()
    store.close()
