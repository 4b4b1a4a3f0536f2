"""AMQP end to end with pika's BlockingConnection: confirms, get, consume with acks, heartbeats,
exchange errors, and the connection-level reply codes pika reports."""

from __future__ import annotations

import time

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker, ConnectionClosedByBroker, UnroutableError

from tests.conftest import free_port


@pytest.fixture
def port(broker_factory) -> int:
    return broker_factory(listeners={"amqp_port": free_port()}).app.port("amqp")


def connect(port: int, **kwargs) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, **kwargs))


def test_confirmed_publish_and_acked_consume(port):
    with connect(port) as conn:
        channel = conn.channel()
        channel.confirm_delivery()
        channel.queue_declare("jobs", durable=True)
        for i in range(20):
            channel.basic_publish("", "jobs", b"job-%d" % i,
                                  pika.BasicProperties(delivery_mode=2, priority=3))
        with pytest.raises(UnroutableError):
            channel.basic_publish("amq.direct", "nobody", b"x", mandatory=True)
        channel.basic_qos(prefetch_count=5)
        bodies = []
        for method, props, body in channel.consume("jobs", inactivity_timeout=2):
            if method is None:
                break
            bodies.append(body)
            assert props.delivery_mode == 2 and props.priority == 3
            channel.basic_ack(method.delivery_tag)
            if len(bodies) == 20:
                break
        channel.cancel()
        assert bodies == [b"job-%d" % i for i in range(20)]


def test_basic_get_and_message_count(port):
    with connect(port) as conn:
        channel = conn.channel()
        channel.queue_declare("g", auto_delete=False)
        for i in range(3):
            channel.basic_publish("", "g", b"%d" % i)
        method, _, body = channel.basic_get("g")
        assert body == b"0" and method.message_count == 2
        channel.basic_reject(method.delivery_tag, requeue=True)
        method, _, body = channel.basic_get("g", auto_ack=True)
        assert body == b"0" and method.redelivered
        assert channel.queue_declare("g", passive=True).method.message_count == 2


def test_exchange_type_mismatch_closes_channel_406(port):
    with connect(port) as conn:
        channel = conn.channel()
        channel.exchange_declare("ex1", "fanout")
        with pytest.raises(ChannelClosedByBroker) as info:
            channel.exchange_declare("ex1", "direct")
        assert info.value.reply_code == 406
        channel = conn.channel()
        with pytest.raises(ChannelClosedByBroker) as info:
            channel.exchange_declare("amq.custom", "direct")
        assert info.value.reply_code == 403


def test_unknown_exchange_type_closes_connection_503(port):
    with connect(port) as conn:
        channel = conn.channel()
        with pytest.raises(ConnectionClosedByBroker) as info:
            channel.exchange_declare("weird", "x-unknown-type")
        assert info.value.reply_code == 503


def test_heartbeats_keep_an_idle_connection_alive(port):
    with connect(port, heartbeat=1) as conn:
        channel = conn.channel()
        queue = channel.queue_declare("", exclusive=True).method.queue
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.5)
        channel.basic_publish("", queue, b"still here")
        assert channel.basic_get(queue, auto_ack=True)[2] == b"still here"


def test_delete_exchange_if_unused(port):
    with connect(port) as conn:
        channel = conn.channel()
        channel.exchange_declare("used", "direct")
        queue = channel.queue_declare("", exclusive=True).method.queue
        channel.queue_bind(queue, "used", "k")
        with pytest.raises(ChannelClosedByBroker) as info:
            channel.exchange_delete("used", if_unused=True)
        assert info.value.reply_code == 406
        channel = conn.channel()
        channel.exchange_delete("used")
        with pytest.raises(ChannelClosedByBroker) as info:
            channel.exchange_declare("used", "direct", passive=True)
        assert info.value.reply_code == 404
