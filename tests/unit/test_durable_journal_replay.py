"""Durable replay over the journal, which reads records in blocks (one buffer, no object per
record): the same deliveries as replay over a per-record log, in order, without gap or
duplicate, when the consumer's window fills mid-block and when most records are unwanted."""

from __future__ import annotations

import asyncio

import pytest
from shardgate.core.broker import Broker
from shardgate.core.durable import AHEAD_BYTES, SCAN_BUDGET
from shardgate.core.message import Message
from shardgate.core.streams import StreamConfig
from shardgate.storage.interfaces import BlockReadable
from shardgate.storage.journal import JournalStorage
from shardgate.storage.journal.keyindex import INDEX_RECORDS
from shardgate.storage.memory import MemoryStorage

from tests.unit.recording_consumer import Consumer


def reliable(storage: object) -> Broker:
    return Broker(storage, StreamConfig("default", mode="reliable"))  # type: ignore[arg-type]


def publish_mixed(broker: Broker, count: int) -> None:
    """Every third record wanted (`want/...`), some of them large, topics with non-ASCII."""
    for i in range(count):
        if i % 3 == 0:
            payload = (b"%d;" % i) + (b"x" * 70_000 if i % 100 == 0 else b"")
            broker.publish(Message(f"want/é{i % 7}", payload))
        else:
            broker.publish(Message(f"other/{i % 11}", b"%d" % i))


async def replay_all(broker: Broker, window: int, expected: int) -> list[int]:
    sub = broker.durable_subscription("replayer", initial_position="earliest")
    broker.add_filter(sub, "want/#")
    consumer = Consumer("c", window=window)
    broker.attach(sub, consumer)
    for _ in range(20_000):
        await asyncio.sleep(0)
        consumer.ack_all()
        if len(consumer.got) >= expected:
            break
    await asyncio.sleep(0)
    return [int(m.payload.split(b";")[0]) for m in consumer.got]


@pytest.mark.parametrize("window", [1, 7, 1000])
async def test_replay_from_the_journal_delivers_what_a_per_record_log_does(
    journal: JournalStorage, window: int
) -> None:
    count = 3000
    expected = list(range(0, count, 3))
    on_journal = reliable(journal)
    assert isinstance(on_journal.stream("default").shards[0].log, BlockReadable)
    publish_mixed(on_journal, count)
    await journal.flush()
    in_memory = reliable(MemoryStorage(max_records_per_shard=1_000_000))
    assert not isinstance(in_memory.stream("default").shards[0].log, BlockReadable)
    publish_mixed(in_memory, count)
    assert await replay_all(on_journal, window, len(expected)) == expected
    assert await replay_all(in_memory, window, len(expected)) == expected


async def test_a_block_kept_between_turns_is_not_read_again(journal: JournalStorage) -> None:
    """A consumer with a window of one: the rest of the block waits on the cursor (bounded by
    AHEAD_BYTES) instead of being read again each turn."""
    broker = reliable(journal)
    shard_log = broker.stream("default").shards[0].log
    for i in range(600):
        broker.publish(Message("t/1", b"%d" % i))
    await journal.flush()
    reads: list[int] = []
    read_block = shard_log.read_block  # type: ignore[union-attr]

    def counting_read_block(from_offset: int, max_records: int = 10_000):
        reads.append(from_offset)
        block = read_block(from_offset, max_records)
        assert len(block.buffer) <= 2 * AHEAD_BYTES
        return block

    shard_log.read_block = counting_read_block  # type: ignore[union-attr]
    sub = broker.durable_subscription("slow", initial_position="earliest")
    broker.add_filter(sub, "t/#")
    consumer = Consumer("c", window=1)
    broker.attach(sub, consumer)
    for _ in range(3000):
        await asyncio.sleep(0)
        consumer.ack_all()
        if len(consumer.got) == 600:
            break
    assert [int(m.payload) for m in consumer.got] == list(range(600))
    assert len(reads) <= 600 // 256 + 3


