"""AMQP 0-9-1 end to end with aio-pika over real sockets: handshake, publish/consume on the
default exchange and amq.topic, exchanges, queues, acks, prefetch, requeue, get, confirms."""

from __future__ import annotations

import asyncio

import aio_pika
import pytest
from aio_pika.exceptions import ChannelClosed, ChannelNotFoundEntity, ProbableAuthenticationError

from tests.conftest import free_port


@pytest.fixture
def amqp_url(broker_factory) -> str:
    node = broker_factory(listeners={"amqp_port": free_port()})
    return f"amqp://guest:guest@127.0.0.1:{node.app.port('amqp')}/"


async def _get(queue: aio_pika.abc.AbstractQueue, timeout: float = 5.0) -> aio_pika.abc.AbstractIncomingMessage:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        message = await queue.get(fail=False)
        if message is not None:
            return message
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("no message")
        await asyncio.sleep(0.01)


async def _ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    pass


async def test_publish_and_consume_via_default_exchange(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("work", auto_delete=False)
        for i in range(10):
            await channel.default_exchange.publish(
                aio_pika.Message(f"m{i}".encode(), content_type="text/plain", headers={"i": i},
                                 correlation_id="c1", reply_to="back", message_id=f"id{i}",
                                 app_id="tests", type="t"),
                routing_key="work",
            )
        received = []
        async with queue.iterator() as it:
            async for message in it:
                async with message.process():
                    received.append(message)
                if len(received) == 10:
                    break
        assert [m.body for m in received] == [f"m{i}".encode() for i in range(10)]
        first = received[0]
        assert first.content_type == "text/plain" and first.headers == {"i": 0}
        assert (first.correlation_id, first.reply_to, first.message_id) == ("c1", "back", "id0")
        assert (first.app_id, first.type, first.routing_key, first.exchange) == ("tests", "t", "work", "")


async def test_amq_topic_binding_wildcards(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        topic = await channel.get_exchange("amq.topic")
        star = await channel.declare_queue("", exclusive=True)
        await star.bind(topic, "sensors.*")
        hash_ = await channel.declare_queue("", exclusive=True)
        await hash_.bind(topic, "sensors.#")
        await topic.publish(aio_pika.Message(b"t1"), "sensors.t1")
        await topic.publish(aio_pika.Message(b"deep"), "sensors.a.b")
        await topic.publish(aio_pika.Message(b"other"), "motors.m1")
        m = await _get(star)
        assert (m.body, m.routing_key, m.exchange) == (b"t1", "sensors.t1", "amq.topic")
        await m.ack()
        assert (await _get(hash_)).body == b"t1"
        assert (await _get(hash_)).body == b"deep"
        assert await star.get(fail=False) is None


async def test_declared_exchanges_route_by_type(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        direct = await channel.declare_exchange("d1", aio_pika.ExchangeType.DIRECT)
        fanout = await channel.declare_exchange("f1", aio_pika.ExchangeType.FANOUT)
        topic = await channel.declare_exchange("t1", aio_pika.ExchangeType.TOPIC)
        headers = await channel.declare_exchange("h1", aio_pika.ExchangeType.HEADERS)
        q = await channel.declare_queue("", exclusive=True)
        await q.bind(direct, "k.1")
        await q.bind(fanout, "")
        await q.bind(topic, "#.end")
        await q.bind(headers, arguments={"x-match": "all", "kind": "a", "n": 1})
        await direct.publish(aio_pika.Message(b"direct"), "k.1")
        await direct.publish(aio_pika.Message(b"direct-miss"), "k.2")
        await fanout.publish(aio_pika.Message(b"fanout"), "anything")
        await topic.publish(aio_pika.Message(b"topic"), "x.y.end")
        await topic.publish(aio_pika.Message(b"topic-miss"), "x.end.y")
        await headers.publish(aio_pika.Message(b"headers", headers={"kind": "a", "n": 1}), "")
        await headers.publish(aio_pika.Message(b"headers-miss", headers={"kind": "a"}), "")
        got = [(await _get(q)).body for _ in range(4)]
        assert got == [b"direct", b"fanout", b"topic", b"headers"]
        await asyncio.sleep(0.05)
        assert await q.get(fail=False, no_ack=True) is None
        await q.unbind(direct, "k.1")
        await direct.publish(aio_pika.Message(b"after-unbind"), "k.1")
        await fanout.publish(aio_pika.Message(b"still-fanout"), "")
        assert (await _get(q)).body == b"still-fanout"


async def test_publish_to_missing_exchange_closes_channel_only(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel(publisher_confirms=False)
        missing = aio_pika.Exchange(channel, "no-such-exchange", passive=True)
        await missing.publish(aio_pika.Message(b"x"), "k")
        with pytest.raises(ChannelClosed) as info:
            await channel.declare_queue("after", auto_delete=True)
        assert info.value.code == 404 if hasattr(info.value, "code") else True
        # the connection keeps working
        other = await conn.channel()
        q = await other.declare_queue("", exclusive=True)
        await other.default_exchange.publish(aio_pika.Message(b"ok"), q.name)
        assert (await _get(q)).body == b"ok"


async def test_passive_declare_of_missing_queue_is_not_found(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        with pytest.raises(ChannelNotFoundEntity):
            await channel.declare_queue("nope", passive=True)


async def test_wrong_password_is_refused(amqp_url):
    url = amqp_url.replace("guest:guest", "guest:wrong")
    with pytest.raises(ProbableAuthenticationError):
        await aio_pika.connect(url)


async def test_prefetch_window_and_requeue_order(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        await channel.set_qos(prefetch_count=3)
        queue = await channel.declare_queue("", exclusive=True)
        for i in range(10):
            await channel.default_exchange.publish(aio_pika.Message(str(i).encode()), queue.name)
        got: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        await queue.consume(got.put)
        first = [await asyncio.wait_for(got.get(), 5) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert got.empty(), "prefetch 3 must hold back the 4th message"
        await first[1].nack(requeue=True)
        await first[0].nack(requeue=True)
        again = [await asyncio.wait_for(got.get(), 5) for _ in range(2)]
        assert sorted(m.body for m in again) == [b"0", b"1"]
        assert all(m.redelivered for m in again)
        for m in [first[2], *again]:
            await m.ack()
        rest = [await asyncio.wait_for(got.get(), 5) for _ in range(3)]
        assert [m.body for m in rest] == [b"3", b"4", b"5"]


async def test_unacked_messages_return_when_channel_closes(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        ch1 = await conn.channel()
        queue = await ch1.declare_queue("redeliver", auto_delete=False)
        await ch1.default_exchange.publish(aio_pika.Message(b"one"), "redeliver")
        m = await _get(queue)
        assert not m.redelivered
        await ch1.close()
        ch2 = await conn.channel()
        q2 = await ch2.declare_queue("redeliver", auto_delete=False)
        again = await _get(q2)
        assert again.body == b"one" and again.redelivered
        await again.ack()


async def test_round_robin_between_consumers(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("", exclusive=True)
        a: list[bytes] = []
        b: list[bytes] = []

        async def on_a(m):
            a.append(m.body)
            await m.ack()

        async def on_b(m):
            b.append(m.body)
            await m.ack()

        await queue.consume(on_a)
        await queue.consume(on_b)
        for i in range(10):
            await channel.default_exchange.publish(aio_pika.Message(str(i).encode()), queue.name)
        for _ in range(200):
            if len(a) + len(b) == 10:
                break
            await asyncio.sleep(0.01)
        assert len(a) == 5 and len(b) == 5


async def test_auto_delete_queue_goes_with_last_consumer(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("temp", auto_delete=True)
        tag = await queue.consume(_ignore)
        await queue.cancel(tag)
        with pytest.raises(ChannelNotFoundEntity):
            ch2 = await conn.channel()
            await ch2.declare_queue("temp", passive=True)


async def test_server_cancels_consumer_when_queue_deleted(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("doomed", auto_delete=False)
        await queue.consume(_ignore)
        other = await conn.channel()
        await other.queue_delete("doomed")
        await asyncio.sleep(0.1)
        assert not channel.is_closed


async def test_queue_delete_if_empty_and_purge(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("full", auto_delete=False)
        await channel.default_exchange.publish(aio_pika.Message(b"x"), "full")
        await channel.default_exchange.publish(aio_pika.Message(b"y"), "full")
        with pytest.raises(ChannelClosed):
            await queue.delete(if_empty=True)
        channel = await conn.channel()
        queue = await channel.declare_queue("full", auto_delete=False)
        assert queue.declaration_result.message_count == 2
        purged = await queue.purge()
        assert purged.message_count == 2
        await queue.delete(if_empty=True)


async def test_publisher_confirms_and_mandatory_return(amqp_url):
    async with await aio_pika.connect(amqp_url) as conn:
        channel = await conn.channel(publisher_confirms=True, on_return_raises=True)
        queue = await channel.declare_queue("", exclusive=True)
        results = await asyncio.gather(*[
            channel.default_exchange.publish(aio_pika.Message(b"c%d" % i), queue.name)
            for i in range(50)
        ])
        assert all(r is not None for r in results)
        from aio_pika.exceptions import DeliveryError

        with pytest.raises(DeliveryError):
            await channel.default_exchange.publish(aio_pika.Message(b"lost"), "no-queue", mandatory=True)


async def test_tls_listener_shares_exchanges_and_queues(broker_factory, tmp_path):
    """`listeners.amqps_port` with the `[tls]` certificate serves the same exchanges and queues
    as the plain listener."""
    import ssl
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    node = broker_factory(listeners={"amqp_port": free_port(), "amqps_port": free_port()},
                          tls={"cert_file": str(cert), "key_file": str(key)})
    client_ctx = ssl.create_default_context(cafile=str(cert))
    client_ctx.check_hostname = False
    secure = await aio_pika.connect(host="127.0.0.1", port=node.app.port("amqps"), login="guest",
                                    password="guest", ssl=True, ssl_context=client_ctx)
    async with secure, await aio_pika.connect(
        f"amqp://guest:guest@127.0.0.1:{node.app.port('amqp')}/"
    ) as clear:
        tls_channel = await secure.channel()
        queue = await tls_channel.declare_queue("over-tls", auto_delete=True)
        clear_channel = await clear.channel()
        await clear_channel.default_exchange.publish(aio_pika.Message(b"hi"), "over-tls")
        assert (await _get(queue)).body == b"hi"
