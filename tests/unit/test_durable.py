"""Durable subscriptions on a real shard log (the memory engine keeping every record): replay,
hand-off to the live tail, acks, redelivery, dead letters, saved and restored cursors."""

from __future__ import annotations

import asyncio

import pytest
from shardgate.core.broker import Broker
from shardgate.core.durable import DurableOptions
from shardgate.core.message import Message
from shardgate.core.streams import StreamConfig
from shardgate.core.subscriptions import SubscriptionType
from shardgate.storage.memory import MemoryStorage

from tests.unit.recording_consumer import Consumer


class Sink:
    def __init__(self) -> None:
        self.saved: dict[tuple[str, str, int], tuple[int, bytes]] = {}

    def save_cursor(self, subscription, stream, shard, floor, state):
        self.saved[(subscription, stream, shard)] = (floor, state)

    def flush(self) -> None:
        pass


def reliable_broker() -> Broker:
    return Broker(MemoryStorage(max_records_per_shard=1_000_000),
                  StreamConfig("default", mode="reliable", partitions=2))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def payloads(consumer: Consumer) -> list[bytes]:
    return [m.payload for m in consumer.got]


async def test_offline_consumer_catches_up_from_the_log_then_goes_live():
    broker = reliable_broker()
    sub = broker.durable_subscription("s", initial_position="earliest")
    broker.add_filter(sub, "t/#")
    for index in range(10):
        broker.publish(Message("t/a", str(index).encode()))
    broker.publish(Message("other", b"x"))
    consumer = Consumer("c", auto_ack=True)
    broker.attach(sub, consumer)
    await settle()
    assert payloads(consumer) == [str(i).encode() for i in range(10)]
    broker.publish(Message("t/a", b"live"))
    assert payloads(consumer)[-1] == b"live"
    assert len(consumer.got) == 11  # no duplicate at the hand-off


async def test_window_full_falls_back_to_replay_without_gap_or_duplicate():
    broker = reliable_broker()
    sub = broker.durable_subscription("s")
    broker.add_filter(sub, "t")
    consumer = Consumer("c", window=3)
    broker.attach(sub, consumer)
    for index in range(20):
        broker.publish(Message("t", str(index).encode()))
    assert len(consumer.got) == 3
    while len(consumer.got) < 20:
        consumer.ack_all()
        await settle()
    consumer.ack_all()
    assert payloads(consumer) == [str(i).encode() for i in range(20)]
    assert sub.inflight_count() == 0


async def test_nack_redelivers_and_dead_letters_after_max_deliveries():
    broker = reliable_broker()
    sub = broker.durable_subscription("jobs", options=DurableOptions(max_deliveries=3))
    broker.add_filter(sub, "job")
    dlq = broker.subscription("dlq-watch")
    broker.add_filter(dlq, "$dlq/jobs")
    letters = Consumer("dlq", auto_ack=True)
    broker.attach(dlq, letters)
    consumer = Consumer("c")
    broker.attach(sub, consumer)
    broker.publish(Message("job", b"poison"))
    for _ in range(3):
        assert consumer.unacked
        subscription, message = consumer.unacked.pop()
        subscription.nack(message)
        await settle()
    assert len(consumer.got) == 3
    assert [m.payload for m in letters.got] == [b"poison"]
    headers = dict(letters.got[0].headers)
    assert headers["x-delivery-count"] == "3" and headers["x-original-topic"] == "job"


async def test_leaving_consumer_messages_go_to_the_others():
    broker = reliable_broker()
    sub = broker.durable_subscription("work", SubscriptionType.SHARED)
    broker.add_filter(sub, "w")
    a, b = Consumer("a"), Consumer("b")
    broker.attach(sub, a)
    broker.attach(sub, b)
    for index in range(4):
        broker.publish(Message("w", str(index).encode()))
    assert len(a.got) == 2 and len(b.got) == 2
    broker.detach(sub, a)
    await settle()
    assert sorted(payloads(b)) == [b"0", b"1", b"2", b"3"]
    assert [m.payload for m in b.got[2:]] == [m.payload for m in a.got]


async def test_ack_timeout_redelivers():
    broker = reliable_broker()
    sub = broker.durable_subscription("t", options=DurableOptions(ack_timeout_s=0.2))
    broker.add_filter(sub, "t")
    consumer = Consumer("c")
    broker.attach(sub, consumer)
    broker.publish(Message("t", b"slow"))
    for _ in range(100):
        if len(consumer.got) == 2:
            break
        await asyncio.sleep(0.02)
    assert payloads(consumer) == [b"slow", b"slow"]