async def test_a_cursor_far_behind_in_the_journal_yields_between_turns(
    plain_journal: JournalStorage,
) -> None:
    """Without a key index (a segment opened sealed, or a journal without keys) the records
    are scanned, a bounded number per turn."""
    journal = plain_journal
    broker = reliable(journal)
    sub = broker.durable_subscription("resuming", initial_position="earliest")
    broker.add_filter(sub, "want/#")
    for i in range(10_000):
        broker.publish(Message(f"other/{i % 50}", b"x"))
    broker.publish(Message("want/1", b"wanted"))
    await journal.flush()
    consumer = Consumer("c", auto_ack=True)
    broker.attach(sub, consumer)
    cursor = sub.cursors[("default", 0)]
    turns = 0
    while not consumer.got and turns < 100:
        before = cursor.position
        await asyncio.sleep(0)
        turns += 1
        assert cursor.position - before <= SCAN_BUDGET + 256
    assert [m.payload for m in consumer.got] == [b"wanted"]
    assert turns >= 10_000 // (SCAN_BUDGET + 256)


async def test_a_cursor_far_behind_passes_unwanted_records_through_the_key_index(
    journal: JournalStorage,
) -> None:
    """With the key index, the records of other topics are never read in blocks nor decoded:
    the index passes them (indexing at most `INDEX_RECORDS` per read), and the wanted one is
    delivered within a few turns."""
    broker = reliable(journal)
    sub = broker.durable_subscription("resuming", initial_position="earliest")
    broker.add_filter(sub, "want/#")
    for i in range(10_000):
        broker.publish(Message(f"other/{i % 50}", b"x"))
    broker.publish(Message("want/1", b"wanted"))
    await journal.flush()
    shard_log = broker.stream("default").shards[0].log

    def no_block_reads(from_offset: int, max_records: int = 10_000) -> None:
        raise AssertionError("scanned a block")

    shard_log.read_block = no_block_reads  # type: ignore[union-attr]
    consumer = Consumer("c", auto_ack=True)
    broker.attach(sub, consumer)
    turns = 0
    while not consumer.got and turns < 50:
        await asyncio.sleep(0)
        turns += 1
    assert [m.payload for m in consumer.got] == [b"wanted"]
    assert turns <= 10_001 // INDEX_RECORDS + 2
    assert sub.cursors[("default", 0)].position == 10_001



async def test_replay_keeps_nothing_per_topic(journal: JournalStorage) -> None:
    """Topics that rarely repeat (an id in every topic) leave the replaying subscription no
    state per topic: what it keeps does not grow with the number of distinct topics read."""
    import gc
    import tracemalloc

    broker = reliable(journal)
    count = 3000
    for i in range(count):
        wanted = i % 3 == 0
        broker.publish(Message(f"{'want' if wanted else 'other'}/site/devices/{i}/temperature", b"%d" % i))
    await journal.flush()
    tracemalloc.start(1)
    try:
        sub = broker.durable_subscription("replayer", initial_position="earliest")
        broker.add_filter(sub, "want/#")
        consumer = Consumer("c", window=1000)
        broker.attach(sub, consumer)
        got: list[int] = []
        for _ in range(20_000):
            await asyncio.sleep(0)
            consumer.ack_all()
            got += [int(m.payload) for m in consumer.got]
            consumer.got.clear()
            if len(got) >= count // 3:
                break
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, "*core/durable.py"), tracemalloc.Filter(True, "*core/filter_sets.py")])
        kept = sum(stat.size for stat in snapshot.statistics("filename"))
    finally:
        tracemalloc.stop()
    assert got == list(range(0, count, 3))
    assert kept < 30_000, f"{kept} bytes kept by the subscription after reading {count} topics"


def test_a_changed_filter_set_is_matched_at_once(journal: JournalStorage) -> None:
    """Redelivery and replay ask which filters match a topic: a filter added or removed counts
    from the next question on."""
    broker = reliable(journal)
    sub = broker.durable_subscription("changing")
    broker.add_filter(sub, "a/#")
    assert sub._filters_for("b/1") == ()
    broker.add_filter(sub, "b/+")
    assert sub._filters_for("b/1") == ("b/+",)
    broker.remove_filter(sub, "a/#")
    assert sub._filters_for("a/1") == ()
