"""AMQP routing keys that MQTT could read as wildcards: an MQTT PUBLISH never carries `+` or
`#`; AMQP consumers get the routing key as it was published."""

from __future__ import annotations

import asyncio

import aio_pika
import pytest

from tests.conftest import free_port
from tests.mqtt_clients import V5, V311, Paho


@pytest.fixture
def node(broker_factory):
    return broker_factory(listeners={"amqp_port": free_port()})


def amqp_url(node) -> str:
    return f"amqp://guest:guest@127.0.0.1:{node.app.port('amqp')}/"


@pytest.mark.parametrize("version", [V5, V311])
async def test_wildcard_characters_in_routing_keys_are_escaped_for_mqtt(node, version):
    sub = Paho(node.mqtt_port, "mqtt-sub", version)
    sub.subscribe("w/#", 1)
    async with await aio_pika.connect(amqp_url(node)) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("", exclusive=True)
        await queue.bind("amq.topic", "w.#")
        received: asyncio.Queue = asyncio.Queue()
        await queue.consume(received.put, no_ack=True)
        exchange = await channel.get_exchange("amq.topic")
        for key in ("w.#", "w.+.x", "w.ok"):
            await exchange.publish(aio_pika.Message(key.encode()), key)
        keys = [(await asyncio.wait_for(received.get(), 10)).routing_key for _ in range(3)]
    assert keys == ["w.#", "w.+.x", "w.ok"]
    messages = await asyncio.get_running_loop().run_in_executor(None, sub.expect_n, 3)
    topics = [m.topic for m in messages]
    assert topics == ["w/%23", "w/%2B/x", "w/ok"]
    assert not any("#" in t or "+" in t for t in topics)
    sub.disconnect()
