"""The core broker without any protocol: routing to streams and shards, and dispatch by
subscription type."""

from __future__ import annotations

import pytest
from shardgate.core.broker import Broker
from shardgate.core.errors import StreamExists, StreamNotFound, SubscriptionBusy
from shardgate.core.message import Message
from shardgate.core.streams import InvalidStreamConfig, RoutingRule, StreamConfig
from shardgate.core.subscriptions import SubscriptionType


class Recorder:
    def __init__(self, name: str, available: bool = True) -> None:
        self.consumer_id = name
        self.available = available
        self.got: list[tuple[str, tuple[str, ...]]] = []

    def deliver(self, message, subscription, filters):
        self.got.append((message.topic, tuple(filters)))


def test_exclusive_subscription_refuses_second_consumer():
    broker = Broker()
    sub = broker.subscription("s", SubscriptionType.EXCLUSIVE)
    broker.attach(sub, Recorder("a"))
    with pytest.raises(SubscriptionBusy):
        broker.attach(sub, Recorder("b"))


def test_shared_round_robin_skips_unavailable():
    broker = Broker()
    sub = broker.subscription("s", SubscriptionType.SHARED)
    broker.add_filter(sub, "jobs/#")
    a, b, c = Recorder("a"), Recorder("b", available=False), Recorder("c")
    for consumer in (a, b, c):
        broker.attach(sub, consumer)
    for index in range(6):
        broker.publish(Message(f"jobs/{index}", b""))
    assert len(a.got) == 3 and len(c.got) == 3 and not b.got


def test_failover_standby_takes_over():
    broker = Broker()
    sub = broker.subscription("s", SubscriptionType.FAILOVER)
    broker.add_filter(sub, "t")
    active, standby = Recorder("a"), Recorder("b")
    broker.attach(sub, active)
    broker.attach(sub, standby)
    broker.publish(Message("t", b"1"))
    broker.detach(sub, active)
    broker.publish(Message("t", b"2"))
    assert len(active.got) == 1 and len(standby.got) == 1


def test_overlapping_filters_deliver_once_with_all_matches():
    broker = Broker()
    sub = broker.subscription("s")
    broker.add_filter(sub, "a/+")
    broker.add_filter(sub, "a/#")
    consumer = Recorder("c")
    broker.attach(sub, consumer)
    broker.publish(Message("a/b", b""))
    assert len(consumer.got) == 1
    assert sorted(consumer.got[0][1]) == ["a/#", "a/+"]


def test_match_cache_invalidated_by_unsubscribe():
    broker = Broker()
    sub = broker.subscription("s")
    broker.add_filter(sub, "x")
    consumer = Recorder("c")
    broker.attach(sub, consumer)
    broker.publish(Message("x", b""))
    broker.remove_filter(sub, "x")
    broker.publish(Message("x", b""))
    assert len(consumer.got) == 1


def test_routing_rules_pick_most_specific_stream_and_stable_shard():
    broker = Broker(default_stream=StreamConfig("default", partitions=2))
    broker.create_stream(StreamConfig("sensors", partitions=8), routes=["sensors/#"])
    broker.create_stream(StreamConfig("hot", partitions=1), routes=["sensors/hot/+"])
    first = Message("sensors/a", b"")
    broker.publish(first)
    again = Message("sensors/a", b"")
    broker.publish(again)
    hot = Message("sensors/hot/1", b"")
    broker.publish(hot)
    other = Message("misc", b"")
    broker.publish(other)
    assert (first.stream, hot.stream, other.stream) == ("sensors", "hot", "default")
    assert first.shard == again.shard  # a topic keeps its shard, so its order
    assert again.offset == first.offset + 1


def test_keyed_messages_choose_shard_by_key():
    broker = Broker(default_stream=StreamConfig("default", partitions=16))
    shards = set()
    for _ in range(50):
        message = Message("t", b"", key=b"device-7")
        broker.publish(message)
        shards.add(message.shard)
    assert len(shards) == 1


def test_stream_name_validation_and_duplicates():
    broker = Broker()
    with pytest.raises(InvalidStreamConfig):
        StreamConfig("bad/name")
    with pytest.raises(StreamExists):
        broker.create_stream(StreamConfig("default"))
    with pytest.raises(StreamNotFound):
        broker.add_route(RoutingRule("x/#", "missing"))


def test_retained_messages_set_and_cleared():
    broker = Broker()
    broker.publish(Message("r/1", b"on", retain=True))
    broker.publish(Message("r/2", b"off", retain=True))
    assert sorted(m.payload for m in broker.retained.match("r/+")) == [b"off", b"on"]
    broker.publish(Message("r/1", b"", retain=True))
    assert [m.payload for m in broker.retained.match("r/#")] == [b"off"]


def test_failover_per_partition_spreads_shards_and_moves_them_when_one_leaves():
    broker = Broker(default_stream=StreamConfig("default", partitions=4))
    sub = broker.subscription("f", SubscriptionType.FAILOVER)
    broker.add_filter(sub, "#")
    a, b = Recorder("a"), Recorder("b")
    broker.attach(sub, a)
    broker.attach(sub, b)
    topics_by_shard: dict[int, str] = {}
    index = 0
    while len(topics_by_shard) < 4:
        message = Message(f"t/{index}", b"")
        broker.publish(message)
        topics_by_shard.setdefault(message.shard, message.topic)
        index += 1
    a.got.clear()
    b.got.clear()
    for _, topic in sorted(topics_by_shard.items()):
        broker.publish(Message(topic, b""))
    assert sorted(t for t, _ in a.got) == sorted(topics_by_shard[s] for s in (0, 2))
    assert sorted(t for t, _ in b.got) == sorted(topics_by_shard[s] for s in (1, 3))
    broker.detach(sub, a)
    b.got.clear()
    for topic in topics_by_shard.values():
        broker.publish(Message(topic, b""))
    assert len(b.got) == 4  # the standby took over every shard


def test_dispatch_all_follows_subscription_changes_within_a_run():
    """A commit group is dispatched with one subscription lookup per run of one topic; a
    delivery that changes the subscriptions (a subscriber removed while it is served) is
    seen by the next message of the run, as separate dispatches would see it."""
    broker = Broker()
    leaving = broker.subscription("leaving")
    staying = broker.subscription("staying")
    broker.add_filter(leaving, "t/+")
    broker.add_filter(staying, "t/+")

    class LeavesAfterTwo(Recorder):
        def deliver(self, message, subscription, filters):
            super().deliver(message, subscription, filters)
            if len(self.got) == 2:
                broker.remove_filter(leaving, "t/+")

    gone, kept = LeavesAfterTwo("gone"), Recorder("kept")
    broker.attach(leaving, gone)
    broker.attach(staying, kept)
    messages = [Message(topic, b"") for topic in ("t/a", "t/a", "t/a", "t/b", "t/a", "u")]
    broker.dispatch_all(messages)
    assert [topic for topic, _ in gone.got] == ["t/a", "t/a"]
    assert [topic for topic, _ in kept.got] == ["t/a", "t/a", "t/a", "t/b", "t/a"]
    assert broker.stats.messages_without_subscriber == 1