async def test_saved_cursor_restores_unacked_and_position():
    storage = MemoryStorage(max_records_per_shard=1_000_000)
    sink = Sink()
    broker = Broker(storage, StreamConfig("default", mode="reliable"), cursor_sink=sink)
    sub = broker.durable_subscription("d")
    broker.add_filter(sub, "t")
    consumer = Consumer("c")
    broker.attach(sub, consumer)
    for index in range(5):
        broker.publish(Message("t", str(index).encode()))
    # ack 0, 1 and 3; 2 and 4 stay unacknowledged
    for subscription, message in list(consumer.unacked):
        if message.payload in (b"0", b"1", b"3"):
            subscription.ack(message)
    broker.save_cursors()
    broker.publish(Message("t", b"5"))  # published after the save: replayed too
    # A second broker on the same log, as after a restart.
    again = Broker(storage, StreamConfig("default", mode="reliable"))
    restored = again.durable_subscription("d")
    again.add_filter(restored, "t")
    for (_name, stream, shard), (_floor, state) in sink.saved.items():
        restored.restore_cursor(stream, shard, state)
    fresh = Consumer("c2", auto_ack=True)
    again.attach(restored, fresh)
    await settle()
    assert sorted(payloads(fresh)) == [b"2", b"4", b"5"]


async def test_seek_to_timestamp_and_offset():
    broker = reliable_broker()
    sub = broker.durable_subscription("s")
    broker.add_filter(sub, "#")
    first = Message("a", b"old", publish_time_ms=1000)
    broker.publish(first)
    broker.publish(Message("a", b"new", publish_time_ms=5000))
    consumer = Consumer("c", auto_ack=True)
    broker.attach(sub, consumer)
    sub.seek("timestamp", 4000)
    await settle()
    assert payloads(consumer) == [b"new"]
    sub.seek("earliest")
    await settle()
    assert payloads(consumer)[1:] == [b"old", b"new"]


def test_schema_refuses_a_payload_that_does_not_fit():
    from shardgate.core.errors import SchemaMismatch

    broker = Broker()
    broker.create_stream(StreamConfig("nums", schema="int64"), routes=["nums/#"])
    broker.create_stream(StreamConfig("docs", schema="json"), routes=["docs/#"])
    broker.publish(Message("nums/a", (5).to_bytes(8, "big")))
    with pytest.raises(SchemaMismatch, match="int64"):
        broker.publish(Message("nums/a", b"5"))
    with pytest.raises(SchemaMismatch, match="JSON"):
        broker.publish(Message("docs/a", b"{not json"))


async def test_a_cursor_far_behind_on_records_it_does_not_want_yields_between_turns() -> None:
    """A session resuming behind 20,000 records of other topics does not scan them all in one
    event-loop turn: other work (new connections, acks) runs in between."""
    from shardgate.core.durable import SCAN_BUDGET

    broker = Broker(MemoryStorage(max_records_per_shard=1_000_000), StreamConfig("default", mode="reliable"))
    sub = broker.durable_subscription("resuming", initial_position="earliest")
    broker.add_filter(sub, "want/#")
    for i in range(20_000):
        broker.publish(Message(f"other/{i % 50}", b"x"))
    broker.publish(Message("want/1", b"wanted"))
    consumer = Consumer("c", auto_ack=True)
    turns = 0
    other_work_ran = []

    def other_work() -> None:
        other_work_ran.append(turns)

    broker.attach(sub, consumer)
    cursor = sub.cursors[("default", 0)]
    while not consumer.got and turns < 100:
        before = cursor.position
        asyncio.get_running_loop().call_soon(other_work)
        await asyncio.sleep(0)
        turns += 1
        assert cursor.position - before <= SCAN_BUDGET + 256
    assert [m.payload for m in consumer.got] == [b"wanted"]
    assert turns >= 20_000 // (SCAN_BUDGET + 256)
    assert len(other_work_ran) == turns


async def test_a_consumer_with_a_small_window_does_not_make_the_replay_read_each_batch_again() -> None:
    """Replay reads a batch of records; when the consumer's window fills in the middle, the
    rest waits on the cursor for the next turn instead of being read (and decoded) again."""
    broker = Broker(MemoryStorage(max_records_per_shard=1_000_000), StreamConfig("default", mode="reliable"))
    shard = broker.stream("default").shards[0]
    reads: list[int] = []

    class CountingLog:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        def read(self, from_offset: int, max_records: int = 1000) -> list:
            reads.append(from_offset)
            return self.inner.read(from_offset, max_records)  # type: ignore[attr-defined]

    shard.log = CountingLog(shard.log)  # type: ignore[assignment]
    sub = broker.durable_subscription("slow", initial_position="earliest")
    broker.add_filter(sub, "t/#")
    for i in range(600):
        broker.publish(Message("t/1", b"%d" % i))
    consumer = Consumer("c", window=1)
    broker.attach(sub, consumer)
    for _ in range(2000):
        await asyncio.sleep(0)
        consumer.ack_all()
        if len(consumer.got) == 600:
            break
    assert [int(m.payload) for m in consumer.got] == list(range(600))
    assert len(reads) <= 600 // 256 + 3


def test_a_cursor_state_keeps_its_byte_layout_for_any_number_of_unacknowledged_offsets() -> None:
    """Saved cursor states (SQLite, etcd snapshots) are read back by every version: position
    and count, then each offset, little-endian; an AMQP queue's backlog can be tens of
    thousands of them."""
    import struct

    from shardgate.core.durable import decode_cursor_state, encode_cursor_state

    for unacked in ([], [5], list(range(1_000, 61_000, 2))):
        state = encode_cursor_state(61_000, unacked)
        assert state == struct.pack(f"<qI{len(unacked)}q", 61_000, len(unacked), *unacked)
        assert decode_cursor_state(state) == (61_000, unacked)
