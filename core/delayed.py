"""Delayed delivery: messages that carry a deliver-at time are held, durably, until then.

MQTT clients ask for it with the topic prefix `$delayed/{seconds}/{topic}` (as EMQX and
RobustMQ do); every protocol can set the header `x-deliver-at` (epoch milliseconds) or
`x-delay` (milliseconds, as RabbitMQ's delayed-message exchange). Held messages live in a
`DelayedStore` (the metadata store) so they survive a restart, and one timer per message
releases them into the normal publish path.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from .errors import PublishRejected
from .message import Message, now_ms
from .ports import DelayedStore
from .records import decode_to_message, encode_message

log = logging.getLogger(__name__)

DELAYED_PREFIX = "$delayed/"
MAX_DELAY_S = 42 * 24 * 3600


def deliver_at(message: Message) -> int | None:
    """The deliver-at time a message asks for (and strips the `$delayed/` prefix), or None."""
    topic = message.topic
    if topic.startswith(DELAYED_PREFIX):
        seconds_text, _, rest = topic[len(DELAYED_PREFIX):].partition("/")
        if not seconds_text.isdigit() or not rest:
            raise PublishRejected(f"delayed topic must be $delayed/<seconds>/<topic>, got {topic!r}")
        seconds = int(seconds_text)
        if seconds > MAX_DELAY_S:
            raise PublishRejected(f"delay of {seconds}s is longer than the maximum {MAX_DELAY_S}s")
        message.topic = rest
        return message.publish_time_ms + seconds * 1000
    if message.headers:
        for name, value in message.headers:
            try:
                if name == "x-deliver-at":
                    return int(value)
                if name == "x-delay":
                    return message.publish_time_ms + int(value)
            except ValueError:
                raise PublishRejected(f"header {name} must be an integer, got {value!r}") from None
    return None


class DelayedDelivery:
    """Holds delayed messages and publishes each when its time comes."""

    def __init__(self, store: DelayedStore | None, publish: Callable[[Message], object]) -> None:
        self.store = store
        self.publish = publish
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._held: dict[str, Message] = {}

    def __len__(self) -> int:
        return len(self._timers)

    def hold(self, message: Message, at_ms: int) -> None:
        delivery_id = uuid.uuid4().hex
        if self.store is not None:
            try:
                self.store.put_delayed(delivery_id, at_ms, encode_message(message))
            except Exception as exc:
                raise PublishRejected(f"could not store the delayed message: {exc}") from exc
        self._schedule(delivery_id, message, at_ms)

    def _schedule(self, delivery_id: str, message: Message, at_ms: int) -> None:
        loop = asyncio.get_running_loop()
        delay = max(0.0, (at_ms - now_ms()) / 1000)
        self._held[delivery_id] = message
        self._timers[delivery_id] = loop.call_later(delay, self._release, delivery_id)

    def _release(self, delivery_id: str) -> None:
        self._timers.pop(delivery_id, None)
        message = self._held.pop(delivery_id, None)
        if message is None:
            return
        message.publish_time_ms = now_ms()
        try:
            self.publish(message)
        except Exception:
            log.exception("delayed message for %r could not be published", message.topic)
        if self.store is not None:
            try:
                self.store.delete_delayed(delivery_id)
            except Exception:
                log.exception("could not forget delayed message %s", delivery_id)

    def restore(self) -> int:
        """Reschedule what an earlier run held (due ones are released at once)."""
        if self.store is None:
            return 0
        count = 0
        for record in self.store.due_delayed(2**62):
            try:
                message = decode_to_message(record.data)
            except ValueError:
                log.error("delayed message %s is unreadable; dropped", record.id)
                self.store.delete_delayed(record.id)
                continue
            self._schedule(record.id, message, record.deliver_at_ms)
            count += 1
        return count

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._held.clear()
