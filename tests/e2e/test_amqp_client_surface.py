"""What aio-pika, aiormq and pika programs use day to day, with RabbitMQ's answers: queue
iterators, basic.get with and without acks, purge, delete with if-unused / if-empty, consumer
cancel notifications, basic.qos per consumer and per channel, bodies split at frame-max,
heartbeats, pika's blocking and select connections, and robust connections restoring their
topology. Each test runs against Shardgate and a real RabbitMQ node unless it says otherwise.
"""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import aiormq
import pika
import pytest
from aiormq.exceptions import ChannelPreconditionFailed

from tests.conftest import free_port


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def ignore(message: object) -> None:
    """A consumer that does nothing with what it gets."""


def pika_params(url: str, **kwargs) -> pika.ConnectionParameters:
    port = int(url.rsplit(":", 1)[1].strip("/"))
    return pika.ConnectionParameters(
        "127.0.0.1", port, credentials=pika.PlainCredentials("guest", "guest"), **kwargs
    )


async def test_queue_iterator_get_no_ack_and_purge(amqp_broker_url):
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue(unique("iter"), exclusive=True)
        for i in range(5):
            await channel.default_exchange.publish(aio_pika.Message(b"%d" % i), queue.name)
        first = await queue.get(no_ack=True)
        assert first.body == b"0"
        seen = []
        async with queue.iterator() as messages:
            async for message in messages:
                async with message.process():
                    seen.append(message.body)
                if len(seen) == 2:
                    break
        assert seen == [b"1", b"2"]
        purged = await queue.purge()
        assert purged.message_count == 2
        assert await queue.get(fail=False) is None


