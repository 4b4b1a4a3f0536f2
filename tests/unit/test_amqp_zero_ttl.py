"""Zero TTL on an AMQP queue, as RabbitMQ: a message with `expiration="0"` (or any message on a
queue with `x-message-ttl` 0) is delivered when the queue receives it if a consumer has room,
else it expires; how long ago it was published (the journal commit) does not matter."""

from __future__ import annotations

from typing import Any

import pytest
from shardgate.core.message import Message, now_ms
from shardgate.core.subscriptions import Subscription
from shardgate.protocols.amqp.queues import Queue, QueueConsumer, QueueEntry


class RecordingChannel:
    """A consumer's channel with a prefetch window, recording what it is handed."""

    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.delivered: list[bytes] = []

    def deliver(self, consumer: QueueConsumer, queue: Queue, entry: QueueEntry) -> None:
        self.delivered.append(entry.message.payload)

    def can_deliver(self, consumer: QueueConsumer) -> bool:
        return len(self.delivered) < self.prefetch


def make_queue(arguments: dict[str, Any]) -> tuple[Queue, list[tuple[bytes, str]]]:
    dead: list[tuple[bytes, str]] = []
    queue = Queue(
        "q", Subscription("amqp-queue-q"), durable=False, exclusive_owner=None,
        auto_delete=False, arguments=arguments,
        dead_letter=lambda q, entry, reason: dead.append((entry.message.payload, reason)),
    )
    return queue, dead


def committed_late(payload: bytes, expiration_ms: int | None) -> Message:
    """A message published 50 ms ago (its journal commit took that long)."""
    published = now_ms() - 50
    expires = None if expiration_ms is None else published + expiration_ms
    return Message("q", payload, expires_at_ms=expires, publish_time_ms=published)


ZERO_TTLS = [
    pytest.param({}, 0, id="expiration-0"),
    pytest.param({"x-message-ttl": 0}, None, id="x-message-ttl-0"),
    pytest.param({"x-message-ttl": 0}, 60_000, id="x-message-ttl-0-with-expiration"),
]


@pytest.mark.parametrize(("arguments", "expiration"), ZERO_TTLS)
def test_zero_ttl_message_goes_to_a_ready_consumer(arguments: dict[str, Any], expiration: int | None) -> None:
    queue, dead = make_queue(arguments)
    channel = RecordingChannel(prefetch=1)
    queue.add_consumer(QueueConsumer(channel, "c", queue, no_ack=True, exclusive=False, prefetch=1))
    queue.enqueue(committed_late(b"taken", expiration))
    assert channel.delivered == [b"taken"]
    assert dead == []
    # The consumer's prefetch window is full: the next one expires instead of waiting.
    queue.enqueue(committed_late(b"no room", expiration))
    assert channel.delivered == [b"taken"]
    assert dead == [(b"no room", "expired")]
    assert not queue.messages


@pytest.mark.parametrize(("arguments", "expiration"), ZERO_TTLS)
def test_zero_ttl_message_without_consumer_expires(arguments: dict[str, Any], expiration: int | None) -> None:
    queue, dead = make_queue(arguments)
    queue.enqueue(committed_late(b"gone", expiration))
    assert dead == [(b"gone", "expired")]
    assert not queue.messages
    # A consumer arriving afterwards does not get it.
    channel = RecordingChannel(prefetch=10)
    queue.add_consumer(QueueConsumer(channel, "c", queue, no_ack=True, exclusive=False, prefetch=10))
    queue.dispatch()
    assert channel.delivered == []


def test_redelivered_zero_expiration_message_keeps_its_publish_expiry() -> None:
    """A message handed out before a restart comes back with its expiry from the publish."""
    queue, dead = make_queue({})
    channel = RecordingChannel(prefetch=1)
    queue.add_consumer(QueueConsumer(channel, "c", queue, no_ack=True, exclusive=False, prefetch=1))
    queue.enqueue(committed_late(b"old", 0), redelivered=True)
    assert channel.delivered == []
    assert dead == [(b"old", "expired")]


def test_nonzero_expiration_still_counts_from_publish() -> None:
    queue, dead = make_queue({})
    channel = RecordingChannel(prefetch=1)
    queue.add_consumer(QueueConsumer(channel, "c", queue, no_ack=True, exclusive=False, prefetch=1))
    queue.enqueue(committed_late(b"late", 10))
    assert channel.delivered == []
    assert dead == [(b"late", "expired")]
