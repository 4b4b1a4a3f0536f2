"""Durable subscriptions on non-reliable shards (memory only, nothing to replay from): a
consumer is handed only what it has room for (credit, a window); the rest is held by the
subscription in order, bounded, the oldest dropped and counted past the bound; what a
leaving consumer held is given to the next one first."""

from __future__ import annotations

from shardgate.core.broker import Broker
from shardgate.core.durable import DurableOptions
from shardgate.core.message import Message
from shardgate.core.streams import StreamConfig
from shardgate.core.subscriptions import SubscriptionType
from shardgate.storage.memory import MemoryStorage

from tests.unit.recording_consumer import Consumer
from tests.unit.test_durable import payloads, settle


def memory_broker() -> Broker:
    return Broker(MemoryStorage(), StreamConfig("default", mode="non-reliable"))


def publish(broker: Broker, count: int, start: int = 0) -> None:
    for index in range(start, start + count):
        broker.publish(Message("t/a", str(index).encode()))


def numbers(count: int, start: int = 0) -> list[bytes]:
    return [str(i).encode() for i in range(start, start + count)]


async def test_a_consumer_gets_no_more_than_its_window_and_the_rest_in_order_as_it_acks():
    broker = memory_broker()
    sub = broker.durable_subscription("s")
    broker.add_filter(sub, "t/#")
    consumer = Consumer("c", window=3)
    broker.attach(sub, consumer)
    publish(broker, 10)
    assert payloads(consumer) == numbers(3)
    assert sub.held == 7
    for _ in range(4):
        consumer.ack_all()
        sub.wake()  # what a consumer does when it has room again
        await settle()
    assert payloads(consumer) == numbers(10)
    assert sub.held == 0
    assert broker.stats.messages_dropped == 0


async def test_past_the_bound_the_oldest_held_is_dropped_and_counted():
    broker = memory_broker()
    sub = broker.durable_subscription("s", options=DurableOptions(max_held=5))
    broker.add_filter(sub, "t/#")
    consumer = Consumer("c", window=2)
    broker.attach(sub, consumer)
    publish(broker, 10)
    assert payloads(consumer) == numbers(2)
    assert sub.held == 5
    assert broker.stats.dropped_by_reason["slow_subscriber"] == 3
    consumer.window = 100
    sub.wake()
    await settle()
    assert payloads(consumer) == numbers(2) + numbers(5, start=5)


async def test_a_failover_standby_gets_what_the_active_consumer_held_then_the_rest():
    broker = memory_broker()
    sub = broker.durable_subscription("s", SubscriptionType.FAILOVER)
    broker.add_filter(sub, "t/#")
    active, standby = Consumer("a", window=3), Consumer("b", window=100)
    broker.attach(sub, active)
    broker.attach(sub, standby)
    publish(broker, 10)
    assert payloads(active) == numbers(3) and payloads(standby) == []
    broker.detach(sub, active)
    for _subscription, message in active.unacked:  # given back, as a leaving consumer does
        sub.nack(message)
    await settle()
    assert payloads(standby) == numbers(10)
    assert broker.stats.messages_dropped == 0


async def test_nothing_is_lost_while_no_consumer_is_attached():
    broker = memory_broker()
    sub = broker.durable_subscription("s")
    broker.add_filter(sub, "t/#")
    publish(broker, 4)
    consumer = Consumer("c")
    broker.attach(sub, consumer)
    await settle()
    assert payloads(consumer) == numbers(4)

