"""Shardgate against RabbitMQ through the client libraries' public API: the same script with
kombu, pika (blocking and select) and aio-pika on both brokers, and what each library reported
(return values, counts, message bodies, properties, headers, delivery info, exception types,
reply codes and texts) must be the same. Complements `test_amqp_differential.py`, which
compares the frames themselves.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import aio_pika
import pika
import pytest
from kombu import Connection, Exchange, Producer, Queue
from kombu import Consumer as KombuConsumer

from tests.conftest import free_port
from tests.e2e.amqp_differential import differences, normalise

SCRIPTS: dict[str, Callable[[str, Callable[[str], str], list[Any]], Any]] = {}


def script(function):
    SCRIPTS[function.__name__] = function
    return function


def error(exc: BaseException) -> tuple[str, Any, Any]:
    """An exception as a comparable triple: type name and, when it has them, code and text."""
    args = getattr(exc, "args", ())
    code = getattr(exc, "reply_code", None) or getattr(exc, "code", None)
    text = getattr(exc, "reply_text", None)
    if code is None and len(args) >= 2 and isinstance(args[0], int):
        code, text = args[0], args[1]
    if text is None and args:
        text = str(args[0])
    return type(exc).__name__, code, text


# ---------------------------------------------------------------------- kombu
@script
def kombu_simple_queue_and_producer(url: str, name: Callable[[str], str], out: list[Any]) -> None:
    with Connection(url) as conn:
        queue = conn.SimpleQueue(name("simple"), queue_opts={"durable": False, "auto_delete": True})
        queue.put({"n": 1}, headers={"h": "v", "i": 7}, priority=3)
        queue.put(b"raw", serializer=None, content_type="application/data")
        for _ in range(2):
            message = queue.get(timeout=5)
            out.append((message.payload, message.headers, message.content_type,
                        message.properties.get("priority"),
                        message.delivery_info["routing_key"], message.delivery_info["exchange"],
                        message.delivery_info["redelivered"]))
            message.ack()
        try:
            queue.get(block=False)
        except queue.Empty as exc:
            out.append(("empty", type(exc).__name__))
        out.append(("qsize", queue.qsize()))
        queue.close()

        exchange = Exchange(name("topic"), type="topic", auto_delete=True)
        target = Queue(name("bound"), exchange, routing_key="a.#", auto_delete=True)
        producer = Producer(conn.default_channel)
        producer.publish({"x": 1}, exchange=exchange, routing_key="a.b", declare=[target],
                         serializer="json", retry=True)
        got: list[Any] = []

        def on_message(body: Any, message: Any) -> None:
            got.append((body, message.delivery_info["routing_key"]))
            message.ack()

        with KombuConsumer(conn.default_channel, [target], callbacks=[on_message]):
            conn.drain_events(timeout=5)
        out.append(got)
        channel = conn.channel()
        try:
            channel.queue_declare(name("missing"), passive=True)
        except Exception as exc:  # noqa: BLE001  (the library's own error is what we compare)
            out.append(error(exc))
        channel = conn.channel()
        channel.queue_declare(name("args"), auto_delete=True, arguments={"x-max-length": 1})
        try:
            channel.queue_declare(name("args"), auto_delete=True, arguments={"x-max-length": 2})
        except Exception as exc:  # noqa: BLE001
            out.append(error(exc))
        channel = conn.channel()
        out.append(tuple(channel.queue_declare(name("args"), passive=True)))
        out.append(channel.queue_delete(name("args")))


# ---------------------------------------------------------------------- pika
@script
def pika_blocking(url: str, name: Callable[[str], str], out: list[Any]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        declared = channel.queue_declare(name("q"), exclusive=True)
        out.append((declared.method.message_count, declared.method.consumer_count))
        channel.confirm_delivery()
        for i in range(3):
            channel.basic_publish("", name("q"), b"m%d" % i, pika.BasicProperties(
                content_type="text/plain", headers={"i": i, "s": "x"}, delivery_mode=2,
            ))
        try:
            channel.basic_publish("", name("nowhere"), b"lost", mandatory=True)
        except Exception as exc:  # noqa: BLE001
            out.append(type(exc).__name__)
        method, properties, body = channel.basic_get(name("q"))
        out.append((method.delivery_tag, method.message_count, method.redelivered, body,
                    properties.headers, properties.content_type, properties.delivery_mode))
        channel.basic_nack(method.delivery_tag, requeue=True)
        seen = []
        for method, _properties, body in channel.consume(name("q"), inactivity_timeout=5):
            if method is None:
                break
            seen.append((body, method.redelivered))
            channel.basic_ack(method.delivery_tag)
            if len(seen) == 3:
                break
        out.append(seen)
        channel.cancel()
        out.append(channel.queue_purge(name("q")).method.message_count)
        try:
            channel.exchange_declare(name("x"), "direct")
            channel.exchange_declare(name("x"), "fanout")
        except pika.exceptions.ChannelClosedByBroker as exc:
            out.append(error(exc))
        channel = connection.channel()
        try:
            channel.basic_ack(42)
            channel.queue_declare(name("after"), exclusive=True)  # the close shows here
        except pika.exceptions.ChannelClosedByBroker as exc:
            out.append(error(exc))
        channel = connection.channel()
        channel.exchange_delete(name("x"))
        try:
            channel.queue_delete(name("q"), if_empty=True)
            out.append("deleted")
        except pika.exceptions.ChannelClosedByBroker as exc:
            out.append(error(exc))
    finally:
        if connection.is_open:
            connection.close()


@script
def pika_select(url: str, name: Callable[[str], str], out: list[Any]) -> None:
    queue = name("select")
    state: dict[str, Any] = {"got": []}

    def on_open(connection: Any) -> None:
        connection.channel(on_open_callback=on_channel)

    def on_channel(channel: Any) -> None:
        state["channel"] = channel
        channel.queue_declare(queue, exclusive=True, callback=on_declared)

    def on_declared(frame: Any) -> None:
        out.append((frame.method.queue == queue, frame.method.message_count))
        channel = state["channel"]
        channel.basic_qos(prefetch_count=1, callback=lambda _: None)
        for i in range(3):
            channel.basic_publish("", queue, b"s%d" % i)
        channel.basic_consume(queue, on_message)

    def on_message(channel: Any, method: Any, properties: Any, body: bytes) -> None:
        state["got"].append((body, method.delivery_tag, method.routing_key))
        channel.basic_ack(method.delivery_tag)
        if len(state["got"]) == 3:
            channel.queue_declare(queue, passive=True, callback=on_counted)

    def on_counted(frame: Any) -> None:
        out.append(("after", frame.method.message_count, frame.method.consumer_count))
        state["connection"].close()

    connection = pika.SelectConnection(pika.URLParameters(url), on_open_callback=on_open)
    state["connection"] = connection
    connection.ioloop.call_later(20, connection.ioloop.stop)
    connection.add_on_close_callback(lambda *_: connection.ioloop.stop())
    connection.ioloop.start()
    out.append(state["got"])


# ---------------------------------------------------------------------- aio-pika
async def aio_pika_surface(url: str, name: Callable[[str], str], out: list[Any]) -> None:
    connection = await aio_pika.connect_robust(url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=2)
        exchange = await channel.declare_exchange(name("hx"), aio_pika.ExchangeType.HEADERS,
                                                  auto_delete=True)
        queue = await channel.declare_queue(name("hq"), exclusive=True)
        await queue.bind(exchange, arguments={"x-match": "any", "kind": "a", "level": 2})
        for headers in ({"kind": "a"}, {"level": 2}, {"level": "2"}, {"kind": "b"}):
            await exchange.publish(aio_pika.Message(b"h", headers=headers), routing_key="")
        got = []
        async with queue.iterator() as iterator:
            async for message in iterator:
                async with message.process():
                    got.append(message.headers)
                if len(got) == 2:
                    break
        out.append(got)
        await asyncio.sleep(0.2)
        out.append(await queue.get(no_ack=True, fail=False))
        try:
            await channel.declare_queue(name("hq"), exclusive=True, durable=True)
        except aio_pika.exceptions.AMQPError as exc:
            out.append(error(exc))
        channel = await connection.channel()
        try:
            await channel.get_queue(name("missing"), ensure=True)
        except aio_pika.exceptions.AMQPError as exc:
            out.append(error(exc))
        channel = await connection.channel()
        queue = await channel.declare_queue(name("del"), auto_delete=False)
        await channel.default_exchange.publish(aio_pika.Message(b"keep"), name("del"))
        await asyncio.sleep(0.2)
        try:
            await queue.delete(if_empty=True)
        except aio_pika.exceptions.AMQPError as exc:
            out.append(error(exc))
        channel = await connection.channel()
        queue = await channel.get_queue(name("del"))
        out.append((await queue.purge()).message_count)
        out.append((await queue.delete()).message_count)
        message = aio_pika.Message(
            b"props", content_type="application/json", content_encoding="utf-8",
            headers={"a": [1, "b"], "t": {"k": True}}, priority=4, correlation_id="c",
            reply_to="r", expiration=60, message_id="m", type="t", app_id="app",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        queue = await channel.declare_queue(exclusive=True)
        await channel.default_exchange.publish(message, queue.name)
        await asyncio.sleep(0.2)
        incoming = await queue.get(no_ack=True)
        out.append({key: value for key, value in incoming.info().items()
                    if key not in ("timestamp", "consumer_tag", "routing_key", "user_id",
                                   "delivery_tag", "cluster_id")})


@script
def aio_pika_script(url: str, name: Callable[[str], str], out: list[Any]) -> None:
    asyncio.run(aio_pika_surface(url, name, out))


# ---------------------------------------------------------------------- aiormq
async def aiormq_surface(url: str, name: Callable[[str], str], out: list[Any]) -> None:
    import aiormq

    connection = await aiormq.connect(url)
    try:
        channel = await connection.channel()
        declared = await channel.queue_declare(name("q"), exclusive=True)
        out.append((declared.message_count, declared.consumer_count))
        confirmation = await channel.basic_publish(b"one", routing_key=name("q"))
        out.append(type(confirmation).__name__)
        try:
            await channel.basic_publish(b"lost", routing_key=name("none"), mandatory=True)
        except aiormq.exceptions.PublishError as exc:
            out.append((type(exc).__name__, exc.message.delivery.reply_code))
        got = await channel.basic_get(name("q"), no_ack=False)
        out.append((got.body, got.delivery.message_count, got.delivery.redelivered))
        await channel.basic_reject(got.delivery.delivery_tag, requeue=True)
        bodies: list[Any] = []
        done = asyncio.get_running_loop().create_future()

        async def on_message(message: Any) -> None:
            bodies.append((message.body, message.delivery.redelivered))
            await message.channel.basic_ack(message.delivery.delivery_tag)
            if not done.done():
                done.set_result(None)

        consume = await channel.basic_consume(name("q"), on_message, consumer_tag="aio")
        await asyncio.wait_for(done, 10)
        out.append((bodies, consume.consumer_tag))
        out.append(type(await channel.basic_cancel("aio")).__name__)
        try:
            await channel.exchange_declare(name("x"), exchange_type="nope")
        except Exception as exc:  # noqa: BLE001
            out.append(error(exc))
    finally:
        if not connection.is_closed:
            await connection.close()


@script
def aiormq_script(url: str, name: Callable[[str], str], out: list[Any]) -> None:
    asyncio.run(aiormq_surface(url, name, out))


# ---------------------------------------------------------------------- the test
def run_script(url: str, which: str) -> Any:
    token = uuid.uuid4().hex[:8]
    out: list[Any] = []
    SCRIPTS[which](url, lambda label: f"dc-{token}-{label}", out)
    return normalise(out, token)


@pytest.fixture
def shardgate_url(broker_factory: Callable[..., object]) -> str:
    app = broker_factory(listeners={"amqp_port": free_port()}).app  # type: ignore[attr-defined]
    return f"amqp://guest:guest@127.0.0.1:{app.port('amqp')}/%2F"


@pytest.fixture
def rabbitmq_url(rabbitmq_node) -> str:
    if rabbitmq_node.error:
        pytest.skip(rabbitmq_node.error)
    return rabbitmq_node.url + "%2F"


@pytest.mark.parametrize("which", sorted(SCRIPTS))
async def test_same_results_as_rabbitmq(which: str, rabbitmq_url: str, shardgate_url: str) -> None:
    loop = asyncio.get_running_loop()
    expected = await loop.run_in_executor(None, run_script, rabbitmq_url, which)
    actual = await loop.run_in_executor(None, run_script, shardgate_url, which)
    found = differences(expected, actual)
    assert not found, f"{which}: Shardgate differs from RabbitMQ:\n" + "\n".join(found)
