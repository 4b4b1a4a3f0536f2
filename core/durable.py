"""Durable subscriptions: per-shard cursors, acknowledgements, redelivery and dead letters.

A durable subscription does not copy messages for consumers that are away or busy: it keeps,
per shard, a cursor — the next offset to deliver (`position`) and the offsets delivered but not
yet acknowledged (`unacked`). While a cursor is *live* the subscription takes messages from the
live dispatch; when no consumer can take one, the cursor falls behind and the subscription
later replays the shard's log from `position`, filtering by its topic filters, until it has
caught up and is live again (through the journal's key index when it has one: only the records
of the topics the filters can match are read, `core/index_keys.py`). Replay and live dispatch meet by offset: a live message below
`position` was already replayed and is dropped, so there is no gap and no duplicate.

Unacknowledged messages are redelivered when a consumer gives them back (nack), when their ack
timeout passes, or when their consumer leaves; after `max_deliveries` they go to the dead-letter
topic `$dlq/<subscription>`. Progress (position and unacked offsets) is saved through a
`CursorSink` in batches; on restart the subscription resumes from what was saved, so a message
acknowledged before the crash may at worst be delivered again (at-least-once), never lost.

The subscription is assembled from parts, one concern each: `core/durable_state.py` (the
per-shard cursor and its saved form), `core/durable_positions.py` (where cursors start and
move), `core/durable_replay.py` (reading logs into deliveries); this module holds the state,
the live path, acknowledgements, redelivery, dead letters, timers and saving.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .durable_positions import CursorPositions
from .durable_replay import (  # noqa: F401  (re-exported: tests and tools read them here)
    AHEAD_BYTES,
    DEADLINE_EVERY,
    REPLAY_BATCH,
    SCAN_BUDGET,
    ShardReplay,
)
from .durable_state import (  # noqa: F401  (re-exported: the durable subscription's public names)
    CursorSink,
    Delivery,
    DurableOptions,
    ShardCursor,
    decode_cursor_state,
    encode_cursor_state,
)
from .filter_sets import FilterSet
from .index_keys import any_may_match
from .message import Message, now_ms
from .outbox import SLOW_SUBSCRIBER
from .replay_turns import pump_queue
from .subscriptions import Consumer, Subscription, SubscriptionType

if TYPE_CHECKING:
    from .broker import Broker

log = logging.getLogger(__name__)

PUMP_BUDGET = 512
# Seconds between checks of the acknowledgement deadlines (a nack's delay has its own timer).
TIMER_S = 0.5
RESTORED_RETRY_S = 0.1
"""How soon a restored unacknowledged message that cannot be read yet is looked at again when
its log has no commit pending to wait on (see `_pump_restored`)."""


class DurableSubscription(CursorPositions, ShardReplay):
    __slots__ = (
        "broker", "options", "cursors", "_redeliver", "_delayed", "_pump_scheduled", "_dirty",
        "sink", "initial_position", "_filter_set", "_timer", "_timer_at", "_held", "_held_returned",
        "_key_cache", "_retry_armed",
    )

    def __init__(
        self,
        broker: Broker,
        name: str,
        type: SubscriptionType = SubscriptionType.EXCLUSIVE,
        options: DurableOptions | None = None,
        owner: object = None,
        initial_position: str | int = "latest",
        sink: CursorSink | None = None,
    ) -> None:
        super().__init__(name, type, durable=True, owner=owner)
        self.broker = broker
        self.options = options or DurableOptions()
        self.cursors: dict[tuple[str, int], ShardCursor] = {}
        self._redeliver: deque[tuple[ShardCursor, int]] = deque()
        self._delayed: list[tuple[float, int, str, int]] = []
        self._pump_scheduled = False
        self._dirty: set[tuple[str, int]] = set()
        self.sink = sink
        self.initial_position = initial_position
        # The filters compiled for matching topics (`core/filter_sets.py`), made when first
        # needed after a change of the filters.
        self._filter_set: FilterSet | None = None
        # Whether the filters can match a record of an index key (`core/index_keys.py`), for
        # replay reading through the journal's key index (keys are topic prefixes: few).
        self._key_cache: dict[bytes, bool] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # when `_timer` fires (monotonic)
        # Messages of non-reliable shards (no log to replay them from) waiting for a consumer
        # with room, oldest first: see `_hold`.
        self._held: deque[tuple[Message, tuple[str, ...]]] = deque()
        # How many of the first held were given back by a consumer (they go before the rest).
        self._held_returned = 0
        # A pump is due once a restored unacknowledged message can be read (`_pump_after_commit`).
        self._retry_armed = False

    def take_over(self, owner: object, options: DurableOptions) -> None:
        """`owner` holds this subscription from now on, with `options`: one restored from the
        store after a restart (its owner rebuilt from what was saved, or none) goes on as the
        subscription of the one that made it (a bridge's), as it asks for it again."""
        self.owner = owner
        self.options = options

    # ------------------------------------------------------------------ live path
    def offer(self, message: Message, filters: Sequence[str]) -> None:
        """A message dispatched live (after it was stored)."""
        key = (message.stream, message.shard)
        cursor = self.cursors.get(key)
        if cursor is None:
            stream = self.broker.streams.get(message.stream)
            shard_log = stream.shards[message.shard].log if stream is not None else None
            shard_log = self._replay_log(message.stream, message.shard, shard_log)
            cursor = ShardCursor(message.stream, message.shard, shard_log, message.offset)
            cursor.live = True
            self.cursors[key] = cursor
            # Saved at once: if this message is not delivered before a restart, the restored
            # subscription must still start here, not at the end of the shard.
            self._dirty.add(key)
        if cursor.log is None:
            # Non-reliable shard: nothing to replay from. A consumer with room takes it now;
            # otherwise it is held here (in order, bounded) until one has room: a consumer
            # without credit is never handed more than it asked for.
            if self.options.consumers_queue:
                consumer = self.pick(message.shard)
                if consumer is not None:
                    consumer.deliver(message, self, filters)
                return
            if not self._held:
                consumer = self.pick_available(message.shard)
                if consumer is not None:
                    consumer.deliver(message, self, filters)
                    return
            self._hold(message, tuple(filters))
            return
        if message.offset < cursor.position:
            return  # already delivered by replay
        if not cursor.live:
            self.schedule_pump()
            return
        consumer = self.pick_available(message.shard)
        if consumer is None:
            cursor.live = False
            return
        self._send(cursor, message, filters, consumer, 1)

    def _send(self, cursor: ShardCursor, message: Message, filters: Sequence[str],
              consumer: Consumer, count: int) -> None:
        if message.offset >= cursor.position:
            cursor.position = message.offset + 1
        if message.offset < cursor.resent_below and count == 1:
            count = 2
        timeout = self.options.ack_timeout_s
        deadline = time.monotonic() + timeout if timeout else None
        cursor.unacked[message.offset] = Delivery(message, consumer, count, deadline)
        self._dirty.add((cursor.stream, cursor.shard))
        if timeout and self._timer is None:
            self._arm_timer()
        consumer.deliver(message, self, filters)

    def forget_cached_matches(self) -> None:
        """Drop what was compiled or cached from the filters (made again on demand): memory
        back when idle."""
        self._filter_set = None
        self._key_cache = {}

    def filters_changed(self) -> None:
        self.forget_cached_matches()

    def _compiled_filters(self) -> FilterSet:
        filter_set = self._filter_set
        if filter_set is None:
            filter_set = self._filter_set = FilterSet(self.filters)
        return filter_set

    def _wants_key(self, key: bytes) -> bool:
        """Whether a record of index key `key` may match the filters (the journal's key index
        asks this of each key of a segment)."""
        wanted = self._key_cache.get(key)
        if wanted is None:
            wanted = any_may_match(self._compiled_filters().filters, key)
            if len(self._key_cache) > 10_000:
                self._key_cache.clear()
            self._key_cache[key] = wanted
        return wanted

    def _filters_for(self, topic: str) -> tuple[str, ...]:
        return self._compiled_filters().matching_name(topic)

    # ------------------------------------------------------------------ acknowledgements
    def handed_out_before(self, message: Message) -> bool:
        """Whether `message` is being handed out again (unacknowledged before a restart, nacked,
        or timed out): protocols mark such a delivery (MQTT DUP, AMQP redelivered)."""
        cursor = self.cursors.get((message.stream, message.shard))
        delivery = cursor.unacked.get(message.offset) if cursor is not None else None
        return delivery is not None and delivery.count > 1

    def redeliveries(self, message: Message) -> int:
        """How many times `message` was handed out before this delivery (0 the first time)."""
        cursor = self.cursors.get((message.stream, message.shard))
        delivery = cursor.unacked.get(message.offset) if cursor is not None else None
        return max(0, delivery.count - 1) if delivery is not None else 0

    def ack(self, message: Message) -> None:
        cursor = self.cursors.get((message.stream, message.shard))
        if cursor is None:
            return
        if cursor.unacked.pop(message.offset, None) is not None:
            self._dirty.add((cursor.stream, cursor.shard))
            if not cursor.live or self._redeliver:
                self.schedule_pump()

    def nack(self, message: Message, delay_s: float = 0.0) -> None:
        cursor = self.cursors.get((message.stream, message.shard))
        if cursor is not None and cursor.log is None and not self.options.consumers_queue:
            # A message of a non-reliable shard given back (nacked, or its consumer left with
            # it unacknowledged or still queued): held for the next consumer with room.
            self._hold(message, self._filters_for(message.topic) or tuple(self.filters),
                       returned=True)
            self.schedule_pump()
            return
        if cursor is None or message.offset not in cursor.unacked:
            return
        delivery = cursor.unacked[message.offset]
        delivery.consumer = None
        delivery.deadline = None
        if delay_s > 0:
            due = time.monotonic() + delay_s
            heapq.heappush(self._delayed, (due, message.offset, cursor.stream, cursor.shard))
            self._arm_timer(due)
        else:
            self._redeliver.append((cursor, message.offset))
            self.schedule_pump()

    def detach(self, consumer: Consumer) -> bool:
        removed = super().detach(consumer)
        if removed and self._held:
            self.schedule_pump()  # the consumer that now takes over may have room
        if removed and self.options.redeliver_on_leave:
            for cursor in self.cursors.values():
                for offset, delivery in cursor.unacked.items():
                    if delivery.consumer is consumer:
                        delivery.consumer = None
                        self._redeliver.append((cursor, offset))
            if self._redeliver:
                self.schedule_pump()
        return removed

    def wake(self) -> None:
        self.schedule_pump()

    # ------------------------------------------------------------------ replay
    def schedule_pump(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            try:
                pump_queue(asyncio.get_running_loop()).add(self)
            except RuntimeError:
                self._pump_scheduled = False

    def _pump(self, deadline: float = math.inf) -> None:
        """Replay within `PUMP_BUDGET` messages, and until `perf_counter()` passes `deadline`
        (the turn's replay time: one subscription replaying large messages must not hold the
        loop for tens of milliseconds); what is left waits for a later turn."""
        self._pump_scheduled = False
        budget = PUMP_BUDGET
        if self._held:
            budget = self._pump_held(budget)
        budget = self._pump_redeliveries(budget)
        if budget <= 0:
            self.schedule_pump()
            return
        for cursor in list(self.cursors.values()):
            if not cursor.placed:
                continue  # restored in a cluster, waiting for the shard map (`place_restored`)
            if cursor.pending_redelivery:
                budget = self._pump_restored(cursor, budget)
            if not cursor.live and budget > 0:
                budget = self._pump_cursor(cursor, budget, deadline)
            if budget <= 0:
                self.schedule_pump()
                return

    def _pump_after_commit(self, cursor: ShardCursor) -> None:
        """Pump again once the cursor's log has committed what it holds; where no commit is
        pending (a replicated shard between two leaderships), a moment later."""
        assert cursor.log is not None
        if self._retry_armed:
            return
        self._retry_armed = True
        waiter = cursor.log.commit_waiter()
        if waiter is not None and not waiter.done():
            waiter.add_done_callback(lambda _: self._retry())
        else:
            asyncio.get_running_loop().call_later(RESTORED_RETRY_S, self._retry)

    def _retry(self) -> None:
        self._retry_armed = False
        self.schedule_pump()

    def _hold(self, message: Message, filters: tuple[str, ...], returned: bool = False) -> None:
        """Keep a message of a non-reliable shard until a consumer has room; past
        `options.max_held` the oldest held is dropped and counted (as a slow subscriber's
        QoS 0 overflow is)."""
        held = self._held
        if returned:
            # Given back (in the order the consumer had them): before anything newer.
            held.insert(self._held_returned, (message, filters))
            self._held_returned += 1
        else:
            held.append((message, filters))
        if len(held) > self.options.max_held:
            self._take_held()
            self.broker.stats.drop(SLOW_SUBSCRIBER)

    def _take_held(self) -> tuple[Message, tuple[str, ...]]:
        if self._held_returned:
            self._held_returned -= 1
        return self._held.popleft()

    @property
    def held(self) -> int:
        """Messages of non-reliable shards waiting for a consumer with room."""
        return len(self._held)

    def _pump_held(self, budget: int) -> int:
        held = self._held
        now = now_ms()
        while held and budget > 0:
            message, filters = held[0]
            if message.expires_at_ms is not None and message.expires_at_ms <= now:
                self._take_held()
                continue
            consumer = self.pick_available(message.shard)
            if consumer is None:
                return budget
            self._take_held()
            consumer.deliver(message, self, filters)
            budget -= 1
        if held:
            self.schedule_pump()
        return budget

    def _pump_redeliveries(self, budget: int) -> int:
        max_deliveries = self.options.max_deliveries
        while self._redeliver and budget > 0:
            cursor, offset = self._redeliver[0]
            delivery = cursor.unacked.get(offset)
            if delivery is None or delivery.consumer is not None:
                self._redeliver.popleft()
                continue
            if max_deliveries and delivery.count >= max_deliveries:
                self._redeliver.popleft()
                self._dead_letter(cursor, delivery)
                continue
            consumer = self.pick_available(cursor.shard)
            if consumer is None:
                return budget
            self._redeliver.popleft()
            filters = self._filters_for(delivery.message.topic) or tuple(self.filters)
            self._send(cursor, delivery.message, filters, consumer, delivery.count + 1)
            budget -= 1
        return budget

    def _dead_letter(self, cursor: ShardCursor, delivery: Delivery) -> None:
        cursor.unacked.pop(delivery.message.offset, None)
        self._dirty.add((cursor.stream, cursor.shard))
        original = delivery.message
        headers = list(original.headers or [])
        headers += [("x-dead-letter-subscription", self.name), ("x-original-topic", original.topic),
                    ("x-delivery-count", str(delivery.count))]
        letter = Message(
            f"$dlq/{self.name}", original.payload, original.qos, False, original.key, headers,
            original.content_type, original.correlation_data, original.reply_to, original.payload_format,
            None, producer_protocol="dlq", producer_id=self.name,
        )
        log.info("subscription %s: %s@%d dead-lettered after %d deliveries", self.name,
                 original.topic, original.offset, delivery.count)
        try:
            self.broker.publish(letter)
        except Exception:
            log.exception("subscription %s: dead letter could not be published", self.name)

    # ------------------------------------------------------------------ timers and saving
    def _arm_timer(self, due: float | None = None) -> None:
        """Check ack deadlines every `TIMER_S`, and wake at `due` (a nack's delay ends: it is
        redelivered then, not at the next tick)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        now = time.monotonic()
        when = now + TIMER_S
        if self._delayed:
            when = min(when, self._delayed[0][0])
        if due is not None:
            when = min(when, due)
        if self._timer is not None:
            if self._timer_at <= when:
                return
            self._timer.cancel()
        self._timer_at = when
        self._timer = loop.call_later(max(0.0, when - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        now = time.monotonic()
        due = False
        while self._delayed and self._delayed[0][0] <= now:
            _, offset, stream, shard = heapq.heappop(self._delayed)
            cursor = self.cursors.get((stream, shard))
            if cursor is not None and offset in cursor.unacked:
                self._redeliver.append((cursor, offset))
                due = True
        if self.options.ack_timeout_s:
            for cursor in self.cursors.values():
                for offset, delivery in cursor.unacked.items():
                    if delivery.deadline is not None and delivery.deadline <= now and delivery.consumer is not None:
                        delivery.consumer = None
                        delivery.deadline = None
                        self._redeliver.append((cursor, offset))
                        due = True
        if due:
            self.schedule_pump()
        if self._delayed or any(c.unacked for c in self.cursors.values()):
            self._arm_timer()

    def save(self) -> None:
        """Hand changed cursors to the sink."""
        if self.sink is None or not self._dirty:
            self._dirty.clear()
            return
        dirty, self._dirty = self._dirty, set()
        for key in dirty:
            cursor = self.cursors.get(key)
            if cursor is None:
                continue
            pending = cursor.pending_redelivery
            # (offsets enter `unacked` in order, which sorting a list of them finds in one pass)
            unacked = sorted(set(cursor.unacked).union(pending)) if pending else sorted(cursor.unacked)
            state = encode_cursor_state(cursor.position, unacked)
            self.sink.save_cursor(self.name, cursor.stream, cursor.shard, cursor.floor, state)

    def close(self) -> None:
        """The subscription is removed: stop its timer and forget what it handed out. Its
        deliveries hold their consumers (an MQTT session holds the subscription back), so
        keeping them would leave the session and its messages in a cycle until a full
        collection of the cycle collector, while the heap grows around them."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for cursor in self.cursors.values():
            cursor.unacked.clear()
        self._redeliver.clear()
        self._delayed.clear()


def is_durable(subscription: Subscription) -> bool:
    return isinstance(subscription, DurableSubscription)


OnDeliver = Callable[[Message], None]
