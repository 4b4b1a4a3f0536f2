"""What an AMQP queue holds and who takes from it: `QueueEntry` (a message waiting in, or
delivered from, a queue, with its place in the queue's order of arrival and its priority) and
`QueueConsumer` (one basic.consume registration, with its prefetch window and x-priority),
reached through its channel (`ConsumerChannel`). The queue itself (`queues.py`) orders, bounds,
expires and dispatches them. No I/O here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ...core.message import Message

if TYPE_CHECKING:
    from .queues import Queue


class QueueEntry:
    """A message waiting in (or delivered from) a queue; `position` is its place in the queue's
    order of arrival, which a requeued message goes back to."""

    __slots__ = ("message", "redelivered", "expires_at_ms", "position")

    def __init__(
        self, message: Message, expires_at_ms: int | None, redelivered: bool = False,
        position: int = 0,
    ) -> None:
        self.message = message
        self.expires_at_ms = expires_at_ms
        self.redelivered = redelivered
        self.position = position


def entry_position(entry: QueueEntry) -> int:
    return entry.position


def message_priority(message: Message) -> int:
    """The AMQP priority property of `message` (0 when it has none)."""
    for name, value in message.headers or ():
        if name == "amqp-priority":
            try:
                return max(0, int(value))
            except ValueError:
                return 0
    return 0


class ConsumerChannel(Protocol):
    """What a queue needs from the channel of one of its consumers."""

    def deliver(self, consumer: QueueConsumer, queue: Queue, entry: QueueEntry) -> None: ...

    def can_deliver(self, consumer: QueueConsumer) -> bool: ...


class QueueConsumer:
    """One basic.consume registration on a queue."""

    __slots__ = (
        "channel", "tag", "queue", "no_ack", "exclusive", "prefetch", "unacked", "priority",
    )

    def __init__(
        self, channel: ConsumerChannel, tag: str, queue: Queue, no_ack: bool, exclusive: bool,
        prefetch: int, priority: int = 0,
    ) -> None:
        self.channel = channel
        self.tag = tag
        self.queue = queue
        self.no_ack = no_ack
        self.exclusive = exclusive
        self.prefetch = prefetch
        self.unacked = 0
        # x-priority (https://www.rabbitmq.com/docs/consumer-priority): higher first, while
        # they have room; round-robin among equals.
        self.priority = priority

