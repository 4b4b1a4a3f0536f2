"""Exchange-to-exchange bindings (https://www.rabbitmq.com/docs/e2e): exchange.bind /
exchange.unbind, routing through chains of exchanges of every type, loops (each queue still
gets a message once: rabbit_exchange:route/2 visits every exchange once per message), and the
default exchange refused. Each test runs against Shardgate and a real RabbitMQ node.
"""

from __future__ import annotations

import uuid

import aio_pika
import aiormq
import pytest
from aio_pika import ExchangeType
from aiormq.exceptions import ChannelAccessRefused, ChannelNotFoundEntity


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def bodies(queue: aio_pika.abc.AbstractQueue) -> list[bytes]:
    out = []
    while True:
        message = await queue.get(no_ack=True, fail=False)
        if message is None:
            return out
        out.append(message.body)


async def settle(channel: aio_pika.abc.AbstractChannel) -> None:
    """Publisher confirms are on: a confirmed publish has been routed; one more round trip."""
    await channel.set_qos(prefetch_count=0)


async def test_chain_of_exchanges_routes_by_each_binding(amqp_broker_url):
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel()
        source = await channel.declare_exchange(unique("src"), ExchangeType.TOPIC, auto_delete=True)
        middle = await channel.declare_exchange(unique("mid"), ExchangeType.DIRECT, auto_delete=True)
        fan = await channel.declare_exchange(unique("fan"), ExchangeType.FANOUT, auto_delete=True)
        await middle.bind(source, "orders.*")
        await fan.bind(middle, "orders.eu")
        eu = await channel.declare_queue(unique("eu"), exclusive=True)
        await eu.bind(fan)
        any_order = await channel.declare_queue(unique("any"), exclusive=True)
        await any_order.bind(middle, "orders.us")
        for key in ("orders.eu", "orders.us", "orders.eu.x", "payments.eu"):
            await source.publish(aio_pika.Message(key.encode()), key)
        await settle(channel)
        assert await bodies(eu) == [b"orders.eu"]
        assert await bodies(any_order) == [b"orders.us"]
        # The delivery reports the exchange the message was published to.
        await source.publish(aio_pika.Message(b"again"), "orders.eu")
        message = await eu.get(no_ack=True, timeout=5)
        assert (message.exchange, message.routing_key) == (source.name, "orders.eu")
        # Unbinding cuts the route.
        await fan.unbind(middle, "orders.eu")
        await source.publish(aio_pika.Message(b"gone"), "orders.eu")
        await settle(channel)
        assert await bodies(eu) == []


async def test_headers_exchange_as_a_destination(amqp_broker_url):
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel()
        source = await channel.declare_exchange(unique("in"), ExchangeType.FANOUT, auto_delete=True)
        by_headers = await channel.declare_exchange(unique("hdr"), ExchangeType.HEADERS, auto_delete=True)
        await by_headers.bind(source)
        queue = await channel.declare_queue(unique("red"), exclusive=True)
        await queue.bind(by_headers, arguments={"x-match": "all", "colour": "red"})
        await source.publish(aio_pika.Message(b"r", headers={"colour": "red"}), "")
        await source.publish(aio_pika.Message(b"b", headers={"colour": "blue"}), "")
        await settle(channel)
        assert await bodies(queue) == [b"r"]


async def test_loops_deliver_once_per_queue(amqp_broker_url):
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel()
        a = await channel.declare_exchange(unique("a"), ExchangeType.FANOUT, auto_delete=True)
        b = await channel.declare_exchange(unique("b"), ExchangeType.FANOUT, auto_delete=True)
        await b.bind(a)
        await a.bind(b)
        queue = await channel.declare_queue(unique("loop"), exclusive=True)
        await queue.bind(a)
        await queue.bind(b)
        await a.publish(aio_pika.Message(b"once"), "k")
        await b.publish(aio_pika.Message(b"twice?"), "k")
        await settle(channel)
        assert await bodies(queue) == [b"once", b"twice?"]


async def test_mandatory_publish_routed_through_an_exchange_binding_is_not_returned(amqp_broker_url):
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel(on_return_raises=True)
        source = await channel.declare_exchange(unique("m-src"), ExchangeType.DIRECT, auto_delete=True)
        sink = await channel.declare_exchange(unique("m-dst"), ExchangeType.FANOUT, auto_delete=True)
        await sink.bind(source, "k")
        queue = await channel.declare_queue(unique("m-q"), exclusive=True)
        await queue.bind(sink)
        await source.publish(aio_pika.Message(b"routed"), "k", mandatory=True)
        with pytest.raises(aio_pika.exceptions.DeliveryError):
            await source.publish(aio_pika.Message(b"unrouted"), "other", mandatory=True)
        assert await bodies(queue) == [b"routed"]


async def test_exchange_bind_errors(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        missing = unique("nope")
        for destination, source, error, text in (
            ("", "amq.direct", ChannelAccessRefused,
             "ACCESS_REFUSED - operation not permitted on the default exchange"),
            ("amq.direct", "", ChannelAccessRefused,
             "ACCESS_REFUSED - operation not permitted on the default exchange"),
            (missing, "amq.direct", ChannelNotFoundEntity, f"NOT_FOUND - no exchange '{missing}' in vhost '/'"),
            ("amq.direct", missing, ChannelNotFoundEntity, f"NOT_FOUND - no exchange '{missing}' in vhost '/'"),
        ):
            channel = await conn.channel()
            with pytest.raises(error) as raised:
                await channel.exchange_bind(destination, source, "k")
            assert raised.value.args[0] == text
        channel = await conn.channel()
        # Unbinding what was never bound is fine.
        await channel.exchange_unbind("amq.fanout", "amq.direct", unique("k"))
        assert not channel.is_closed
    finally:
        await conn.close()


async def test_auto_delete_source_goes_with_its_last_exchange_binding(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        source, destination = unique("ad-src"), unique("ad-dst")
        await channel.exchange_declare(source, exchange_type="fanout", auto_delete=True)
        await channel.exchange_declare(destination, exchange_type="fanout", auto_delete=True)
        await channel.exchange_bind(destination, source, "")
        await channel.exchange_unbind(destination, source, "")
        with pytest.raises(ChannelNotFoundEntity):
            await channel.exchange_declare(source, passive=True)
    finally:
        await conn.close()
