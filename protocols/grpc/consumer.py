"""One gRPC consumer stream as a core `Consumer`: credit window, pending queue, unacked deliveries.

The core calls `deliver` on the hot path; it only appends to a deque and wakes the stream's
writer, which turns pending messages into `MessageBatch`es while the client has credit. Each
pushed message gets a delivery id, kept until the client acks or nacks it.

Durability seam: for a durable subscription the core owns redelivery (cursors), so acks, nacks
and the unacked messages of a consumer that leaves go to `subscription.ack/nack`. For a live
subscription this module redelivers itself: a nacked message, and every unacked or pending
message of a consumer that leaves, is handed to the subscription's next consumer (`pick`).

No sockets and no awaits here: `server.py` drives it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...core.durable import DurableSubscription
from ...core.edge import KICK_REASON
from ...core.message import Message, now_ms
from ...core.subscriptions import Subscription, SubscriptionType
from ...proto import shardgate_pb2 as pb

_consumer_ids = itertools.count(1)
# The status message of a stream the admin API disconnected (status UNAVAILABLE).


@dataclass(slots=True)
class GrpcSubscriptionState:
    """Kept as the `owner` of subscriptions the gRPC API created."""

    # Set when the subscription follows a stream instead of topic filters: messages that
    # matched the filters but were stored in another stream are skipped.
    stream: str | None = None
    created_at: float = field(default_factory=lambda: now_ms() / 1000)
    # A non-durable subscription that asked for a start position (earliest, an offset, a
    # time): it replays through cursors (archive, journal, live tail) like a durable one, but
    # nothing of it is saved and it ends when its last consumer leaves.
    transient: bool = False
    # Durable: deliveries before a message goes to `$dlq/<subscription>` (0: never).
    max_deliveries: int = 0

    # The kind under which a saved subscription finds its owner again after a restart
    # (`Edge.owner_factories`).
    OWNER_KIND = "grpc"

    def saved_options(self) -> dict[str, object]:
        """What a restart needs to rebuild this owner (saved with the subscription)."""
        return {"protocol": self.OWNER_KIND, "stream": self.stream,
                "max_deliveries": self.max_deliveries}

    @classmethod
    def restored(cls, options: Mapping[str, object]) -> GrpcSubscriptionState:
        stream = options.get("stream")
        limit = options.get("max_deliveries")
        return cls(stream=stream if isinstance(stream, str) else None,
                   max_deliveries=limit if isinstance(limit, int) and limit > 0 else 0)


def add_consumed(messages: Any, message: Message, delivery_id: int,
                 redeliveries: int) -> pb.ConsumedMessage:
    """Append the wire form of `message` for one delivery to a repeated `ConsumedMessage` field.

    `add()` builds the message in place: constructing a `ConsumedMessage` and appending it would
    copy it (twice as slow on the push path)."""
    out = messages.add(
        delivery_id=delivery_id,
        topic=message.topic,
        payload=message.payload,
        publish_time_ms=message.publish_time_ms,
        stream=message.stream,
        shard=message.shard,
        offset=message.offset if message.offset > 0 else 0,
        producer_protocol=message.producer_protocol,
        producer_id=message.producer_id,
        redelivery_count=redeliveries,
    )
    if message.key is not None:
        out.key = message.key
    if message.headers:
        out.headers.extend(pb.Header(key=k, value=v) for k, v in message.headers)
    if message.content_type:
        out.content_type = message.content_type
    if message.correlation_data:
        out.correlation_data = message.correlation_data
    if message.reply_to:
        out.reply_to = message.reply_to
    if message.expires_at_ms is not None:
        out.expires_at_ms = message.expires_at_ms
    return out


def to_consumed(message: Message, delivery_id: int, redeliveries: int) -> pb.ConsumedMessage:
    """The wire form of `message` for one delivery."""
    return add_consumed(pb.MessageBatch().messages, message, delivery_id, redeliveries)


class GrpcConsumer:
    """Implements the core's `Consumer` protocol for one `Consumer.Subscribe` stream."""

    def __init__(
        self,
        subscription: Subscription,
        name: str,
        peer: str,
        *,
        credit: int,
        max_pending: int,
        max_batch: int,
        on_drop: Callable[[int], None] | None = None,
        on_sent: Callable[[str, Message], None] | None = None,
    ) -> None:
        self.subscription = subscription
        # Told of every message pushed to the client (the broker's delivery counters).
        self._on_sent = on_sent
        self.id = f"grpc-{next(_consumer_ids)}" + (f"-{name}" if name else "")
        self.name = name
        self.peer = peer
        self.connected_at = now_ms() / 1000
        self.credit = credit
        self.max_pending = max_pending
        self.max_batch = max_batch
        self.closed = False
        # Set by `kick`: the stream ends with UNAVAILABLE and this message.
        self.kicked: str | None = None
        # The user the stream authenticated as (None: anonymous), whose rights it reads with.
        self.user: str | None = None
        # Set by `deny`: the stream ends with PERMISSION_DENIED and this message.
        self.denied: str | None = None
        self.delivered = 0
        self.acked = 0
        self._on_drop = on_drop
        self._pending: deque[tuple[Message, int]] = deque()
        self._unacked: dict[int, tuple[Message, int]] = {}
        self._delivery_ids = itertools.count(1)
        self._timers: dict[asyncio.TimerHandle, tuple[Message, int]] = {}
        self.errors: list[pb.ConsumeError] = []
        self.wakeup = asyncio.Event()
        state = subscription.owner
        self._stream = state.stream if isinstance(state, GrpcSubscriptionState) else None

    def __repr__(self) -> str:
        return f"GrpcConsumer({self.id!r}, {self.subscription.name!r})"

    # ---------------------------------------------------------------- the core's Consumer protocol
    @property
    def consumer_id(self) -> str:
        return self.id

    @property
    def available(self) -> bool:
        return not self.closed and self.credit > len(self._pending)

    def deliver(self, message: Message, subscription: Subscription, filters: Sequence[str]) -> None:
        if self._stream is not None and message.stream != self._stream:
            return
        # a durable subscription counts its own deliveries (nacks, ack timeouts, restarts)
        self.enqueue(message, subscription.redeliveries(message)
                     if isinstance(subscription, DurableSubscription) else 0)

    # ---------------------------------------------------------------- queueing
    def enqueue(self, message: Message, redeliveries: int) -> None:
        pending = self._pending
        pending.append((message, redeliveries))
        if len(pending) > self.max_pending:
            pending.popleft()
            if self._on_drop is not None:
                self._on_drop(1)
        if self.credit > 0:
            self.wakeup.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    @property
    def active(self) -> bool:
        """False for a Failover (or Exclusive) standby: it gets nothing until promoted."""
        if self.subscription.type is SubscriptionType.SHARED:
            return True
        return self.subscription.active_consumer is self

    def take_batch(self) -> pb.ConsumeResponse | None:
        """Pending messages the credit allows, as one `ConsumeResponse` carrying a batch (None if
        there is nothing to send)."""
        if not self._pending or self.credit <= 0:
            return None
        response = pb.ConsumeResponse()
        out = response.messages.messages
        pending, unacked = self._pending, self._unacked
        count = min(self.credit, self.max_batch, len(pending))
        now = now_ms()
        delivery_ids = self._delivery_ids
        popleft = pending.popleft
        on_sent = self._on_sent
        sent = 0
        for _ in range(count):
            entry = popleft()
            message = entry[0]
            if message.expires_at_ms is not None and message.expires_at_ms <= now:
                continue
            delivery_id = next(delivery_ids)
            unacked[delivery_id] = entry
            add_consumed(out, message, delivery_id, entry[1])
            sent += 1
            if on_sent is not None:
                on_sent("grpc", message)
        self.credit -= sent
        self.delivered += sent
        return response if sent else None

    # ---------------------------------------------------------------- client requests
    def add_credit(self, credit: int) -> None:
        self.credit += credit
        if credit > 0:
            self.subscription.wake()
            if self._pending:
                self.wakeup.set()

    def ack(self, delivery_ids: Iterable[int]) -> list[int]:
        """Acknowledge deliveries; returns the ids this stream never delivered (or already acked)."""
        unknown = []
        sub = self.subscription
        for delivery_id in delivery_ids:
            entry = self._unacked.pop(delivery_id, None)
            if entry is None:
                unknown.append(delivery_id)
                continue
            self.acked += 1
            sub.ack(entry[0])
        return unknown

    def nack(self, delivery_ids: Iterable[int], delay_ms: int) -> list[int]:
        """Give deliveries back for redelivery after `delay_ms`; returns the unknown ids."""
        unknown = []
        for delivery_id in delivery_ids:
            entry = self._unacked.pop(delivery_id, None)
            if entry is None:
                unknown.append(delivery_id)
                continue
            message, redeliveries = entry
            if self.subscription.durable:
                self.subscription.nack(message, delay_ms / 1000)
            elif delay_ms > 0:
                loop = asyncio.get_running_loop()
                entry = (message, redeliveries + 1)
                handle = loop.call_later(delay_ms / 1000, self._redeliver_later, entry)
                self._timers[handle] = entry
            else:
                redeliver(self.subscription, message, redeliveries + 1)
        return unknown

    def _redeliver_later(self, entry: tuple[Message, int]) -> None:
        for handle, pending in list(self._timers.items()):
            if pending is entry:
                del self._timers[handle]
                break
        redeliver(self.subscription, *entry)

    def kick(self, reason: str = KICK_REASON) -> None:
        """Disconnect this consumer (the admin API's kick): nothing more is pushed, its stream
        ends with UNAVAILABLE and `reason`, and its unacknowledged and pending messages go to the
        subscription's other consumers (or back to the cursor of a durable subscription)."""
        if self.kicked is None:
            self.kicked = reason
        self.closed = True
        self.wakeup.set()

    def deny(self, reason: str) -> None:
        """Its user may no longer read what it subscribed to (the rules changed): as `kick`,
        but the stream ends with PERMISSION_DENIED and `reason`."""
        if self.denied is None:
            self.denied = reason
        self.closed = True
        self.wakeup.set()

    def error(self, code: int, text: str, delivery_ids: Sequence[int] = ()) -> None:
        self.errors.append(pb.ConsumeError(code=code, error=text, delivery_ids=delivery_ids))
        self.wakeup.set()

    # ---------------------------------------------------------------- leaving
    def close(self) -> list[tuple[Message, int]]:
        """Stop taking messages; returns what was delivered but not acked, then what was pending
        (in that order), for the caller to hand over once this consumer is detached."""
        self.closed = True
        left = [(message, count + 1) for message, count in self._unacked.values()]
        for timer, entry in self._timers.items():
            timer.cancel()
            left.append(entry)
        self._timers.clear()
        left.extend(self._pending)
        self._unacked.clear()
        self._pending.clear()
        self.wakeup.set()
        return left


def redeliver(subscription: Subscription, message: Message, redeliveries: int) -> bool:
    """Hand `message` to the subscription's next consumer; False when it has none."""
    consumer = subscription.pick()
    if consumer is None:
        return False
    if isinstance(consumer, GrpcConsumer):
        consumer.enqueue(message, redeliveries)
    else:
        consumer.deliver(message, subscription, tuple(subscription.filters))
    return True


def hand_over(subscription: Subscription, left: list[tuple[Message, int]]) -> int:
    """After a consumer left: give its unacked and pending messages to the others (live
    subscriptions) or back to the core (durable ones). Returns how many found a consumer."""
    if subscription.durable:
        for message, _ in left:
            subscription.nack(message, 0.0)
        return len(left)
    handed = 0
    for message, redeliveries in left:
        if redeliver(subscription, message, redeliveries):
            handed += 1
    return handed
