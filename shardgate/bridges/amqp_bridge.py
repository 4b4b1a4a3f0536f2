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

Like the MQTT bridge, it talks to the core through its front door, not through the local
listeners, their authentication or their ACLs; messages it brought in are never forwarded back
out. The consumer, outbox, echo guard and reconnect loop are every bridge's (`bridges.base`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..core.message import Message
from ..protocols.amqp.properties import message_from_properties, typed_properties
from ..protocols.amqp.routing import routing_key_for_topic, topic_for_routing_key
from .base import BridgeBase, BridgeSettingsBase

if TYPE_CHECKING:
    from ..core.edge import Edge

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
class AmqpBridgeSettings(BridgeSettingsBase):
    """One `[[amqp_bridges]]` entry of the configuration; `remote` is
    amqp://user:password@host:port/vhost (amqps:// for TLS), `out` the local topic filters
    forwarded to `exchange`."""

    exchange: str = "amq.topic"
    # Empty: the message's topic with "/" -> "." (after local_prefix is stripped).
    routing_key: str = ""
    # Remote queue consumed into Shardgate; declared durable if it does not exist.
    queue: str = ""
    # Local topic for messages from `queue`; empty: local_prefix + routing key with "." -> "/".
    topic: str = ""
    prefetch: int = 256
    confirm_timeout_s: float = 10.0

    RANGES: ClassVar[dict[str, tuple[float | None, float | None]]] = {
        **BridgeSettingsBase.RANGES, "prefetch": (0, 65535), "confirm_timeout_s": (0.001, None),
    }


# The one mapping of `amq.topic` routing keys, both ways (the AMQP listener's).
topic_to_routing_key = routing_key_for_topic
routing_key_to_topic = topic_for_routing_key


class AmqpBridge(BridgeBase[Any]):
    """A running AMQP bridge: `start()` on the node's loop, `await stop()`; the core calls
    `deliver`."""

    producer_protocol = PRODUCER_PROTOCOL
    kind = "amqp bridge"
    schemes = ("amqp", "amqps")
    nothing_to_do = "no out filters and no queue"
    log = log

    def __init__(self, edge: Edge, settings: AmqpBridgeSettings) -> None:
        super().__init__(edge, settings)
        self.settings = settings

    def _brings_in(self, settings: BridgeSettingsBase) -> bool:
        return isinstance(settings, AmqpBridgeSettings) and bool(settings.queue)

    def status(self) -> dict[str, Any]:
        return {**super().status(), "kind": "amqp"}

    # ------------------------------------------------------------------ the connection
    async def _connect(self) -> Any:
        import aio_pika

        return await aio_pika.connect(self.settings.remote, timeout=10)

    async def _close(self, connection: Any) -> None:
        await connection.close()

    async def _serve(self, connection: Any) -> None:
        tasks = []
        if self.settings.out:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange(self.settings.exchange, ensure=False)
            tasks.append(asyncio.create_task(self._forward(connection, exchange)))
        if self.settings.queue:
            tasks.append(asyncio.create_task(self._receive(connection)))
        self._ready()
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
            batch = await self._next_batch(settings.window)
            if not batch:
                continue
            publishes = []
            sent = []
            for entry in batch:
                topic = self._remote_topic(entry)
                if topic is None:
                    continue
                if entry.encoded is None:
                    entry.encoded = _outgoing(aio_pika, entry.message)
                routing_key = settings.routing_key or topic_to_routing_key(topic)
                publishes.append(exchange.publish(entry.encoded, routing_key,
                                                  timeout=settings.confirm_timeout_s))
                sent.append(entry)
            await asyncio.gather(*publishes)  # each returns once the remote confirmed it
            self.forwarded_out += len(publishes)
            self.settle(sent)

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
                    await self._publish_in(message)  # journaled: only now may the remote forget it
                except Exception as exc:
                    log.warning("amqp bridge %s: message on %r not accepted locally: %s", self.name, topic, exc)
                    await incoming.nack(requeue=True)
                    continue
                await incoming.ack()
