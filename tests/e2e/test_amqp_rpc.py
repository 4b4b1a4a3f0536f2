"""Direct reply-to (https://www.rabbitmq.com/docs/direct-reply-to), the pseudo-queue
`amq.rabbitmq.reply-to` that RPC clients consume in no-ack mode; runs against Shardgate and a
real RabbitMQ node.
"""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import aiormq
import pika
import pytest
from aiormq.exceptions import ChannelPreconditionFailed

REPLY_TO = "amq.rabbitmq.reply-to"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def ignore(message: object) -> None:
    """A consumer that does nothing with what it gets."""


async def test_rpc_round_trip_over_direct_reply_to(amqp_broker_url):
    async with await aio_pika.connect(amqp_broker_url) as server_conn, \
            await aio_pika.connect(amqp_broker_url) as client_conn:
        server = await server_conn.channel()
        requests = await server.declare_queue(unique("rpc"), auto_delete=True)
        seen_reply_to: list[str] = []

        async def handle(request: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with request.process():
                seen_reply_to.append(request.reply_to)
                await server.default_exchange.publish(
                    aio_pika.Message(request.body.upper(), correlation_id=request.correlation_id),
                    request.reply_to,
                )

        await requests.consume(handle)

        client = await client_conn.channel()
        replies = await client.get_queue(REPLY_TO)  # passive declare answers declare-ok
        answers: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        await replies.consume(answers.put, no_ack=True)
        for word in (b"ping", b"pong"):
            await client.default_exchange.publish(
                aio_pika.Message(word, reply_to=REPLY_TO, correlation_id=word.decode()), requests.name
            )
            answer = await asyncio.wait_for(answers.get(), 5)
            assert (answer.body, answer.correlation_id) == (word.upper(), word.decode())
            assert answer.exchange == "" and answer.routing_key == seen_reply_to[-1]
        # The server saw a per-channel reply address, not the pseudo-queue's name.
        assert seen_reply_to[0].startswith(REPLY_TO + ".") and seen_reply_to[0] == seen_reply_to[1]


async def test_direct_reply_to_errors(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        with pytest.raises(ChannelPreconditionFailed, match="reply consumer cannot acknowledge"):
            await channel.basic_consume(REPLY_TO, ignore, no_ack=False)
        channel = await conn.channel()
        with pytest.raises(ChannelPreconditionFailed, match="fast reply consumer does not exist"):
            await channel.basic_publish(
                b"x", routing_key=unique("q"),
                properties=aiormq.spec.Basic.Properties(reply_to=REPLY_TO),
            )
        channel = await conn.channel()
        await channel.basic_consume(REPLY_TO, ignore, no_ack=True)
        with pytest.raises(ChannelPreconditionFailed, match="reply consumer already set"):
            await channel.basic_consume(REPLY_TO, ignore, no_ack=True)
    finally:
        await conn.close()


async def test_mandatory_reply_is_delivered_and_also_returned(amqp_broker_url):
    """RabbitMQ 3.x delivers a reply outside its queues, so a mandatory publish to a reply
    address comes back as basic.return 312 NO_ROUTE even though the reply was delivered, and a
    publish to an unknown reply address is returned too."""
    conn = await aiormq.connect(amqp_broker_url)
    try:
        client = await conn.channel()
        got: asyncio.Queue[aiormq.abc.DeliveredMessage] = asyncio.Queue()
        await client.basic_consume(REPLY_TO, got.put, no_ack=True)
        queue = (await client.queue_declare("", exclusive=True)).queue
        await client.basic_publish(
            b"req", routing_key=queue, properties=aiormq.spec.Basic.Properties(reply_to=REPLY_TO)
        )
        request = await client.basic_get(queue, no_ack=True)
        address = request.header.properties.reply_to
        responder = await conn.channel()
        with pytest.raises(aiormq.exceptions.PublishError) as returned:
            await responder.basic_publish(b"resp", routing_key=address, mandatory=True)
        assert returned.value.message.delivery.reply_code == 312
        assert (await asyncio.wait_for(got.get(), 5)).body == b"resp"
        with pytest.raises(aiormq.exceptions.PublishError):
            await responder.basic_publish(b"lost", routing_key=REPLY_TO + ".unknown", mandatory=True)
        ok = await responder.basic_publish(b"lost", routing_key=REPLY_TO + ".unknown")
        assert isinstance(ok, aiormq.spec.Basic.Ack)
    finally:
        await conn.close()


def test_pika_direct_reply_to(amqp_broker_url):
    port = int(amqp_broker_url.rsplit(":", 1)[1].strip("/"))
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", port, credentials=pika.PlainCredentials("guest", "guest")
    ))
    try:
        channel = conn.channel()
        replies: list[bytes] = []
        channel.basic_consume(REPLY_TO, lambda ch, m, p, body: replies.append(body), auto_ack=True)
        queue = channel.queue_declare(unique("pika-rpc"), exclusive=True).method.queue
        channel.basic_publish("", queue, b"question", pika.BasicProperties(reply_to=REPLY_TO))
        method, props, body = channel.basic_get(queue, auto_ack=True)
        channel.basic_publish("", props.reply_to, b"answer")
        for _ in range(100):  # up to 5 s, returning as soon as the reply is in
            conn.process_data_events(0.05)
            if replies:
                break
        assert replies == [b"answer"]
    finally:
        conn.close()
