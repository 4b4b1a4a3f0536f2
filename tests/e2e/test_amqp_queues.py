"""AMQP queue arguments end to end with aio-pika: dead-lettering, TTL, max-length, x-expires,
single active consumer, exclusive consumers and queues, recover."""

from __future__ import annotations

import asyncio

import aio_pika
import pytest
from aiormq.exceptions import ChannelAccessRefused, ChannelLockedResource, ChannelNotFoundEntity

from tests.conftest import free_port


@pytest.fixture
def amqp_url(broker_factory) -> str:
    node = broker_factory(listeners={"amqp_port": free_port()})
    return f"amqp://guest:guest@127.0.0.1:{node.app.port('amqp')}/"


async def _get(queue, timeout: float = 5.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        message = await queue.get(fail=False)
        if message is not None:
            return message
        if loop.time() > deadline:
            raise AssertionError("no message")
        await asyncio.sleep(0.01)


async def _ignore(message) -> None:
    pass


async def test_rejected_message_is_dead_lettered(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        dlx = await channel.declare_exchange("dlx", aio_pika.ExchangeType.DIRECT)
        dead = await channel.declare_queue("dead", auto_delete=False)
        await dead.bind(dlx, "failed")
        work = await channel.declare_queue("work-dl", auto_delete=False, arguments={
            "x-dead-letter-exchange": "dlx", "x-dead-letter-routing-key": "failed",
        })
        await channel.default_exchange.publish(
            aio_pika.Message(b"bad", headers={"attempt": 1}), "work-dl"
        )
        m = await _get(work)
        await m.reject(requeue=False)
        d = await _get(dead)
        assert d.body == b"bad" and d.routing_key == "failed" and d.exchange == "dlx"
        assert d.headers["attempt"] == 1
        death = d.headers["x-death"][0]
        assert death["reason"] == "rejected" and death["queue"] == "work-dl"


async def test_message_ttl_expires_into_dead_letter_queue(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        dead = await channel.declare_queue("expired", auto_delete=False)
        await channel.declare_queue("short-lived", auto_delete=False, arguments={
            "x-message-ttl": 50, "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "expired",
        })
        await channel.default_exchange.publish(aio_pika.Message(b"old"), "short-lived")
        d = await _get(dead)
        assert d.body == b"old" and d.headers["x-death"][0]["reason"] == "expired"


async def test_per_message_expiration(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("per-message", auto_delete=False)
        await channel.default_exchange.publish(aio_pika.Message(b"gone", expiration=0.05), "per-message")
        await channel.default_exchange.publish(aio_pika.Message(b"kept"), "per-message")
        await asyncio.sleep(0.2)
        assert (await _get(queue)).body == b"kept"


async def test_max_length_drops_oldest(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("bounded", auto_delete=False, arguments={"x-max-length": 3})
        for i in range(6):
            await channel.default_exchange.publish(aio_pika.Message(str(i).encode()), "bounded")
        bodies = [(await _get(queue, 2)).body for _ in range(3)]
        assert bodies == [b"3", b"4", b"5"]
        assert await queue.get(fail=False) is None


async def test_unused_queue_expires(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        await channel.declare_queue("idle", auto_delete=False, arguments={"x-expires": 100})
        await asyncio.sleep(0.4)
        with pytest.raises(ChannelNotFoundEntity):
            await channel.declare_queue("idle", passive=True)


async def test_single_active_consumer_fails_over(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("sac", auto_delete=False,
                                            arguments={"x-single-active-consumer": True})
        a: list[bytes] = []
        b: list[bytes] = []

        async def on_a(m):
            a.append(m.body)
            await m.ack()

        async def on_b(m):
            b.append(m.body)
            await m.ack()

        tag_a = await queue.consume(on_a)
        await queue.consume(on_b)
        for i in range(4):
            await channel.default_exchange.publish(aio_pika.Message(b"%d" % i), "sac")
        for _ in range(200):
            if len(a) == 4:
                break
            await asyncio.sleep(0.01)
        assert len(a) == 4 and b == []
        await queue.cancel(tag_a)
        await channel.default_exchange.publish(aio_pika.Message(b"next"), "sac")
        for _ in range(200):
            if b:
                break
            await asyncio.sleep(0.01)
        assert b == [b"next"]


async def test_exclusive_consumer_refuses_others(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("solo", auto_delete=False)
        await queue.consume(_ignore, exclusive=True)
        other = await conn.channel()
        q2 = await other.declare_queue("solo", auto_delete=False)
        with pytest.raises(ChannelAccessRefused):
            await q2.consume(_ignore)


async def test_exclusive_queue_is_locked_for_other_connections_and_dies_with_owner(amqp_url):
    owner = await aio_pika.connect(amqp_url)
    channel = await owner.channel()
    await channel.declare_queue("private", exclusive=True)
    async with await aio_pika.connect(amqp_url) as intruder:
        ch = await intruder.channel()
        with pytest.raises(ChannelLockedResource):
            await ch.declare_queue("private", passive=True)
        await owner.close()
        await asyncio.sleep(0.05)
        ch = await intruder.channel()
        with pytest.raises(ChannelNotFoundEntity):
            await ch.declare_queue("private", passive=True)


async def test_recover_redelivers_unacked(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("", exclusive=True)
        await channel.default_exchange.publish(aio_pika.Message(b"r"), queue.name)
        first = await _get(queue)
        assert not first.redelivered
        await (await channel.get_underlay_channel()).basic_recover(requeue=True)
        again = await _get(queue)
        assert again.body == b"r" and again.redelivered


async def test_multiple_ack(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("", exclusive=True)
        for i in range(5):
            await channel.default_exchange.publish(aio_pika.Message(b"%d" % i), queue.name)
        messages = [await _get(queue) for _ in range(5)]
        await messages[-1].ack(multiple=True)
        await (await channel.get_underlay_channel()).basic_recover(requeue=True)
        await asyncio.sleep(0.05)
        assert await queue.get(fail=False) is None
