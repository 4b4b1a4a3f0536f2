"""AMQP queues: each one is a core subscription whose single core consumer is the `Queue`.

The core hands the queue every message matching one of its bindings' filters; the queue checks
the bindings that need an exact check (headers exchanges, mid-key `#`), buffers the message in
memory (bounded by `x-max-length` / `x-max-length-bytes`: oldest dropped first, or the publish
refused with `x-overflow` reject-publish), in priority order with `x-max-priority`, expires it
at the head (`x-message-ttl`, per-message expiration; a TTL of 0 from its arrival in the
queue: delivered at once to a consumer with room, else expired) and hands it to its AMQP consumers
round-robin (highest `x-priority` first), each within its own and its channel's prefetch window
(`basic.qos`). With `x-single-active-consumer` only the first consumer receives; the next one
takes over when it cancels. A requeued message goes back to its original position. Rejected,
expired and overflowing messages go to the dead-letter exchange when one is set.

No I/O here: consumers are reached through their channel (`connection.AmqpChannel`). What a
queue holds and who consumes it (`QueueEntry`, `QueueConsumer`, `ConsumerChannel`) are in
`queue_entries.py`, importable from here as before.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ...core.durable import DurableSubscription
from ...core.message import Message, now_ms
from ...core.subscriptions import Subscription, round_robin
from .queue_entries import (
    ConsumerChannel,
    QueueConsumer,
    QueueEntry,
    entry_position,
    message_priority,
)
from .routing import Binding

__all__ = ["READY_LIMIT", "ConsumerChannel", "DeadLetter", "Queue", "QueueConsumer", "QueueEntry"]

# Messages a durable queue holds in memory; beyond that they wait in the journal.
READY_LIMIT = 100_000

# dead_letter(queue, entry, reason) is provided by the virtual host.
DeadLetter = Callable[["Queue", QueueEntry, str], None]


class Queue:
    """An AMQP queue; implements the core `Consumer` protocol for its subscription."""

    def __init__(
        self,
        name: str,
        subscription: Subscription,
        *,
        durable: bool,
        exclusive_owner: object | None,
        auto_delete: bool,
        arguments: dict[str, Any],
        dead_letter: DeadLetter,
    ) -> None:
        self.name = name
        self.subscription = subscription
        self.durable = durable
        self.exclusive_owner = exclusive_owner
        self.auto_delete = auto_delete
        self.arguments = arguments
        self.message_ttl: int | None = _int_arg(arguments, "x-message-ttl")
        self.expires: int | None = _int_arg(arguments, "x-expires")
        self.max_length: int | None = _int_arg(arguments, "x-max-length")
        self.max_length_bytes: int | None = _int_arg(arguments, "x-max-length-bytes")
        # x-overflow (https://www.rabbitmq.com/docs/maxlength): drop-head (default),
        # reject-publish (the publish is refused: nack in confirm mode), reject-publish-dlx.
        self.overflow = str(arguments.get("x-overflow") or "drop-head")
        # x-max-priority (https://www.rabbitmq.com/docs/priority): 1..255, higher first.
        max_priority = _int_arg(arguments, "x-max-priority")
        self.max_priority = max(0, min(255, max_priority)) if max_priority else 0
        # Set by the connection around a publish: called when this queue refuses it.
        self.on_publish_refused: Callable[[Message], None] | None = None
        dlx = arguments.get("x-dead-letter-exchange")
        self.dead_letter_exchange: str | None = None if dlx is None else str(dlx)
        dlrk = arguments.get("x-dead-letter-routing-key")
        self.dead_letter_routing_key: str | None = None if dlrk is None else str(dlrk)
        # The user who declared the queue: its dead-lettered messages are published as theirs
        # (the publish ACL decides on each dead-letter topic; None: an anonymous client).
        self.writer: str | None = None
        self.single_active = bool(arguments.get("x-single-active-consumer", False))
        self.messages: deque[QueueEntry] = deque()
        self.ready_bytes = 0  # payload bytes of `messages`, for the memory alarm
        self.consumers: list[QueueConsumer] = []
        self.bindings: dict[tuple[str, str, tuple[tuple[str, str], ...]], Binding] = {}
        # Bindings reached through exchange-to-exchange bindings (see `VirtualHost.rederive`),
        # keyed by the path they come from.
        self.derived: dict[tuple[Any, ...], Binding] = {}
        self.by_filter: dict[str, list[Binding]] = {}
        self.checked_filters = 0  # how many filters carry a binding with an exact check
        self._next = 0
        self.prioritized = False  # some consumer has an x-priority
        self._next_in: dict[int, int] = {}  # round-robin position per consumer priority
        self._arrivals = 0  # position of the next enqueued message
        # Set by the virtual host: called when a message with its own expiration is queued, so
        # the queue is swept even without x-message-ttl.
        self.on_timed_message: Callable[[Queue], None] | None = None
        self._dead_letter = dead_letter
        self._dispatching = False
        self.had_consumer = False
        self.last_used_ms = now_ms()
        self.deleted = False
        self.starved = False

    def __repr__(self) -> str:
        return f"Queue({self.name!r}, messages={len(self.messages)}, consumers={len(self.consumers)})"

    # ------------------------------------------------------------------ core Consumer
    @property
    def consumer_id(self) -> str:
        return self.subscription.name

    @property
    def available(self) -> bool:
        # A durable queue stops taking live messages when its buffer is full: the core's
        # durable subscription then keeps them in the journal and replays them on `wake`.
        if self.deleted:
            return False
        if self.subscription.durable and len(self.messages) >= READY_LIMIT:
            self.starved = True
            return False
        return True

    def settle(self, entry: QueueEntry) -> None:
        """`entry` left the queue for good (acked, dropped, dead-lettered, purged)."""
        self.subscription.ack(entry.message)

    def _refill(self) -> None:
        """A durable queue that refused live messages has room again: let the core replay."""
        if self.starved and len(self.messages) <= READY_LIMIT // 2:
            self.starved = False
            self.subscription.wake()

    def deliver(self, message: Message, subscription: Subscription, filters: Sequence[str]) -> None:
        if self.deleted:
            return
        if self.checked_filters and not self.accepts(message, filters):
            return
        # handed out again after a restart: redelivered, as RabbitMQ marks it (conservatively,
        # also what was still waiting in the queue then: nothing records which had reached a
        # consumer)
        redelivered = (subscription.durable and isinstance(subscription, DurableSubscription)
                       and subscription.handed_out_before(message))
        self.enqueue(message, redelivered)

    # ------------------------------------------------------------------ bindings
    def accepts(self, message: Message, filters: Iterable[str]) -> bool:
        """True if one of the bindings behind `filters` takes `message`."""
        by_filter = self.by_filter
        for topic_filter in filters:
            for binding in by_filter.get(topic_filter, ()):
                if binding.check is None or binding.check(message):
                    return True
        return False

    def unreadable(self, may_subscribe: Callable[[str], bool]) -> str | None:
        """The filter of a binding whose messages a reader who `may_subscribe` only to some
        filters may not have, or None: reading the queue reads what every binding brings, its
        own and those reached through exchange-to-exchange bindings (`derived`). The default
        exchange's binding brings what is sent to the queue by name, and is not checked."""
        for binding in (*self.bindings.values(), *self.derived.values()):
            if binding.exchange and not may_subscribe(binding.topic_filter):
                return str(binding.topic_filter)
        return None

    def add_binding(self, binding: Binding) -> bool:
        """Record `binding`; True if its filter is new to this queue (the core must add it)."""
        key = (binding.exchange, binding.routing_key, binding.arguments)
        if key in self.bindings:
            return False
        self.bindings[key] = binding
        return self._index(binding)

    def add_derived(self, key: tuple[Any, ...], binding: Binding) -> bool:
        """Record a binding reached through exchange bindings; True if its filter is new."""
        if key in self.derived:
            return False
        self.derived[key] = binding
        return self._index(binding)

    def remove_derived(self, key: tuple[Any, ...]) -> str | None:
        """Forget a derived binding; returns its filter if nothing else uses it."""
        binding = self.derived.pop(key, None)
        return None if binding is None else self._unindex(binding)

    def _index(self, binding: Binding) -> bool:
        same = self.by_filter.setdefault(binding.topic_filter, [])
        had_check = any(b.check is not None for b in same)
        same.append(binding)
        if not had_check and binding.check is not None:
            self.checked_filters += 1
        return len(same) == 1

    def remove_binding(self, key: tuple[str, str, tuple[tuple[str, str], ...]]) -> str | None:
        """Forget a binding; returns its filter if no binding uses that filter any more."""
        binding = self.bindings.pop(key, None)
        if binding is None:
            return None
        return self._unindex(binding)

    def _unindex(self, binding: Binding) -> str | None:
        same = self.by_filter.get(binding.topic_filter, [])
        had_check = any(b.check is not None for b in same)
        same.remove(binding)
        if had_check and not any(b.check is not None for b in same):
            self.checked_filters -= 1
        if not same:
            del self.by_filter[binding.topic_filter]
            return binding.topic_filter
        return None

    # ------------------------------------------------------------------ messages
    def enqueue(self, message: Message, redelivered: bool = False) -> None:
        """Buffer `message`; `redelivered` when it may have been delivered before (it comes
        back from the core after a restart)."""
        size = len(message.payload)
        if self.overflow != "drop-head" and self._full_for(size):
            self._refuse(message)
            return
        arrival = now_ms()
        expires = message.expires_at_ms
        # A TTL of 0 counts from the message's arrival here, whenever its publish was committed:
        # delivered now if a consumer can take it at once, else expired (RabbitMQ's
        # rabbit_amqqueue_process deliver_or_enqueue). Not for a message handed out before a
        # restart: its per-message expiry stays where the publish put it.
        zero_ttl = (self.message_ttl is not None and self.message_ttl <= 0) or (
            not redelivered and expires is not None and expires <= message.publish_time_ms
        )
        if zero_ttl:
            expires = arrival
        elif self.message_ttl is not None:
            by_queue = arrival + self.message_ttl
            expires = by_queue if expires is None else min(expires, by_queue)
        if self.message_ttl is None and expires is not None and self.on_timed_message is not None:
            self.on_timed_message(self)
        position = self._arrivals
        self._arrivals = position + 1
        if zero_ttl and self._deliver_on_arrival(message, arrival, redelivered, position):
            return
        if self.max_priority:
            # Higher priority first, arrival order within a priority: both in the position.
            position += (self.max_priority - min(message_priority(message), self.max_priority)) << 48
            entry = QueueEntry(message, expires, redelivered, position)
            messages = self.messages
            if messages and messages[-1].position > position:
                bisect.insort(messages, entry, key=entry_position)
            else:
                messages.append(entry)
        else:
            self.messages.append(QueueEntry(message, expires, redelivered, position))
        self.ready_bytes += size
        if self.max_length is not None:
            while len(self.messages) > self.max_length:
                self._dead_letter(self, self._pop(), "maxlen")
        if self.max_length_bytes is not None:
            while self.messages and self.ready_bytes > self.max_length_bytes:
                self._dead_letter(self, self._pop(), "maxlen")
        self.dispatch()
        if zero_ttl:
            self.expire(arrival)

    def _deliver_on_arrival(
        self, message: Message, arrival: int, redelivered: bool, position: int,
    ) -> bool:
        """Hand a zero-TTL message straight to a consumer with room, if nothing waits before
        it; False when it has to be queued (and so expires)."""
        if self.messages or self._dispatching or not self.consumers:
            return False
        consumer = self._next_consumer()
        if consumer is None:
            return False
        consumer.channel.deliver(consumer, self, QueueEntry(message, arrival, redelivered, position))
        return True

    def _full_for(self, size: int) -> bool:
        if self.max_length is not None and len(self.messages) >= self.max_length:
            return True
        return self.max_length_bytes is not None and self.ready_bytes + size > self.max_length_bytes

    def _refuse(self, message: Message) -> None:
        """x-overflow reject-publish(-dlx): the message does not enter this queue."""
        if self.on_publish_refused is not None:
            self.on_publish_refused(message)
        if self.overflow == "reject-publish-dlx":
            self._dead_letter(self, QueueEntry(message, None), "maxlen")
        else:
            self.subscription.ack(message)

    def _pop(self) -> QueueEntry:
        entry = self.messages.popleft()
        self.ready_bytes -= len(entry.message.payload)
        return entry

    def requeue(self, entries: Sequence[QueueEntry]) -> None:
        """Give delivered messages back to their original positions, marked redelivered.

        RabbitMQ: "When a message is requeued, it will be placed to its original position in
        its queue, if possible" (https://www.rabbitmq.com/docs/confirms, "Negative
        Acknowledgement and Requeuing of Deliveries"). Delivered messages are older than every
        ready one except those requeued before, so only the head is merged."""
        if self.deleted or not entries:
            return
        returning = sorted(entries, key=entry_position)
        messages = self.messages
        last = returning[-1].position
        older: list[QueueEntry] = []
        while messages and messages[0].position < last:
            older.append(messages.popleft())
        for entry in returning:
            entry.redelivered = True
            self.ready_bytes += len(entry.message.payload)
        merged = list(heapq.merge(older, returning, key=entry_position)) if older else returning
        messages.extendleft(reversed(merged))
        self.dispatch()

    def reject(self, entry: QueueEntry) -> None:
        """A consumer rejected `entry` without requeue: dead-letter it (or drop it)."""
        self._dead_letter(self, entry, "rejected")

    def take(self) -> QueueEntry | None:
        """The next unexpired message for basic.get, or None."""
        self.last_used_ms = now_ms()
        self.expire()
        entry = self._pop() if self.messages else None
        if self.starved:
            self._refill()
        return entry

    def purge(self) -> int:
        count = len(self.messages)
        entries = list(self.messages)
        self.messages.clear()
        self.ready_bytes = 0
        for entry in entries:
            self.settle(entry)
        if self.starved:
            self._refill()
        return count

    def forget_ready(self) -> int:
        """The subscription's cursors moved (an administrator's purge or replay): the ready
        messages are dropped without an acknowledgement, since the new position decides what
        comes (again); delivered, unacknowledged ones stay with their consumers."""
        count = len(self.messages)
        self.messages.clear()
        self.ready_bytes = 0
        self.starved = False
        return count

    def expire(self, at_ms: int | None = None) -> None:
        """Drop (dead-letter) expired messages from the head, as RabbitMQ does."""
        messages = self.messages
        if not messages:
            return
        now = at_ms if at_ms is not None else now_ms()
        while messages:
            expires = messages[0].expires_at_ms
            if expires is None or expires > now:
                break
            self._dead_letter(self, self._pop(), "expired")

    # ------------------------------------------------------------------ consumers
    def add_consumer(self, consumer: QueueConsumer) -> None:
        consumers = self.consumers
        if consumer.priority or self.prioritized:
            self.prioritized = True
            at = len(consumers)
            while at and consumers[at - 1].priority < consumer.priority:
                at -= 1
            consumers.insert(at, consumer)
        else:
            consumers.append(consumer)
        self.had_consumer = True
        self.last_used_ms = now_ms()

    def remove_consumer(self, consumer: QueueConsumer) -> None:
        try:
            self.consumers.remove(consumer)
        except ValueError:
            return
        self.last_used_ms = now_ms()

    @property
    def unused_and_disposable(self) -> bool:
        """An auto-delete queue whose last consumer went away."""
        return self.auto_delete and self.had_consumer and not self.consumers

    def _next_consumer(self) -> QueueConsumer | None:
        consumers = self.consumers
        if len(consumers) == 1:  # the common case: every rule below picks it if it has room
            only = consumers[0]
            return only if only.channel.can_deliver(only) else None
        if not consumers:
            return None
        if self.single_active:
            first = consumers[0]
            return first if first.channel.can_deliver(first) else None
        if self.prioritized:
            return self._next_by_priority()
        index = round_robin(consumers, self._next, _can_take)
        if index is None:
            return None
        self._next = index + 1
        return consumers[index]

    def _next_by_priority(self) -> QueueConsumer | None:
        """The next consumer of the highest priority that has room (consumers are kept sorted
        by priority, highest first), round-robin within that priority."""
        consumers = self.consumers
        group_start = 0
        while group_start < len(consumers):
            priority = consumers[group_start].priority
            group_end = group_start
            while group_end < len(consumers) and consumers[group_end].priority == priority:
                group_end += 1
            index = round_robin(consumers[group_start:group_end], self._next_in.get(priority, 0), _can_take)
            if index is not None:
                self._next_in[priority] = index + 1
                return consumers[group_start + index]
            group_start = group_end
        return None

    def dispatch(self) -> None:
        """Hand buffered messages to consumers with room for them."""
        if self._dispatching or self.deleted:
            return
        messages = self.messages
        if not messages or not self.consumers:
            return
        self._dispatching = True
        try:
            now = now_ms()
            while messages:
                consumer = self._next_consumer()
                if consumer is None:
                    break
                entry = messages.popleft()
                self.ready_bytes -= len(entry.message.payload)
                expires = entry.expires_at_ms
                if expires is not None and expires <= now:
                    # (A zero-TTL message reaches a ready consumer in `_deliver_on_arrival`.)
                    self._dead_letter(self, entry, "expired")
                    continue
                consumer.channel.deliver(consumer, self, entry)
        finally:
            self._dispatching = False
        if self.starved:
            self._refill()


def _can_take(consumer: QueueConsumer) -> bool:
    return consumer.channel.can_deliver(consumer)


def _int_arg(arguments: dict[str, Any], name: str) -> int | None:
    value = arguments.get(name)
    if value is None:
        return None
    return int(value)
