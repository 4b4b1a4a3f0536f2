"""AMQP's memory watermark (`amqp.memory_high_watermark`) counts the messages delivered and not
acknowledged, which stay in memory until settled, not only the ready ones: 700 deliveries of
1 MB to a consumer with prefetch 0 held 700 MB and publishers were never blocked (issue 26,
item 10). With pika, as a RabbitMQ client sees it: connection.blocked."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import pika

from tests.conftest import ThreadedBroker, free_port


def test_unacknowledged_deliveries_count_towards_the_amqp_memory_watermark(
    broker_factory: Callable[..., ThreadedBroker],
) -> None:
    broker = broker_factory(listeners={"amqp_port": free_port()},
                            amqp={"memory_high_watermark": 1 << 20})
    port = broker.app.port("amqp")
    consumer = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    channel = consumer.channel()
    channel.basic_qos(prefetch_count=0)
    queue = channel.queue_declare("", exclusive=True).method.queue
    received: list[int] = []
    channel.basic_consume(queue, lambda ch, method, props, body: received.append(method.delivery_tag))
    publisher = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    blocked: list[str] = []
    publisher.add_on_connection_blocked_callback(
        lambda _conn, frame: blocked.append(frame.method.reason))
    out = publisher.channel()
    for _ in range(3):  # 3 MiB, all delivered to the consumer at once, none acknowledged
        out.basic_publish("", queue, b"x" * (1 << 20))
    deadline = time.monotonic() + 20
    while len(received) < 3 and time.monotonic() < deadline:
        consumer.process_data_events(time_limit=0.1)
        publisher.process_data_events(time_limit=0)
    assert len(received) == 3
    # nothing is ready (all delivered), yet 3 MiB wait for their acks: the alarm holds
    out.basic_publish("", queue, b"one more")
    while not blocked and time.monotonic() < deadline:
        publisher.process_data_events(time_limit=0.1)
        consumer.process_data_events(time_limit=0)
    assert blocked == ["low on memory"]
    # acknowledged, the bytes are gone and the publisher is unblocked
    unblocked: list[bool] = []
    publisher.add_on_connection_unblocked_callback(lambda _conn, _frame: unblocked.append(True))
    channel.basic_ack(0, multiple=True)
    while not unblocked and time.monotonic() < deadline + 10:
        consumer.process_data_events(time_limit=0.1)
        publisher.process_data_events(time_limit=0.1)
    assert unblocked == [True]
    with contextlib.suppress(pika.exceptions.AMQPError):
        publisher.close()
    consumer.close()
