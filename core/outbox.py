"""One outbox policy for consumers that hand messages on to somewhere slower (a remote broker).

An `Outbox` holds what a consumer took from the core and has not handed on yet, in delivery
order, as `OutboxEntry`s. The policy, the same for every such consumer:

- **reliable messages are never dropped.** A message of a reliable stream has a journal offset
  and a cursor behind it: the consumer stops taking more (its `available` turns false) rather
  than dropping one, and a redelivery of an entry still waiting is ignored (deduplicated by
  stream, shard and offset).
- **other messages are bounded.** Past `max_queued` the oldest non-reliable entry is dropped.
- **every drop has a reason**, counted here (`drops`) and in the broker's statistics
  (`BrokerStats.drop`): "queue_full", and those the consumer reports with `skip` (e.g.
  "expired").
- **encode once.** An entry keeps the consumer's wire form (`encoded`) once built, so a resend
  after a reconnect does not encode it again.

`settle(entry)` removes an entry wherever it stands (a drop may have removed others meanwhile)
and acknowledges it to its subscription, which moves the cursor on.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

from .message import Message

if TYPE_CHECKING:
    from .broker import BrokerStats
    from .subscriptions import Subscription

# Drop reasons (`BrokerStats.drop`) of consumers that hold messages for a client or a remote.
QUEUE_FULL = "queue_full"
EXPIRED = "expired"
SLOW_SUBSCRIBER = "slow_subscriber"
# A client's queue at its byte bound (an MQTT session's `max_queued_bytes`).
QUEUE_BYTES = "queue_bytes"


@dataclass(slots=True, eq=False)
class OutboxEntry:
    """A message waiting in an outbox, the subscription to acknowledge it to, and its wire form
    once the consumer has built it."""

    message: Message
    subscription: Subscription
    reliable: bool
    encoded: object = None


class Outbox:
    """Messages taken from the core and not yet handed on, under the policy above."""

    __slots__ = ("entries", "max_queued", "drops", "_is_reliable", "_stats", "_on_drop",
                 "_waiting_offsets")

    def __init__(self, max_queued: int, is_reliable: Callable[[Message], bool],
                 stats: BrokerStats | None = None,
                 on_drop: Callable[[str, int], None] | None = None) -> None:
        self.entries: deque[OutboxEntry] = deque()
        self.max_queued = max_queued
        # Drops of this outbox by reason (the broker's statistics count them too).
        self.drops: Counter[str] = Counter()
        self._is_reliable = is_reliable
        self._stats = stats
        # Called with (reason, total drops of this outbox for that reason), e.g. to log.
        self._on_drop = on_drop
        self._waiting_offsets: set[tuple[str, int, int]] = set()

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[OutboxEntry]:
        return iter(self.entries)

    @property
    def dropped(self) -> int:
        return sum(self.drops.values())

    @property
    def unreliable(self) -> int:
        """Entries of non-reliable streams: nothing but this outbox holds them."""
        return sum(1 for entry in self.entries if not entry.reliable)

    def put(self, message: Message, subscription: Subscription) -> OutboxEntry | None:
        """Queue `message`; None when it is not queued: a redelivery of an entry still waiting,
        or a non-reliable message dropped because the outbox is full of reliable ones."""
        reliable = self._is_reliable(message)
        if reliable:
            key = (message.stream, message.shard, message.offset)
            if key in self._waiting_offsets:
                return None
            self._waiting_offsets.add(key)
        elif len(self.entries) >= self.max_queued:
            self.drop(QUEUE_FULL)
            for index, queued in enumerate(self.entries):
                if not queued.reliable:
                    del self.entries[index]
                    break
            else:  # nothing older to drop: this one goes
                subscription.ack(message)
                return None
        entry = OutboxEntry(message, subscription, reliable)
        self.entries.append(entry)
        return entry

    def head(self, count: int = 1) -> list[OutboxEntry]:
        """The first `count` entries, left in place until settled."""
        return list(islice(self.entries, count))

    def settle(self, entry: OutboxEntry) -> None:
        """`entry` was handed on (or skipped): remove it and acknowledge it to its subscription."""
        entries = self.entries
        if entries and entries[0] is entry:
            entries.popleft()
        else:
            for index, queued in enumerate(entries):
                if queued is entry:
                    del entries[index]
                    break
        if entry.reliable:
            message = entry.message
            self._waiting_offsets.discard((message.stream, message.shard, message.offset))
        entry.subscription.ack(entry.message)

    def skip(self, entry: OutboxEntry, reason: str) -> None:
        """`entry` is not handed on, for `reason` (counted): settle it all the same."""
        self.drop(reason)
        self.settle(entry)

    def drop(self, reason: str, count: int = 1) -> None:
        self.drops[reason] += count
        if self._stats is not None:
            self._stats.drop(reason, count)
        if self._on_drop is not None:
            self._on_drop(reason, self.drops[reason])
