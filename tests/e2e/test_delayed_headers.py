"""Delayed delivery asked for by header on a single node (core/delayed.py): AMQP `x-delay` and
`x-deliver-at` through aio-pika, held then delivered once (the header is not obeyed again when
the held message is released)."""

from __future__ import annotations

import asyncio
import time

import aio_pika
import pytest

from tests.conftest import free_port


@pytest.fixture
def amqp_url(broker_factory) -> str:
    node = broker_factory(listeners={"amqp_port": free_port()})
    return f"amqp://guest:guest@127.0.0.1:{node.app.port('amqp')}/"


async def test_x_delay_and_x_deliver_at_hold_a_message_then_deliver_it_once(amqp_url: str) -> None:
    received: asyncio.Queue[tuple[bytes, float]] = asyncio.Queue()
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.declare_queue("", exclusive=True)
        await queue.bind("amq.topic", "timers.#")

        async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received.put_nowait((message.body, time.monotonic()))
            await message.ack()

        await queue.consume(take)
        exchange = await channel.get_exchange("amq.topic")
        sent_at = time.monotonic()
        await exchange.publish(aio_pika.Message(b"by delay", headers={"x-delay": 1500}), "timers.a")
        due_ms = int(time.time() * 1000) + 2500
        await exchange.publish(aio_pika.Message(b"by time", headers={"x-deliver-at": due_ms}), "timers.b")
        first, first_at = await asyncio.wait_for(received.get(), 15)
        second, second_at = await asyncio.wait_for(received.get(), 15)
        assert (first, second) == (b"by delay", b"by time")
        assert first_at - sent_at >= 1.4 and second_at - sent_at >= 2.4
        with pytest.raises(TimeoutError):  # released once, not held again for another delay
            await asyncio.wait_for(received.get(), 3)
