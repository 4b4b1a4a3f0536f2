"""Channel limits and access errors with RabbitMQ's exact reply codes and texts.

Each test runs against Shardgate and a real RabbitMQ node (`amqp_broker_url`). Sources:
rabbit_reader:create_channel/2 (530 once the open channels reach channel_max, whatever their
numbers), rabbit_channel check_not_default_exchange/1 (403 on the default exchange),
rabbit_amqqueue check_exclusive_access/2 (405 on another connection's exclusive queue),
rabbit_channel basic.consume (403 "in exclusive use").
"""

from __future__ import annotations

import uuid

import aio_pika
import aiormq
import pika
import pytest
from aiormq.exceptions import ChannelAccessRefused, ChannelLockedResource, ChannelNotFoundEntity

LOCKED = (
    "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue '{}' in vhost '/'. It could "
    "be originally declared on another connection or the exclusive property value does not match "
    "that of the original declaration."
)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def ignore(message: object) -> None:
    """A consumer that does nothing with what it gets."""


def pika_params(url: str, **kwargs) -> pika.ConnectionParameters:
    port = int(url.rsplit(":", 1)[1].strip("/"))
    return pika.ConnectionParameters(
        "127.0.0.1", port, credentials=pika.PlainCredentials("guest", "guest"), **kwargs
    )


def test_any_channel_number_while_the_count_stays_within_channel_max(amqp_broker_url):
    conn = pika.BlockingConnection(pika_params(amqp_broker_url, channel_max=5))
    try:
        conn.channel(6)  # numbers above channel_max are fine
        conn.channel(65535)
        for number in (1, 2, 3):
            conn.channel(number)
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
            conn.channel(7)
        assert closed.value.reply_code == 530
        assert closed.value.reply_text == (
            "NOT_ALLOWED - number of channels opened (5) has reached the negotiated channel_max (5)"
        )
    finally:
        if conn.is_open:
            conn.close()


async def test_channel_number_reusable_right_after_an_error_close(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel(channel_number=7)
        with pytest.raises(ChannelNotFoundEntity):
            await channel.queue_declare(unique("missing"), passive=True)
        again = await conn.channel(channel_number=7)
        ok = await again.queue_declare(unique("fresh"), exclusive=True)
        assert ok.message_count == 0
    finally:
        await conn.close()


async def test_default_exchange_cannot_be_declared_passively_or_deleted(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        for attempt in (
            lambda ch: ch.exchange_declare("", passive=True),
            lambda ch: ch.exchange_declare("", exchange_type="direct"),
            lambda ch: ch.exchange_delete(""),
        ):
            channel = await conn.channel()
            with pytest.raises(ChannelAccessRefused) as refused:
                await attempt(channel)
            assert refused.value.args[0] == (
                "ACCESS_REFUSED - operation not permitted on the default exchange"
            )
        channel = await conn.channel()
        with pytest.raises(ChannelAccessRefused) as refused:
            await channel.exchange_delete("amq.direct")
        assert refused.value.args[0] == (
            "ACCESS_REFUSED - deletion of system exchange 'amq.direct' in vhost '/' not allowed"
        )
        channel = await conn.channel()
        with pytest.raises(ChannelNotFoundEntity) as missing:
            await channel.exchange_declare("amq.default", passive=True)
        assert missing.value.args[0] == "NOT_FOUND - no exchange 'amq.default' in vhost '/'"
    finally:
        await conn.close()


async def test_exclusive_queue_from_another_connection_is_405(amqp_broker_url):
    owner = await aiormq.connect(amqp_broker_url)
    other = await aiormq.connect(amqp_broker_url)
    try:
        name = (await (await owner.channel()).queue_declare(unique("mine"), exclusive=True)).queue
        for attempt in (
            lambda ch: ch.queue_declare(name, passive=True),
            lambda ch: ch.queue_declare(name, exclusive=True),
            lambda ch: ch.basic_consume(name, ignore),
            lambda ch: ch.basic_get(name),
            lambda ch: ch.queue_purge(name),
            lambda ch: ch.queue_delete(name),
            lambda ch: ch.queue_bind(name, "amq.direct", "k"),
        ):
            channel = await other.channel()
            with pytest.raises(ChannelLockedResource) as locked:
                await attempt(channel)
            assert locked.value.args[0] == LOCKED.format(name)  # aiormq maps 405 to this class
    finally:
        await other.close()
        await owner.close()


async def test_exclusive_consumer_on_a_queue_with_consumers_is_403(amqp_broker_url):
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue(unique("shared"), auto_delete=True)
        await queue.consume(ignore)
        second = await conn.channel()
        queue2 = await second.get_queue(queue.name)
        with pytest.raises(ChannelAccessRefused) as refused:
            await queue2.consume(ignore, exclusive=True)
        assert refused.value.args[0] == (
            f"ACCESS_REFUSED - queue '{queue.name}' in vhost '/' in exclusive use"
        )
        # And the other way round: a consumer on a queue with an exclusive consumer.
        held = await channel.declare_queue(unique("held"), auto_delete=True)
        await held.consume(ignore, exclusive=True)
        third = await conn.channel()
        held3 = await third.get_queue(held.name)
        with pytest.raises(ChannelAccessRefused) as refused:
            await held3.consume(ignore)
        assert "in exclusive use" in refused.value.args[0]  # 403, mapped by aiormq
