"""A purge drops an AMQP queue's ready messages, never its unacknowledged ones, whether a client
sends queue.purge (checked against a real RabbitMQ node too) or an administrator purges the
queue's subscription over the admin API; a replay (cursor reset) hands each message once,
not again beside the copy already waiting in the queue."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import aio_pika

from tests.conftest import ThreadedBroker, free_port


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def fill(channel: aio_pika.abc.AbstractChannel, count: int) -> aio_pika.abc.AbstractQueue:
    """A durable queue holding `count` persistent messages "0".."count-1" (confirmed)."""
    queue = await channel.declare_queue(unique("purge"), durable=True, auto_delete=False)
    for i in range(count):
        await channel.default_exchange.publish(
            aio_pika.Message(str(i).encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            queue.name)
    return queue


async def drain(queue: aio_pika.abc.AbstractQueue) -> list[tuple[bytes, bool]]:
    """Everything left in the queue, in order, as (body, redelivered)."""
    out = []
    while True:
        message = await queue.get(no_ack=True, fail=False)
        if message is None:
            return out
        out.append((message.body, message.redelivered))


async def test_queue_purge_drops_ready_messages_and_keeps_unacknowledged_ones(amqp_broker_url):
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel(publisher_confirms=True)
        queue = await fill(channel, 20)
        held = [await queue.get(no_ack=False) for _ in range(3)]
        assert (await queue.purge()).message_count == 17
        await channel.default_exchange.publish(
            aio_pika.Message(b"after", delivery_mode=aio_pika.DeliveryMode.PERSISTENT), queue.name)
        for message in held:
            await message.nack(requeue=True)
        assert await drain(queue) == [(b"0", True), (b"1", True), (b"2", True), (b"after", False)]
        await queue.delete()


def _admin(broker_factory: Callable[..., ThreadedBroker]) -> tuple[str, str]:
    app = broker_factory(listeners={"amqp_port": free_port(), "http_port": free_port()}).app
    return (f"amqp://guest:guest@127.0.0.1:{app.port('amqp')}/",
            f"http://127.0.0.1:{app.port('http')}")


def _post(admin: str, queue: str, action: str, body: Any = None) -> Any:
    name = urllib.parse.quote(f"amqp:/:{queue}", safe="")
    request = urllib.request.Request(
        f"{admin}/api/subscriptions/{name}/{action}", method="POST",
        data=json.dumps(body or {}).encode(),
        headers={"X-Requested-With": "test", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


async def test_admin_purge_drops_the_ready_messages_of_a_queue(broker_factory):
    url, admin = _admin(broker_factory)
    async with await aio_pika.connect(url) as conn:
        channel = await conn.channel(publisher_confirms=True)
        queue = await fill(channel, 30)
        held = await queue.get(no_ack=False)
        answer = _post(admin, queue.name, "purge")
        assert answer["purged"] == 30 and answer["subscription"]["queued"] == 0, answer
        await channel.default_exchange.publish(
            aio_pika.Message(b"after", delivery_mode=aio_pika.DeliveryMode.PERSISTENT), queue.name)
        # the delivered one stays with its consumer: given back, it comes again
        await held.nack(requeue=True)
        assert await drain(queue) == [(b"0", True), (b"after", False)]


async def test_admin_replay_hands_each_waiting_message_once(broker_factory):
    url, admin = _admin(broker_factory)
    async with await aio_pika.connect(url) as conn:
        channel = await conn.channel(publisher_confirms=True)
        queue = await fill(channel, 10)
        answer = _post(admin, queue.name, "cursor", {"position": "earliest"})
        assert answer["lag"] == 10, answer
        # the replay refills the queue from the journal a moment later: read until 10 came
        got: list[bytes] = []
        deadline = asyncio.get_running_loop().time() + 30
        while len(got) < 10 and asyncio.get_running_loop().time() < deadline:
            got += [body for body, _ in await drain(queue)]
            await asyncio.sleep(0.05)
        assert got == [str(i).encode() for i in range(10)]
        assert await drain(queue) == []  # and not a second copy
