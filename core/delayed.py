"""Delayed delivery: messages that carry a deliver-at time are held, durably, until then.

MQTT clients ask for it with the topic prefix `$delayed/{seconds}/{topic}` (as EMQX and
RobustMQ do); every protocol can set the header `x-deliver-at` (epoch milliseconds) or
`x-delay` (milliseconds, as RabbitMQ's delayed-message exchange); those two headers are
removed from the message it holds, so that its release is not held again. On a single node held
messages live only in a `DelayedStore` (the metadata store, on disk): they survive a restart
and a flood of them cannot exhaust memory; one timer, for the earliest due, releases them into
the normal publish path. In a cluster a `SharedHold` keeps them
instead (shardgate/cluster/delayed.py: in etcd, released by any node), and the publish that
holds a message is acknowledged once the cluster has it (`hold` returns that future).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Protocol

from .errors import InvalidMessage, PublishRejected
from .message import Message, now_ms
from .ports import DelayedStore
from .records import decode_to_message, encode_message
from .restoring import set_aside
from .topics import validate_topic_name

log = logging.getLogger(__name__)

DELAYED_PREFIX = "$delayed/"
MAX_DELAY_S = 42 * 24 * 3600
# The headers that ask for a delay: removed from a held message (its release is not held again).
DELAY_HEADERS = frozenset({"x-deliver-at", "x-delay"})


class SharedHold(Protocol):
    """Where a cluster keeps held messages instead of this node's store."""

    def hold(self, message: Message, at_ms: int) -> asyncio.Future[None]:
        """Keep `message` until `at_ms`; the future resolves once it is durable (fails with
        PublishRejected if it cannot be kept). Raises PublishRejected when refused at once."""

    def __len__(self) -> int: ...

    async def finish(self) -> None:
        """Stop holding and releasing; end the releases under way (a node leaving)."""

    def close(self) -> None: ...


class Held:
    """What routing a held message gives: the receipt to acknowledge its publish on (None:
    durable already)."""

    __slots__ = ("receipt",)

    def __init__(self, receipt: asyncio.Future[None] | None) -> None:
        self.receipt = receipt


def release_topic(topic: str) -> str | None:
    """The topic a publish to `$delayed/<seconds>/<topic>` is released onto (None: `topic`
    is not such a topic, and its publish is refused)."""
    if not topic.startswith(DELAYED_PREFIX):
        return None
    seconds_text, _, rest = topic[len(DELAYED_PREFIX):].partition("/")
    if not seconds_text.isdigit() or not rest:
        return None
    return rest


def deliver_at(message: Message) -> int | None:
    """The deliver-at time a message asks for (and strips the `$delayed/` prefix), or None."""
    topic = message.topic
    if topic.startswith(DELAYED_PREFIX):
        seconds_text, _, rest = topic[len(DELAYED_PREFIX):].partition("/")
        if not seconds_text.isdigit() or not rest:
            raise InvalidMessage(f"delayed topic must be $delayed/<seconds>/<topic>, got {topic!r}")
        seconds = int(seconds_text)
        if seconds > MAX_DELAY_S:
            raise InvalidMessage(f"delay of {seconds}s is longer than the maximum {MAX_DELAY_S}s")
        message.topic = rest
        return message.publish_time_ms + seconds * 1000
    if message.headers:
        latest = message.publish_time_ms + MAX_DELAY_S * 1000
        for name, value in message.headers:
            if name not in DELAY_HEADERS:
                continue
            try:
                number = int(value)
            except ValueError:
                raise InvalidMessage(f"header {name} must be an integer, got {value!r}") from None
            # Out of range is refused, never clamped: the publisher learns of its mistake.
            if name == "x-deliver-at":
                if not 0 <= number <= latest:
                    raise InvalidMessage(f"header x-deliver-at {number} is not a time (epoch ms) "
                                         f"within {MAX_DELAY_S}s from now")
                return number
            if not 0 <= number <= MAX_DELAY_S * 1000:
                raise InvalidMessage(f"header x-delay {number} is outside 0..{MAX_DELAY_S * 1000} ms")
            return message.publish_time_ms + number
    return None


