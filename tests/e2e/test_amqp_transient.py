"""Transient messages (delivery-mode 1) as RabbitMQ keeps them: not written to disk unless
something durable needs them, and never out of order with the persistent ones.

RabbitMQ stores a persistent message (delivery-mode 2) routed to a durable queue, and keeps a
transient one in memory (https://www.rabbitmq.com/docs/persistence-conf: "transient messages
... are not persisted"). Shardgate journals every persistent message; a transient one only
when a durable subscription (a durable queue, a persistent MQTT session, a durable gRPC
subscription, a bridge) wants it. Either way a channel's messages reach a queue in the order
they were published (https://www.rabbitmq.com/docs/semantics#ordering), which the order test
checks against both brokers: on Shardgate a persistent message waits for its journal commit
before delivery, and a transient one published after it must wait behind it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import aio_pika
import pytest

from tests.conftest import free_port


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def journaled(broker: object) -> int:
    """How many records the default stream's journal holds."""
    app = broker.app  # type: ignore[attr-defined]
    stream = app.broker.stream("default")
    return broker.call(  # type: ignore[attr-defined]
        lambda: sum(shard.log.next_offset for shard in stream.shards)
    )


async def receive(queue: aio_pika.abc.AbstractQueue, count: int, timeout: float = 20.0) -> list[bytes]:
    bodies: list[bytes] = []
    done = asyncio.get_running_loop().create_future()

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        bodies.append(message.body)
        if len(bodies) == count and not done.done():
            done.set_result(None)

    tag = await queue.consume(on_message, no_ack=True)
    try:
        await asyncio.wait_for(done, timeout)
    finally:
        await queue.cancel(tag)
    return bodies


@pytest.mark.parametrize("durable", [False, True], ids=["live-queue", "durable-queue"])
async def test_persistent_and_transient_messages_keep_their_order(amqp_broker_url, durable):
    """Alternating persistent and transient publishes on one channel arrive in publish order."""
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel(publisher_confirms=False)
        queue = await channel.declare_queue(
            unique("mixed"), durable=durable, exclusive=not durable, auto_delete=durable
        )
        sent = []
        for i in range(300):
            mode = aio_pika.DeliveryMode.PERSISTENT if i % 3 == 0 else aio_pika.DeliveryMode.NOT_PERSISTENT
            body = f"{i}".encode()
            sent.append(body)
            await channel.default_exchange.publish(
                aio_pika.Message(body, delivery_mode=mode), queue.name
            )
        assert await receive(queue, len(sent)) == sent
        if durable:
            await queue.delete(if_unused=False, if_empty=False)


async def test_transient_messages_skip_the_journal_unless_a_durable_queue_wants_them(
    broker_factory: Callable[..., object],
):
    broker = broker_factory(listeners={"amqp_port": free_port()})
    url = f"amqp://guest:guest@127.0.0.1:{broker.app.port('amqp')}/"  # type: ignore[attr-defined]
    async with await aio_pika.connect(url) as conn:
        channel = await conn.channel()  # publisher confirms: each publish waits for its ack
        live = await channel.declare_queue(unique("live"), exclusive=True)
        durable = await channel.declare_queue(unique("durable"), durable=True)
        before = journaled(broker)

        for i in range(5):
            await channel.default_exchange.publish(aio_pika.Message(b"t%d" % i), live.name)
        assert await receive(live, 5) == [b"t%d" % i for i in range(5)]
        assert journaled(broker) == before, "a transient message only live queues want stays in memory"

        await channel.default_exchange.publish(
            aio_pika.Message(b"p", delivery_mode=aio_pika.DeliveryMode.PERSISTENT), live.name
        )
        assert journaled(broker) == before + 1, "a persistent message is always journaled"

        await channel.default_exchange.publish(aio_pika.Message(b"d"), durable.name)
        assert journaled(broker) == before + 2, "a durable queue's transient message is journaled"
        assert await receive(live, 1) == [b"p"]
        assert await receive(durable, 1) == [b"d"]