async def test_basic_get_reports_the_messages_left(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        queue = (await channel.queue_declare("", exclusive=True)).queue
        for body in (b"a", b"b", b"c"):
            await channel.basic_publish(body, routing_key=queue)
        got = await channel.basic_get(queue, no_ack=False)
        assert (got.body, got.delivery.message_count, got.delivery.redelivered) == (b"a", 2, False)
        await channel.basic_reject(got.delivery.delivery_tag, requeue=True)
        again = await channel.basic_get(queue, no_ack=True)
        assert (again.body, again.delivery.message_count, again.delivery.redelivered) == (b"a", 2, True)
    finally:
        await conn.close()


async def test_delete_if_unused_and_if_empty(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        queue = (await channel.queue_declare("", exclusive=True)).queue
        await channel.basic_publish(b"x", routing_key=queue)
        with pytest.raises(ChannelPreconditionFailed) as failed:
            await channel.queue_delete(queue, if_empty=True)
        assert failed.value.args[0] == f"PRECONDITION_FAILED - queue '{queue}' in vhost '/' not empty"
        channel = await conn.channel()
        await channel.basic_consume(queue, ignore)
        with pytest.raises(ChannelPreconditionFailed) as failed:
            await channel.queue_delete(queue, if_unused=True)
        assert failed.value.args[0] == f"PRECONDITION_FAILED - queue '{queue}' in vhost '/' in use"
        exchange = unique("in-use")
        channel = await conn.channel()
        await channel.exchange_declare(exchange, exchange_type="fanout")
        await channel.queue_bind(queue, exchange)
        with pytest.raises(ChannelPreconditionFailed) as failed:
            await channel.exchange_delete(exchange, if_unused=True)
        assert failed.value.args[0] == f"PRECONDITION_FAILED - exchange '{exchange}' in vhost '/' in use"
        channel = await conn.channel()
        await channel.exchange_delete(exchange)
        deleted = await channel.queue_delete(queue)
        assert deleted.message_count == 1
    finally:
        await conn.close()


async def test_consumer_cancel_notification_when_the_queue_is_deleted(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        consumer_channel = await conn.channel()
        queue = (await consumer_channel.queue_declare(unique("doomed"), auto_delete=False)).queue
        ok = await consumer_channel.basic_consume(queue, ignore)
        assert ok.consumer_tag in consumer_channel.consumers
        other = await conn.channel()
        await other.queue_delete(queue)
        # basic.cancel from the server: aiormq forgets the consumer, the channel stays open.
        for _ in range(500):
            if ok.consumer_tag not in consumer_channel.consumers:
                break
            await asyncio.sleep(0.01)
        assert ok.consumer_tag not in consumer_channel.consumers
        assert not consumer_channel.is_closed
    finally:
        await conn.close()


async def count_deliveries(amqp_broker_url: str, global_: bool, prefetch: int, expected: int) -> int:
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel()
        queues = []
        for _ in range(2):
            queue = await channel.declare_queue(unique("qos"), exclusive=True)
            for i in range(5):
                await channel.default_exchange.publish(aio_pika.Message(b"%d" % i), queue.name)
            queues.append(queue)
        consumer = await conn.channel()
        await consumer.set_qos(prefetch_count=prefetch, global_=global_)
        received: list[bytes] = []
        for queue in queues:
            mine = await consumer.get_queue(queue.name)
            async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                received.append(message.body)

            await mine.consume(take)
        for _ in range(500):  # the window fills up ...
            if len(received) >= expected:
                break
            await asyncio.sleep(0.01)
        # ... and nothing beyond it comes, round trips later.
        for _ in range(3):
            await consumer.set_qos(prefetch_count=prefetch, global_=global_)
            await channel.declare_queue(queues[0].name, passive=True)
        return len(received)


async def test_basic_qos_per_consumer_and_per_channel(amqp_broker_url):
    """https://www.rabbitmq.com/docs/consumer-prefetch: global=false limits each consumer,
    global=true the whole channel."""
    assert await count_deliveries(amqp_broker_url, global_=False, prefetch=2, expected=4) == 4
    assert await count_deliveries(amqp_broker_url, global_=True, prefetch=3, expected=3) == 3


def test_large_body_split_at_a_small_frame_max(amqp_broker_url):
    body = bytes(range(256)) * 4096  # 1 MiB over 4 KiB frames
    conn = pika.BlockingConnection(pika_params(amqp_broker_url, frame_max=4096))
    try:
        channel = conn.channel()
        queue = channel.queue_declare("", exclusive=True).method.queue
        channel.basic_publish("", queue, body)
        method, _, received = channel.basic_get(queue, auto_ack=True)
        assert method is not None and received == body
    finally:
        conn.close()


async def test_large_body_with_aio_pika(amqp_broker_url):
    body = b"x" * (3 * 1024 * 1024 + 17)
    async with await aio_pika.connect(amqp_broker_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue(unique("big"), exclusive=True)
        await channel.default_exchange.publish(aio_pika.Message(body), queue.name)
        message = await queue.get(no_ack=True, timeout=10)
        assert message.body == body


def test_pika_heartbeats_keep_an_idle_connection_open(amqp_broker_url):
    conn = pika.BlockingConnection(pika_params(amqp_broker_url, heartbeat=1))
    try:
        assert conn._impl.params.heartbeat == 1
        checker = conn._impl._heartbeat_checker
        conn.process_data_events(time_limit=3.5)  # idle for more than two heartbeat intervals
        assert conn.is_open and checker.bytes_received_on_connection > 0
        channel = conn.channel()
        assert channel.queue_declare("", exclusive=True).method.message_count == 0
    finally:
        conn.close()


def test_pika_select_connection_round_trip(amqp_broker_url):
    result: dict[str, object] = {}
    queue_name = unique("select")

    def on_open(connection: pika.SelectConnection) -> None:
        connection.channel(on_open_callback=on_channel)

    def on_channel(channel) -> None:
        channel.queue_declare(queue_name, exclusive=True, callback=lambda _: declared(channel))

    def declared(channel) -> None:
        channel.basic_consume(queue_name, lambda ch, method, props, body: got(ch, method, body))
        channel.basic_publish("", queue_name, b"via select", pika.BasicProperties(content_type="text/plain"))

    def got(channel, method, body) -> None:
        channel.basic_ack(method.delivery_tag)
        result["body"] = body
        channel.connection.close()

    conn = pika.SelectConnection(
        pika_params(amqp_broker_url), on_open_callback=on_open,
        on_open_error_callback=lambda c, e: result.setdefault("error", e),
        on_close_callback=lambda c, e: c.ioloop.stop(),
    )
    timer = conn.ioloop.call_later(10, conn.ioloop.stop)
    conn.ioloop.start()
    conn.ioloop.remove_timeout(timer)
    assert result == {"body": b"via select"}


async def test_robust_connection_restores_its_topology_after_a_forced_close(broker_factory):
    """Shardgate only: the server closes the connection (320 CONNECTION_FORCED, as an operator
    or a restart would); aio-pika's robust connection reconnects and redeclares its exchange,
    queue, binding and consumer."""
    node = broker_factory(listeners={"amqp_port": free_port()})
    url = f"amqp://guest:guest@127.0.0.1:{node.app.port('amqp')}/"
    conn = await aio_pika.connect_robust(url, reconnect_interval=0.1)
    try:
        channel = await conn.channel()
        exchange = await channel.declare_exchange("robust-x", aio_pika.ExchangeType.DIRECT)
        queue = await channel.declare_queue("robust-q", auto_delete=True)
        await queue.bind(exchange, "k")
        inbox: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await message.ack()
            await inbox.put(message.body)

        await queue.consume(on_message)
        await exchange.publish(aio_pika.Message(b"before"), "k")
        assert await asyncio.wait_for(inbox.get(), 5) == b"before"
        reconnected = asyncio.Event()
        conn.reconnect_callbacks.add(lambda *_: reconnected.set())

        def drop_all() -> None:
            service = node.app.listeners["amqp"].server.service
            for connection in list(service.connections):
                connection.shutdown("forced by the test")

        node.loop.call_soon_threadsafe(drop_all)
        await asyncio.wait_for(reconnected.wait(), 10)
        await exchange.publish(aio_pika.Message(b"after"), "k")
        assert await asyncio.wait_for(inbox.get(), 5) == b"after"
    finally:
        await conn.close()
