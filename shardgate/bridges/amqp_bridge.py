"""AMQP bridge connector: forward Shardgate topics to an AMQP 0-9-1 broker and back, with aio-pika.

One `AmqpBridge` per `[[amqp_bridges]]` entry, run inside a Shardgate node:

- **out** filters: messages published locally (any protocol) that match are published to
  `exchange` on the remote broker (routing key: the topic with `/` → `.`, as RabbitMQ maps MQTT
  topics onto `amq.topic`, or a fixed `routing_key`), persistent, with publisher confirms. The
  bridge consumes them through a durable core subscription (`$amqp-bridge/<name>`): a message
  is acknowledged to the core only once the remote broker confirmed it. While the remote is down
  the subscription's cursor simply stops, so nothing is copied or dropped; after a restart of
  either side the unconfirmed messages are sent again (at least once, in order per shard).
  On a non-reliable stream there is no cursor: messages wait in a bounded memory queue
  (`max_queued`, oldest dropped and counted).
- **in**: messages of `queue` on the remote broker are published into the local core (topic
  `topic`, or `local_prefix` + the routing key with `.` → `/`) and acknowledged to the remote
  only once Shardgate accepted them (journaled, on a reliable stream); a failure nacks them
  back to the remote queue.

Like the MQTT bridge, it talks to the core directly, not through the local listeners, their
authentication or their ACLs; messages it brought in are never forwarded back out.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from ..core.durable import DurableOptions
from ..core.message import Message
from ..logs import ReconnectReport
from ..protocols.amqp.properties import message_from_properties, typed_properties
from ..protocols.amqp.routing import routing_key_for_topic, topic_for_routing_key

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..core.edge import Edge
    from ..core.subscriptions import Subscription

log = logging.getLogger(__name__)

PRODUCER_PROTOCOL = "amqp-bridge"


def _outgoing(aio_pika: Any, message: Message) -> Any:
    """The remote's copy of `message`: a message that came in over AMQP keeps its typed
    headers and basic properties (but not user-id, which the remote checks against its own
    login, nor expiration: the bridge drops what expires before it is sent)."""
    props = typed_properties(message)
    if props is None:
        return aio_pika.Message(
            bytes(message.payload), headers=dict(message.headers or ()) or None,
            content_type=message.content_type,
            correlation_id=message.correlation_data.decode("utf-8", "replace")
            if message.correlation_data else None,
            reply_to=message.reply_to, delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
    return aio_pika.Message(
        bytes(message.payload), headers=props.headers, content_type=props.content_type,
        content_encoding=props.content_encoding, delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=props.priority, correlation_id=props.correlation_id, reply_to=props.reply_to,
        message_id=props.message_id, timestamp=props.timestamp, type=props.message_type,
        app_id=props.app_id,
    )


@dataclass(slots=True)
class AmqpBridgeSettings:
    """One `[[amqp_bridges]]` entry of the configuration."""

    name: str
    # amqp://user:password@host:port/vhost (amqps:// for TLS).
    remote: str
    # Local topic filters forwarded to the remote exchange.
    out: list[str] = field(default_factory=list)
    exchange: str = "amq.topic"
    # Empty: the message's topic with "/" -> "." (after local_prefix is stripped).
    routing_key: str = ""
    # Remote queue consumed into Shardgate; declared durable if it does not exist.
    queue: str = ""
    # Local topic for messages from `queue`; empty: local_prefix + routing key with "." -> "/".
    topic: str = ""
    local_prefix: str = ""
    prefetch: int = 256
    # Messages sent to the remote and not yet confirmed, at most.
    window: int = 256
    # Memory queue bound for messages of non-reliable streams while the remote is away.
    max_queued: int = 100_000
    confirm_timeout_s: float = 10.0
    reconnect_min_s: float = 0.2
    reconnect_max_s: float = 10.0


# The one mapping of `amq.topic` routing keys, both ways (the AMQP listener's).
topic_to_routing_key = routing_key_for_topic
routing_key_to_topic = topic_for_routing_key


class AmqpBridge:
    """A running bridge: `start()` on the node's loop, `await stop()`; the core calls `deliver`."""

    def __init__(self, edge: Edge, settings: AmqpBridgeSettings) -> None:
        if not settings.out and not settings.queue:
            raise ValueError(f"amqp bridge {settings.name!r}: no out filters and no queue")
        if urlparse(settings.remote).scheme not in ("amqp", "amqps"):
            raise ValueError(f"amqp bridge {settings.name!r}: remote must be an amqp:// URL")
        # The front door: publishes and subscriptions go through it.
        self.edge = edge
        self.broker = edge.broker
        self.settings = settings
        self.name = settings.name
        # (message, subscription) waiting to be sent or confirmed, in delivery order.
        self.outbox: collections.deque[tuple[Message, Subscription]] = collections.deque()
        self._queued_offsets: set[tuple[str, int, int]] = set()
        self.connected = False
        self.forwarded_out = 0
        self.forwarded_in = 0
        self.dropped = 0
        self.connects = 0
        self._wakeup = asyncio.Event()
        self._subscription: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._report = ReconnectReport(log, f"amqp bridge {self.name}")

    # ------------------------------------------------------------------ core Consumer
    @property
    def consumer_id(self) -> str:
        return f"amqp-bridge:{self.name}"

    @property
    def available(self) -> bool:
        return self.connected and len(self.outbox) < self.settings.window

    def deliver(self, message: Message, subscription: Subscription, filters: Sequence[str]) -> None:
        if message.producer_protocol == PRODUCER_PROTOCOL and message.producer_id == self.name:
            subscription.ack(message)  # brought in by this bridge: never echo it back
            return
        if self._reliable(message):
            key = (message.stream, message.shard, message.offset)
            if key in self._queued_offsets:
                return  # a redelivery of what is already waiting here
            self._queued_offsets.add(key)
        elif len(self.outbox) >= self.settings.max_queued:
            # Only messages of non-reliable streams get here beyond `window`: the cursor of a
            # reliable one stops while the bridge is unavailable. Drop the oldest of those.
            for index, (queued, _) in enumerate(self.outbox):
                if queued.offset < 0 or not self._reliable(queued):
                    del self.outbox[index]
                    break
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("amqp bridge %s: queue full, %d messages dropped", self.name, self.dropped)
        self.outbox.append((message, subscription))
        self._wakeup.set()

    def _reliable(self, message: Message) -> bool:
        stream = self.broker.streams.get(message.stream)
        return stream is not None and stream.reliable

    def _forget(self, message: Message) -> None:
        self._queued_offsets.discard((message.stream, message.shard, message.offset))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.settings.out:
            sub = self.edge.durable_subscription(
                f"$amqp-bridge/{self.name}", options=DurableOptions(ack_timeout_s=None), owner=self,
            )
            for topic_filter in self.settings.out:
                self.edge.add_filter(sub, topic_filter)
            self._subscription = sub
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"amqp-bridge-{self.name}")

    async def stop(self) -> None:
        """Stop forwarding; the durable subscription stays, so what was not confirmed is sent
        again when the bridge next runs."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._subscription is not None:
            self.edge.detach(self._subscription, self)

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": "amqp", "remote": urlparse(self.settings.remote).hostname,
            "connected": self.connected, "queued": len(self.outbox), "dropped": self.dropped,
            "forwarded_out": self.forwarded_out, "forwarded_in": self.forwarded_in,
            "connects": self.connects,
        }

    # ------------------------------------------------------------------ the connection loop
    async def _run(self) -> None:
        import aio_pika

        delay = self.settings.reconnect_min_s
        while True:
            try:
                connection = await aio_pika.connect(self.settings.remote, timeout=10)
            except Exception as exc:
                self._report.failed(exc, self.settings.reconnect_max_s)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.reconnect_max_s)
                continue
            delay = self.settings.reconnect_min_s
            self.connects += 1
            self._report.connected(str(urlparse(self.settings.remote).hostname))
            try:
                await self._serve(connection)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._report.lost(exc)
            finally:
                self.connected = False
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(connection.close(), 2)
            await asyncio.sleep(self.settings.reconnect_min_s)

    async def _serve(self, connection: Any) -> None:
        tasks = []
        if self.settings.out:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange(self.settings.exchange, ensure=False)
            tasks.append(asyncio.create_task(self._forward(connection, exchange)))
        if self.settings.queue:
            tasks.append(asyncio.create_task(self._receive(connection)))
        self.connected = True
        if self._subscription is not None:
            self.edge.attach(self._subscription, self)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            raise ConnectionError("remote connection closed")
        finally:
            self.connected = False
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task

    async def _forward(self, connection: Any, exchange: Any) -> None:
        import aio_pika

        settings = self.settings
        while True:
            if connection.is_closed:
                raise ConnectionError("remote connection closed")
            if not self.outbox:
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), 1.0)
                continue
            batch = list(itertools.islice(self.outbox, settings.window))
            publishes = []
            for message, _ in batch:
                if message.expired():
                    continue
                topic = message.topic
                if settings.local_prefix:
                    if not topic.startswith(settings.local_prefix):
                        continue
                    topic = topic[len(settings.local_prefix):]
                routing_key = settings.routing_key or topic_to_routing_key(topic)
                outgoing = _outgoing(aio_pika, message)
                publishes.append(exchange.publish(outgoing, routing_key, timeout=settings.confirm_timeout_s))
            await asyncio.gather(*publishes)  # each returns once the remote confirmed it
            for _ in batch:
                message, subscription = self.outbox.popleft()
                self._forget(message)
                subscription.ack(message)
            self.forwarded_out += len(publishes)
            if self._subscription is not None:
                self._subscription.wake()  # the window has room again

    async def _receive(self, connection: Any) -> None:
        settings = self.settings
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=settings.prefetch)
        queue = await channel.declare_queue(settings.queue, durable=True)
        async with queue.iterator() as deliveries:
            async for incoming in deliveries:
                topic = settings.topic or settings.local_prefix + routing_key_to_topic(incoming.routing_key or "")
                properties = incoming.properties
                # typed headers and every basic property kept, as for a local AMQP publish
                message = message_from_properties(
                    topic, bytes(incoming.body), properties, self.name, properties.marshal())
                message.qos = 1
                message.producer_protocol = PRODUCER_PROTOCOL
                try:
                    pending = self.edge.publish(message)
                    if pending is not None:
                        await pending  # journaled: only now may the remote forget it
                except Exception as exc:
                    log.warning("amqp bridge %s: message on %r not accepted locally: %s", self.name, topic, exc)
                    await incoming.nack(requeue=True)
                    continue
                await incoming.ack()
                self.forwarded_in += 1

