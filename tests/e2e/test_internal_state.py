"""AMQP's durable topology is broker state, not a message: `$amqp/#` subscribers never see it,
clients cannot overwrite it, and it still survives a restart."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aio_pika

from tests.conftest import ThreadedBroker, free_port
from tests.e2e.test_bridge import start_node, stop_node
from tests.mqtt_clients import V5, V311, Paho


async def declare(url: str) -> None:
    async with await aio_pika.connect(url) as conn:
        channel = await conn.channel()
        exchange = await channel.declare_exchange("orders", aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue("billing", durable=True)
        await queue.bind(exchange, "eu.#")


async def exists(url: str) -> bool:
    async with await aio_pika.connect(url) as conn:
        channel = await conn.channel()
        await channel.declare_exchange("orders", passive=True)
        await channel.declare_queue("billing", passive=True)
        return True


def test_topology_is_neither_delivered_nor_retained_for_clients(
    broker_factory: Callable[..., ThreadedBroker],
) -> None:
    broker = broker_factory(listeners={"amqp_port": free_port()})
    url = f"amqp://guest:guest@127.0.0.1:{broker.app.port('amqp')}/"
    live = Paho(broker.mqtt_port, "live", V5)
    live.subscribe([("$amqp/#", 1), ("$internal/#", 1)])
    asyncio.run(declare(url))
    live.expect_none(0.5)
    late = Paho(broker.mqtt_port, "late", V311)
    late.subscribe([("$amqp/#", 1), ("$internal/#", 1)])
    late.expect_none(0.5)  # no retained topology either
    forger = Paho(broker.mqtt_port, "forger", V5)
    forger.publish("$internal/amqp/topology/%2F", b'{"queues": []}', qos=1, retain=True)
    forger.disconnect()
    stop_node(broker)
    start_node(broker)
    assert asyncio.run(exists(f"amqp://guest:guest@127.0.0.1:{broker.app.port('amqp')}/"))
    for client in (live, late):
        client.client.loop_stop()
