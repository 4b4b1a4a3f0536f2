"""MQTT ⇄ AMQP through the core: amq.topic routing key `a.b` is MQTT topic `a/b`, AMQP headers
are MQTT 5 user properties, content type, correlation id and reply-to carry across."""

from __future__ import annotations

import asyncio

import aio_pika
import pytest

from tests.conftest import free_port
from tests.mqtt_clients import V5, Paho, publish_props


@pytest.fixture
def node(broker_factory):
    return broker_factory(listeners={"amqp_port": free_port()})


def amqp_url(node) -> str:
    return f"amqp://guest:guest@127.0.0.1:{node.app.port('amqp')}/"


async def test_mqtt_publish_reaches_amqp_queue_bound_to_amq_topic(node):
    async with await aio_pika.connect(amqp_url(node)) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("", exclusive=True)
        await queue.bind("amq.topic", "sensors.*")
        received: asyncio.Queue = asyncio.Queue()
        await queue.consume(received.put, no_ack=True)

        def publish() -> None:
            pub = Paho(node.mqtt_port, "mqtt-pub", V5)
            pub.publish("sensors/t1", b"21.5", 1, properties=publish_props(
                ContentType="text/plain", UserProperty=[("unit", "C")],
                CorrelationData=b"corr-1", ResponseTopic="replies/1",
            ))
            pub.publish("motors/m1", b"ignored", 1)
            pub.disconnect()

        await asyncio.get_running_loop().run_in_executor(None, publish)
        message = await asyncio.wait_for(received.get(), 10)
        assert message.body == b"21.5"
        assert (message.exchange, message.routing_key) == ("amq.topic", "sensors.t1")
        assert message.content_type == "text/plain"
        assert message.headers == {"unit": "C"}
        assert message.correlation_id == "corr-1" and message.reply_to == "replies/1"
        assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT  # QoS 1


async def test_amqp_publish_reaches_mqtt5_subscriber_with_user_properties(node):
    sub = Paho(node.mqtt_port, "mqtt-sub", V5)
    sub.subscribe("orders/#", 1)
    async with await aio_pika.connect(amqp_url(node)) as conn:
        channel = await conn.channel()
        topic = await channel.get_exchange("amq.topic")
        await topic.publish(aio_pika.Message(
            b'{"id": 7}', content_type="application/json", headers={"tenant": "acme", "n": 3},
            correlation_id="req-7", reply_to="orders/replies", message_id="m-7",
        ), "orders.eu.new")
    message = await asyncio.get_running_loop().run_in_executor(None, sub.expect)
    assert message.topic == "orders/eu/new" and message.payload == b'{"id": 7}'
    props = dict(message.properties.UserProperty)
    assert props["tenant"] == "acme" and props["n"] == "3"
    assert props["amqp-message-id"] == "m-7"
    assert message.properties.ContentType == "application/json"
    assert message.properties.CorrelationData == b"req-7"
    assert message.properties.ResponseTopic == "orders/replies"
    sub.disconnect()


async def test_amqp_private_exchanges_are_invisible_to_mqtt_wildcards(node):
    sub = Paho(node.mqtt_port, "mqtt-all", V5)
    sub.subscribe("#", 0)
    async with await aio_pika.connect(amqp_url(node)) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("", exclusive=True)
        await channel.default_exchange.publish(aio_pika.Message(b"private"), queue.name)
        topic = await channel.get_exchange("amq.topic")
        await topic.publish(aio_pika.Message(b"public"), "visible")
    message = await asyncio.get_running_loop().run_in_executor(None, sub.expect)
    assert message.payload == b"public"
    sub.disconnect()
