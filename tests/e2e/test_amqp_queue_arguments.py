"""Queue and exchange arguments programs written for RabbitMQ rely on, with RabbitMQ's
behaviour; each test runs against Shardgate and a real RabbitMQ node:
x-max-priority (https://www.rabbitmq.com/docs/priority), x-overflow reject-publish and
x-max-length-bytes (https://www.rabbitmq.com/docs/maxlength), alternate exchanges
(https://www.rabbitmq.com/docs/ae), TTL 0 delivered to a ready consumer
(https://www.rabbitmq.com/docs/ttl), consumer priorities, and the 540s for basic.qos
prefetch-size, basic.recover requeue=false and channel.flow active=false (rabbit_channel).
"""

from __future__ import annotations

import asyncio
import uuid

import aiormq
import pytest
from aiormq.exceptions import ConnectionNotImplemented, DeliveryError
from pamqp.commands import Basic


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def test_priority_queue_delivers_highest_priority_first(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        queue = (await channel.queue_declare("", exclusive=True, arguments={"x-max-priority": 10})).queue
        for priority in (1, 5, 3, 9, 0, 5, 20):
            await channel.basic_publish(
                f"{priority}".encode(), routing_key=queue,
                properties=Basic.Properties(priority=priority, message_id=unique("m")),
            )
        await channel.basic_publish(b"none", routing_key=queue)
        bodies = [(await channel.basic_get(queue, no_ack=True)).body for _ in range(8)]
        # 20 counts as the maximum (10); equal priorities keep their order; none is 0.
        assert bodies == [b"20", b"9", b"5", b"5", b"3", b"1", b"0", b"none"]
    finally:
        await conn.close()


async def test_overflow_reject_publish_nacks_the_publisher(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()  # publisher confirms
        queue = (await channel.queue_declare("", exclusive=True, arguments={
            "x-max-length": 1, "x-overflow": "reject-publish",
        })).queue
        assert isinstance(await channel.basic_publish(b"1", routing_key=queue), Basic.Ack)
        with pytest.raises(DeliveryError):
            await channel.basic_publish(b"2", routing_key=queue)
        assert (await channel.queue_declare(queue, passive=True)).message_count == 1
        assert (await channel.basic_get(queue, no_ack=True)).body == b"1"
        assert isinstance(await channel.basic_publish(b"3", routing_key=queue), Basic.Ack)
    finally:
        await conn.close()


async def test_max_length_bytes_drops_from_the_head(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        queue = (await channel.queue_declare("", exclusive=True, arguments={
            "x-max-length-bytes": 5,
        })).queue
        for body in (b"aaa", b"bbb", b"ccc"):
            await channel.basic_publish(body, routing_key=queue)
        assert (await channel.queue_declare(queue, passive=True)).message_count == 1
        assert (await channel.basic_get(queue, no_ack=True)).body == b"ccc"
    finally:
        await conn.close()


async def test_alternate_exchange_takes_what_the_exchange_cannot_route(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        alternate, main = unique("ae"), unique("main")
        await channel.exchange_declare(alternate, exchange_type="fanout", auto_delete=True)
        await channel.exchange_declare(main, exchange_type="direct", auto_delete=True,
                                       arguments={"alternate-exchange": alternate})
        unrouted = (await channel.queue_declare("", exclusive=True)).queue
        await channel.queue_bind(unrouted, alternate)
        routed = (await channel.queue_declare("", exclusive=True)).queue
        await channel.queue_bind(routed, main, "known")
        # Mandatory, but the alternate exchange routes it: acked, not returned.
        ok = await channel.basic_publish(b"x", exchange=main, routing_key="nomatch", mandatory=True)
        assert isinstance(ok, Basic.Ack)
        await channel.basic_publish(b"y", exchange=main, routing_key="known")
        got = await channel.basic_get(unrouted, no_ack=True)
        # The delivery reports the exchange it was published to.
        assert (got.body, got.delivery.exchange, got.delivery.routing_key) == (b"x", main, "nomatch")
        assert (await channel.basic_get(routed, no_ack=True)).body == b"y"
        assert (await channel.queue_declare(unrouted, passive=True)).message_count == 0
    finally:
        await conn.close()


async def test_ttl_zero_reaches_a_ready_consumer(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        queue = (await channel.queue_declare("", exclusive=True, arguments={"x-message-ttl": 0})).queue
        got: asyncio.Queue[aiormq.abc.DeliveredMessage] = asyncio.Queue()
        await channel.basic_consume(queue, got.put, no_ack=True)
        await channel.basic_publish(b"now", routing_key=queue)
        assert (await asyncio.wait_for(got.get(), 5)).body == b"now"
    finally:
        await conn.close()


@pytest.mark.parametrize("method, text", [
    (lambda ch: ch.basic_qos(prefetch_size=10, prefetch_count=1), "NOT_IMPLEMENTED - prefetch_size!=0 (10)"),
    (lambda ch: ch.basic_recover(requeue=False), "NOT_IMPLEMENTED - requeue=false"),
    (lambda ch: ch.flow(active=False), "NOT_IMPLEMENTED - active=false"),
])
async def test_unimplemented_options_close_the_connection_with_540(amqp_broker_url, method, text):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        with pytest.raises(ConnectionNotImplemented) as raised:
            await method(channel)
        assert raised.value.args[0] == text
    finally:
        await conn.close()


async def test_consumer_priorities(amqp_broker_url):
    """https://www.rabbitmq.com/docs/consumer-priority: a lower-priority consumer gets messages
    only while every higher-priority one is blocked (here: its prefetch window is full)."""
    conn = await aiormq.connect(amqp_broker_url)
    try:
        setup = await conn.channel()
        queue = (await setup.queue_declare("", exclusive=True)).queue
        high, low = await conn.channel(), await conn.channel()
        await high.basic_qos(prefetch_count=4)
        await low.basic_qos(prefetch_count=100)
        got: dict[str, list[bytes]] = {"high": [], "low": []}

        async def to(name: str, message: aiormq.abc.DeliveredMessage) -> None:
            got[name].append(message.body)

        await low.basic_consume(queue, lambda m: to("low", m), arguments={"x-priority": 1})
        await high.basic_consume(queue, lambda m: to("high", m), arguments={"x-priority": 10})
        for i in range(10):
            await setup.basic_publish(b"%d" % i, routing_key=queue)
        for _ in range(500):
            if len(got["high"]) + len(got["low"]) == 10:
                break
            await asyncio.sleep(0.01)
        assert got["high"] == [b"0", b"1", b"2", b"3"]
        assert got["low"] == [b"%d" % i for i in range(4, 10)]
    finally:
        await conn.close()