class DelayedDelivery:
    """Holds delayed messages and publishes each when its time comes.

    With a store (a broker with a data directory) held messages live only there: memory keeps
    their count and one timer, for the earliest one due, so a flood of delayed messages costs
    disk, never memory (the store refuses beyond the free-disk limit like any write), and a
    restart reads none of them before it is due. When the timer fires, the due ones are read
    in batches of `RELEASE_BATCH`, earliest first, published and deleted. Without a store
    (a broker in memory only) they are kept in memory, one timer each.
    """

    # Due messages read and released per loop turn.
    RELEASE_BATCH = 256
    # Where a stored record that cannot be read is moved (never due, still kept): set aside.
    SET_ASIDE_AT_MS = 2**62
    # The pause before looking again when the earliest due row cannot be read at all.
    UNREADABLE_RETRY_S = 60.0

    def __init__(self, store: DelayedStore | None, publish: Callable[[Message], object]) -> None:
        self.store = store
        self.publish = publish
        # cluster mode: held messages are kept there instead, from when the node has joined
        # (`share`)
        self.shared: SharedHold | None = None
        # without a store: one timer and the message per held message
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._held: dict[str, Message] = {}
        # with a store: how many it holds, and the one timer for the earliest due
        self._stored = 0
        self._wake: asyncio.TimerHandle | None = None
        self._wake_at_ms: int | None = None

    def share(self, shared: SharedHold) -> None:
        """Cluster mode, once the node has joined: messages held from now on are kept by
        `shared` (the cluster's store), not here."""
        self.shared = shared

    def __len__(self) -> int:
        return len(self._timers) + self._stored + (len(self.shared) if self.shared is not None else 0)

    def hold(self, message: Message, at_ms: int) -> asyncio.Future[None] | None:
        """Keep `message` until `at_ms`. Returns None once it is durable here, or (cluster) the
        future that resolves when it is. Raises PublishRejected."""
        if message.headers and any(name in DELAY_HEADERS for name, _value in message.headers):
            message.headers = [pair for pair in message.headers if pair[0] not in DELAY_HEADERS] or None
        if self.shared is not None:
            return self.shared.hold(message, at_ms)
        delivery_id = uuid.uuid4().hex
        if self.store is None:
            self._schedule(delivery_id, message, at_ms)
            return None
        try:
            self.store.put_delayed(delivery_id, at_ms, encode_message(message))
        except Exception as exc:
            raise PublishRejected(f"could not store the delayed message: {exc}") from exc
        self._stored += 1
        self._wake_for(at_ms)
        return None

    # ------------------------------------------------------------------ held in memory
    def _schedule(self, delivery_id: str, message: Message, at_ms: int) -> None:
        loop = asyncio.get_running_loop()
        delay = max(0.0, (at_ms - now_ms()) / 1000)
        self._held[delivery_id] = message
        self._timers[delivery_id] = loop.call_later(delay, self._release, delivery_id)

    def _release(self, delivery_id: str) -> None:
        self._timers.pop(delivery_id, None)
        message = self._held.pop(delivery_id, None)
        if message is not None:
            self._publish(message)

    def _publish(self, message: Message) -> None:
        message.publish_time_ms = now_ms()
        try:
            self.publish(message)
        except Exception:
            log.exception("delayed message for %r could not be published", message.topic)

    # ------------------------------------------------------------------ held in the store
    def _wake_for(self, at_ms: int, delay_s: float | None = None) -> None:
        """Make sure the timer fires by `at_ms` (or after `delay_s`)."""
        now = now_ms()
        if delay_s is None:
            delay_s = max(0.0, (at_ms - now) / 1000)
        fires_at_ms = now + int(delay_s * 1000)
        if self._wake_at_ms is not None and self._wake_at_ms <= fires_at_ms:
            return
        if self._wake is not None:
            self._wake.cancel()
        # the time the timer really fires (a retry fires later than the row is due)
        self._wake_at_ms = fires_at_ms
        self._wake = asyncio.get_running_loop().call_later(delay_s, self._release_due)

    def _release_due(self) -> None:
        """Publish (and forget) a batch of the stored messages that are due, then wait for
        the next."""
        self._wake = None
        self._wake_at_ms = None
        store = self.store
        if store is None:
            return
        now = now_ms()
        try:
            records = store.due_delayed(now, self.RELEASE_BATCH)
        except Exception:
            log.exception("could not read the delayed messages due")
            self._wake_for(now, self.UNREADABLE_RETRY_S)
            return
        for record in records:
            try:
                message = decode_to_message(record.data)
                validate_topic_name(message.topic)
            except Exception as exc:
                # kept in the store, never released: the log says what it was
                set_aside(log, f"delayed message {record.id}", record, exc)
                try:
                    store.put_delayed(record.id, self.SET_ASIDE_AT_MS, record.data)
                except Exception:
                    log.exception("could not set aside delayed message %s", record.id)
                continue
            self._publish(message)
            try:
                if store.delete_delayed(record.id):
                    self._stored -= 1
            except Exception:
                log.exception("could not forget delayed message %s", record.id)
        if len(records) >= self.RELEASE_BATCH:
            self._wake_for(now, 0.0)  # more are due: the next batch at the next loop turn
            return
        self._wake_next(now if not records else None)

    def _wake_next(self, read_at_ms: int | None = None) -> None:
        """Set the timer for the earliest held message. `read_at_ms`: the time of a read
        that returned nothing; a row due by then was there and could not be read."""
        assert self.store is not None
        try:
            self._stored, earliest = self.store.delayed_summary(self.SET_ASIDE_AT_MS)
        except Exception:
            log.exception("could not read the delayed messages")
            self._wake_for(now_ms(), self.UNREADABLE_RETRY_S)
            return
        if earliest is None:
            return
        if read_at_ms is not None and earliest <= read_at_ms:
            # due but not readable (the store logged the row and left it): look again later
            self._wake_for(earliest, self.UNREADABLE_RETRY_S)
            return
        self._wake_for(earliest)

    def restore(self) -> int:
        """Wait for what an earlier run held (due ones are released at once): only their
        count and the earliest time are read now, each message when it is due."""
        if self.store is None:
            return 0
        self._wake_next()
        return self._stored

    async def finish(self) -> None:
        """A cluster node leaving: stop holding and releasing, and end the releases under way,
        while its data plane still forwards (held messages stay for the other nodes)."""
        if self.shared is not None:
            await self.shared.finish()

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
            self._wake_at_ms = None
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._held.clear()
