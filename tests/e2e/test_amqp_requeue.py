"""Requeued messages go back to their original position, marked redelivered, as in RabbitMQ:
"When a message is requeued, it will be placed to its original position in its queue, if
possible" (https://www.rabbitmq.com/docs/confirms#consumer-nacks-requeue). That holds for
basic.reject / basic.nack with requeue, basic.recover, and a channel or connection closing with
unacknowledged deliveries. Each test runs against Shardgate and a real RabbitMQ node.
"""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import pika


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def fill(channel: aio_pika.abc.AbstractChannel, count: int) -> aio_pika.abc.AbstractQueue:
    queue = await channel.declare_queue(unique("requeue"), auto_delete=False, durable=False)
    for i in range(count):
        await channel.default_exchange.publish(aio_pika.Message(str(i).encode()), queue.name)
    return queue


async def drain(queue: aio_pika.abc.AbstractQueue) -> list[tuple[bytes, bool]]:
    """Everything left in the queue, in order, as (body, redelivered)."""
    out = []
    while True:
        message = await queue.get(no_ack=True, fail=False)
        if message is None:
            return out
        out.append((message.body, message.redelivered))


async def take(queue: aio_pika.abc.AbstractQueue, count: int) -> list[aio_pika.abc.AbstractIncomingMessage]:
    return [await queue.get(no_ack=False) for _ in range(count)]


async def test_nack_and_reject_in_any_order_restore_the_original_order(amqp_broker_url):
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel()
        queue = await fill(channel, 5)
        m0, m1, m2, m3 = await take(queue, 4)
        await m3.reject(requeue=True)
        await m0.nack(requeue=True)
        await m2.nack(requeue=True)
        await m1.reject(requeue=True)
        assert await drain(queue) == [
            (b"0", True), (b"1", True), (b"2", True), (b"3", True), (b"4", False),
        ]
        await queue.delete()


async def test_basic_recover_requeues_in_order(amqp_broker_url):
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel()
        queue = await fill(channel, 4)
        messages = await take(queue, 3)
        await messages[1].ack()
        await channel.channel.basic_recover(requeue=True)
        assert await drain(queue) == [(b"0", True), (b"2", True), (b"3", False)]
        await queue.delete()


async def test_channel_close_requeues_unacked_in_order(amqp_broker_url):
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel()
        queue = await fill(channel, 4)
        consumer_channel = await conn.channel()
        await consumer_channel.set_qos(prefetch_count=10)
        consumed = await consumer_channel.get_queue(queue.name)
        got: list[aio_pika.abc.AbstractIncomingMessage] = []
        done = asyncio.Event()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            got.append(message)
            if len(got) == 4:
                done.set()

        await consumed.consume(on_message)
        await asyncio.wait_for(done.wait(), 5)
        await got[2].ack()
        await consumer_channel.close()
        assert await drain(queue) == [(b"0", True), (b"1", True), (b"3", True)]
        await queue.delete()


async def test_connection_close_requeues_unacked_in_order_for_the_next_consumer(amqp_broker_url):
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel()
        queue = await fill(channel, 3)
        other = await aio_pika.connect(amqp_broker_url)
        other_channel = await other.channel()
        other_queue = await other_channel.get_queue(queue.name)
        await take(other_queue, 2)
        await other.close()
        received: list[tuple[bytes, bool]] = []
        done = asyncio.Event()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received.append((message.body, message.redelivered))
            await message.ack()
            if len(received) == 3:
                done.set()

        tag = await queue.consume(on_message)
        await asyncio.wait_for(done.wait(), 5)
        assert received == [(b"0", True), (b"1", True), (b"2", False)]
        await queue.cancel(tag)
        await queue.delete()


def test_pika_nack_multiple_requeues_in_order(amqp_broker_url):
    port = int(amqp_broker_url.rsplit(":", 1)[1].strip("/"))
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", port, credentials=pika.PlainCredentials("guest", "guest")
    ))
    try:
        channel = conn.channel()
        queue = channel.queue_declare(unique("pika-requeue"), exclusive=True).method.queue
        for i in range(4):
            channel.basic_publish("", queue, str(i).encode())
        tags = [channel.basic_get(queue)[0].delivery_tag for _ in range(3)]
        channel.basic_nack(tags[0], requeue=True)
        channel.basic_nack(tags[2], multiple=True, requeue=True)
        seen = []
        while True:
            method, _, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            seen.append((body, method.redelivered))
        assert seen == [(b"0", True), (b"1", True), (b"2", True), (b"3", False)]
    finally:
        conn.close()
