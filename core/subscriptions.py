"""Subscriptions: named sets of topic filters with a type that decides who gets each message.

- Exclusive: one consumer at a time; a second one is refused.
- Shared: every message goes to one consumer, round-robin over those available.
- Failover: one active consumer (the first attached); standbys take over, in attach order,
  when it leaves.

An MQTT session's own subscriptions, an MQTT `$share/group/filter`, an AMQP queue and a gRPC
subscription are all `Subscription`s. Consumers are protocol objects implementing `Consumer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .errors import SubscriptionBusy

if TYPE_CHECKING:
    from .message import Message

T = TypeVar("T")


def round_robin(items: Sequence[T], start: int, available: Callable[[T], bool]) -> int | None:
    """The index of the first item, from `start` (modulo the length) on and wrapping around,
    that is `available`; None when none is. The one turn-taking rule of Shared subscriptions,
    durable ones and AMQP queues alike."""
    count = len(items)
    if not count:
        return None
    start %= count
    for step in range(count):
        index = (start + step) % count
        if available(items[index]):
            return index
    return None


def _is_available(consumer: Consumer) -> bool:
    return consumer.available


class SubscriptionType(StrEnum):
    EXCLUSIVE = "exclusive"
    SHARED = "shared"
    FAILOVER = "failover"


# As plain names for the per-message path: on CPython 3.11 reading a member off its Enum
# class costs about as much as a function call.
EXCLUSIVE, SHARED, FAILOVER = SubscriptionType.EXCLUSIVE, SubscriptionType.SHARED, SubscriptionType.FAILOVER


class Consumer(Protocol):
    """What a protocol adapter implements to receive messages from a subscription."""

    @property
    def consumer_id(self) -> str: ...

    @property
    def available(self) -> bool:
        """True when the consumer is connected and can take messages now."""

    def deliver(self, message: Message, subscription: Subscription, filters: Sequence[str]) -> None:
        """Take one message matched by `filters` of `subscription`. Must not block or await.

        When the client acknowledges it, the consumer calls `subscription.ack(message)` (or
        `nack`); for live-only subscriptions those calls cost nothing."""


class Subscription:
    __slots__ = ("name", "type", "durable", "filters", "consumers", "_next", "owner")

    def __init__(
        self,
        name: str,
        type: SubscriptionType = SubscriptionType.EXCLUSIVE,
        durable: bool = False,
        owner: Any = None,
    ) -> None:
        self.name = name
        self.type = SubscriptionType(type)
        self.durable = durable
        # Topic filter -> opaque options kept for the protocol that made the subscription.
        self.filters: dict[str, Any] = {}
        self.consumers: list[Consumer] = []
        self._next = 0
        self.owner = owner

    def __repr__(self) -> str:
        return f"Subscription({self.name!r}, {self.type.value}, filters={list(self.filters)})"

    def belongs_to(self, owner: Any) -> None:
        """`owner` (opaque to the core: an AMQP queue, say) is what this subscription feeds
        from now on; a protocol made the subscription first and its owner over it."""
        self.owner = owner

    def filters_changed(self) -> None:
        """Called by the broker after a filter was added to or removed from `filters`: drop
        anything made from the filters before."""

    def attach(self, consumer: Consumer) -> None:
        if consumer in self.consumers:
            return
        if self.type is SubscriptionType.EXCLUSIVE and self.consumers:
            raise SubscriptionBusy(
                f"subscription {self.name!r} is exclusive and already has a consumer"
            )
        self.consumers.append(consumer)

    def detach(self, consumer: Consumer) -> bool:
        try:
            self.consumers.remove(consumer)
        except ValueError:
            return False
        return True

    @property
    def active_consumer(self) -> Consumer | None:
        """For Exclusive and Failover: the consumer that receives messages."""
        return self.consumers[0] if self.consumers else None

    # Acknowledgement hooks: no-ops for live-only subscriptions; durable subscriptions
    # (core.durable) track cursors, redeliver and dead-letter with them.
    def ack(self, message: Message) -> None:
        """The consumer's client has processed `message`."""

    def nack(self, message: Message, delay_s: float = 0.0) -> None:
        """The consumer's client gives `message` back for redelivery after `delay_s`."""

    def wake(self) -> None:
        """A consumer became available again (reconnected, got credit): resume delivery."""

    def pick(self, shard: int = 0) -> Consumer | None:
        """The consumer that gets the next message (of `shard`), or None if there is none.

        Failover on a partitioned stream spreads the shards over the consumers in attach order
        (shard i goes to consumer i mod n), so each shard has one active consumer and the
        others stand by; when one leaves, its shards move to the next."""
        consumers = self.consumers
        if not consumers:
            return None
        if self.type is FAILOVER:
            return consumers[shard % len(consumers)]
        if self.type is not SHARED:
            return consumers[0]
        index = round_robin(consumers, self._next, _is_available)
        if index is None:
            # Nobody is available right now: hand it to the next in turn, which may queue it.
            index = self._next % len(consumers)
        self._next = index + 1
        return consumers[index]

    def pick_available(self, shard: int = 0) -> Consumer | None:
        """Like `pick`, but None rather than a consumer that cannot take a message now."""
        consumers = self.consumers
        if not consumers:
            return None
        if self.type is SHARED:
            index = round_robin(consumers, self._next, _is_available)
            if index is None:
                return None
            self._next = index + 1
            return consumers[index]
        chosen = self.pick(shard)
        return chosen if chosen is not None and chosen.available else None
