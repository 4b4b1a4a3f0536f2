"""Publishing as RabbitMQ does it: mandatory returns before the publisher confirm, and
transactions (tx.select / tx.commit / tx.rollback).

Every test runs against Shardgate and against a real RabbitMQ node (`amqp_broker_url`), so the
expectations are RabbitMQ's observable behaviour, not ours.
"""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import aiormq
import pika
import pytest
from aio_pika.exceptions import DeliveryError
from aiormq.exceptions import ChannelPreconditionFailed


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def get_body(queue: aio_pika.abc.AbstractQueue, timeout: float = 5.0) -> bytes:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        message = await queue.get(no_ack=True, fail=False)
        if message is not None:
            return message.body
        if loop.time() > deadline:
            raise AssertionError("no message")
        await asyncio.sleep(0.01)


async def test_unroutable_mandatory_publish_raises_delivery_error_in_confirm_mode(amqp_broker_url):
    """https://www.rabbitmq.com/docs/confirms#server-sent: "If the message is also published as
    mandatory, the basic.return is sent to the client before basic.ack". aio-pika turns a
    return that comes before the confirm into DeliveryError; had the ack come first, the
    publish would have succeeded."""
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel(on_return_raises=True)  # publisher confirms on
        with pytest.raises(DeliveryError) as raised:
            await channel.default_exchange.publish(
                aio_pika.Message(b"lost"), unique("nobody-here"), mandatory=True
            )
        assert raised.value.frame.reply_code == 312
        assert raised.value.frame.reply_text == "NO_ROUTE"
        # The channel stays usable, and a routable mandatory publish is simply confirmed.
        queue = await channel.declare_queue(unique("routable"), exclusive=True)
        await channel.default_exchange.publish(aio_pika.Message(b"ok"), queue.name, mandatory=True)
        assert await get_body(queue) == b"ok"
        # Without on_return_raises the publish yields the returned message instead of the ack.
        quiet = await conn.channel()
        result = await quiet.default_exchange.publish(
            aio_pika.Message(b"back"), unique("nobody-here"), mandatory=True
        )
        assert isinstance(result.delivery, aiormq.spec.Basic.Return) and result.body == b"back"


async def test_return_then_ack_frame_order_with_aiormq(amqp_broker_url):
    """The raw frames: basic.return (312 NO_ROUTE, the exchange and routing key published
    to), its content, then basic.ack for the same publish."""
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        returned: list[aiormq.abc.DeliveredMessage] = []
        channel.on_return_callbacks.add(returned.append)
        key = unique("nowhere")
        with pytest.raises(aiormq.exceptions.PublishError) as raised:
            await channel.basic_publish(b"x", exchange="amq.direct", routing_key=key, mandatory=True)
        frame = raised.value.message.delivery  # the basic.return that settled the publish
        assert (frame.reply_code, frame.exchange, frame.routing_key) == (312, "amq.direct", key)
        # Not mandatory: silently dropped and acked.
        ok = await channel.basic_publish(b"x", exchange="amq.direct", routing_key=key)
        assert isinstance(ok, aiormq.spec.Basic.Ack)
    finally:
        await conn.close()


async def test_transaction_commit_and_rollback_with_aio_pika(amqp_broker_url):
    """Publishes and acks inside a transaction take effect at tx.commit and vanish at
    tx.rollback; a rolled-back ack leaves the delivery unacknowledged
    (https://www.rabbitmq.com/docs/semantics#tx)."""
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel(publisher_confirms=False)
        queue = await channel.declare_queue(unique("tx"), exclusive=True)
        tx = channel.transaction()
        await tx.select()
        await channel.default_exchange.publish(aio_pika.Message(b"rolled-back"), queue.name)
        await tx.rollback()
        await channel.default_exchange.publish(aio_pika.Message(b"one"), queue.name)
        await channel.default_exchange.publish(aio_pika.Message(b"two"), queue.name)
        other = await conn.channel()
        peek = await other.declare_queue(queue.name, passive=True)
        assert peek.declaration_result.message_count == 0  # nothing before the commit
        await tx.commit()
        peek = await other.declare_queue(queue.name, passive=True)
        assert peek.declaration_result.message_count == 2
        first = await queue.get(no_ack=False)
        assert first.body == b"one"
        await first.ack()
        await tx.rollback()  # the ack is undone: "one" is still unacknowledged
        second = await queue.get(no_ack=False)
        assert second.body == b"two"
        await second.ack()
        await tx.commit()  # acks "two" only
        await channel.close()  # "one" goes back to the queue, redelivered
        again = await other.declare_queue(queue.name, passive=True)
        message = await again.get(no_ack=True)
        assert (message.body, message.redelivered) == (b"one", True)


async def test_tx_and_confirm_modes_exclude_each_other(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel(publisher_confirms=True)
        with pytest.raises(ChannelPreconditionFailed, match="cannot switch from confirm to tx mode"):
            await channel.tx_select()
        channel = await conn.channel(publisher_confirms=False)
        await channel.tx_select()
        with pytest.raises(ChannelPreconditionFailed, match="cannot switch from tx to confirm mode"):
            await channel.confirm_delivery()
        channel = await conn.channel(publisher_confirms=False)
        with pytest.raises(ChannelPreconditionFailed, match="channel is not transactional"):
            await channel.tx_commit()
    finally:
        await conn.close()


def pika_connection(url: str) -> pika.BlockingConnection:
    port = int(url.rsplit(":", 1)[1].strip("/"))
    return pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", port, credentials=pika.PlainCredentials("guest", "guest")
    ))


def test_mandatory_publish_in_a_transaction_is_returned_at_commit(amqp_broker_url):
    conn = pika_connection(amqp_broker_url)
    try:
        channel = conn.channel()
        returned: list[bytes] = []
        channel.add_on_return_callback(lambda ch, method, props, body: returned.append(body))
        channel.tx_select()
        channel.basic_publish("", unique("absent"), b"r", mandatory=True)
        channel.basic_qos(prefetch_count=1)  # a round trip: nothing returned before the commit
        conn.process_data_events(0)
        assert returned == []
        channel.tx_commit()
        conn.process_data_events(0)
        assert returned == [b"r"]
    finally:
        conn.close()


def test_pika_blocking_transaction(amqp_broker_url):
    conn = pika_connection(amqp_broker_url)
    try:
        channel = conn.channel()
        queue = channel.queue_declare(unique("pika-tx"), exclusive=True).method.queue
        channel.tx_select()
        channel.basic_publish("", queue, b"a")
        channel.basic_publish("", queue, b"b")
        assert channel.queue_declare(queue, passive=True).method.message_count == 0
        channel.tx_commit()
        assert channel.queue_declare(queue, passive=True).method.message_count == 2
        channel.basic_publish("", queue, b"c")
        channel.tx_rollback()
        bodies = []
        while True:
            method, _, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            bodies.append(body)
        assert bodies == [b"a", b"b"]
    finally:
        conn.close()
