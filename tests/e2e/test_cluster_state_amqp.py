"""AMQP exchanges shared by the nodes of a cluster, with aio-pika against a real etcd and
`shardgate serve --cluster` processes: a durable exchange declared on one node is known to the
others (passive declare, bind, publish), and deleting it on another node removes it everywhere;
a durable queue on a node that does not own the shard gets what the owner stores, once, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import aiormq
import pytest

from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    EtcdServer,
    amqp_exchange_exists,
    amqp_node,
    amqp_url,
    eventually,
    settled_nodes,
)


@pytest.fixture
def amqp_nodes(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ClusterNodeProcess]]:
    with settled_nodes([amqp_node(tmp_path, f"n{index}", etcd.url).start() for index in (1, 2)]) as nodes:
        yield nodes


async def test_an_exchange_declared_on_one_node_is_used_and_deleted_through_another(
        amqp_nodes: list[ClusterNodeProcess]) -> None:
    n1, n2 = amqp_nodes
    assert not await amqp_exchange_exists(amqp_url(n2), "orders-x")
    received: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
    async with await aio_pika.connect(amqp_url(n1)) as c1, await aio_pika.connect(amqp_url(n2)) as c2:
        ch1 = await c1.channel()
        await ch1.declare_exchange("orders-x", aio_pika.ExchangeType.TOPIC, durable=True)
        await eventually(lambda: amqp_exchange_exists(amqp_url(n2), "orders-x"))

        # a queue on n2 bound to the exchange n1 declared; a publisher on n1 reaches it
        ch2 = await c2.channel()
        queue = await ch2.declare_queue("", exclusive=True)
        await queue.bind("orders-x", "eu.#")

        async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received.put_nowait((message.routing_key, message.body))
            await message.ack()

        await queue.consume(take)
        out = await c1.channel(publisher_confirms=True)
        exchange = await out.get_exchange("orders-x")
        # the binding becomes known to n1 shortly after its bind-ok: until then a mandatory
        # publish comes back unroutable; the first one n1 routes is taken and dropped here
        deadline = asyncio.get_running_loop().time() + 15
        while not isinstance(await exchange.publish(aio_pika.Message(b"probe"), "eu.probe"),
                             aiormq.spec.Basic.Ack):
            assert asyncio.get_running_loop().time() < deadline, "the binding never reached n1"
        assert await asyncio.wait_for(received.get(), 20) == ("eu.probe", b"probe")
        for city in ("paris", "rome"):
            confirmation = await exchange.publish(aio_pika.Message(city.encode()), f"eu.{city}")
            assert isinstance(confirmation, aiormq.spec.Basic.Ack)
        got = [await asyncio.wait_for(received.get(), 20) for _ in range(2)]
        assert got == [("eu.paris", b"paris"), ("eu.rome", b"rome")]

        # deleted through n2: gone on n1 too
        await queue.unbind("orders-x", "eu.#")
        await (await ch2.get_exchange("orders-x")).delete()
        await eventually(lambda: _not(amqp_exchange_exists(amqp_url(n1), "orders-x")))


async def _not(check) -> bool:
    return not await check


async def test_a_durable_queue_on_one_node_receives_once_in_order_what_another_node_publishes(
        amqp_nodes: list[ClusterNodeProcess]) -> None:
    """A durable (non-exclusive) queue declared on the node that does not own the default
    stream's shard: what is published on the owner is pushed to it, journaled there first
    (transient messages too: the queue's cursor follows the owner's offsets), and delivered,
    each once, in order."""
    shards = amqp_nodes[0].status()["placement"]["default"]
    assert len(shards) == 1, "the test expects the default stream to have one shard"
    owner = shards[0][0]
    n1 = next(node for node in amqp_nodes if node.node_id == owner)
    n2 = next(node for node in amqp_nodes if node.node_id != owner)
    received: asyncio.Queue[bytes] = asyncio.Queue()
    async with await aio_pika.connect(amqp_url(n1)) as c1, await aio_pika.connect(amqp_url(n2)) as c2:
        ch2 = await c2.channel()
        queue = await ch2.declare_queue("billing-q", durable=True)
        await queue.bind("amq.topic", "billing.#")

        async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received.put_nowait(message.body)
            await message.ack()

        await queue.consume(take)
        out = await c1.channel(publisher_confirms=True)
        exchange = await out.get_exchange("amq.topic")
        # until the binding is known on n1 a mandatory publish comes back unroutable; the
        # first one routed is the probe, taken below
        deadline = asyncio.get_running_loop().time() + 15
        while not isinstance(await exchange.publish(aio_pika.Message(b"probe"), "billing.eu"),
                             aiormq.spec.Basic.Ack):
            assert asyncio.get_running_loop().time() < deadline, "the binding never reached n1"
        assert await asyncio.wait_for(received.get(), 20) == b"probe"
        sent = [f"invoice-{index}".encode() for index in range(50)]
        for index, body in enumerate(sent):
            # transient (aio-pika's default delivery mode) and persistent messages alike
            mode = aio_pika.DeliveryMode.PERSISTENT if index % 2 else aio_pika.DeliveryMode.NOT_PERSISTENT
            confirmation = await exchange.publish(aio_pika.Message(body, delivery_mode=mode), "billing.eu")
            assert isinstance(confirmation, aiormq.spec.Basic.Ack)
        got = [await asyncio.wait_for(received.get(), 20) for _ in sent]
        assert got == sent
        # nothing more (no duplicate) once a later marker has come through
        await exchange.publish(aio_pika.Message(b"end"), "billing.eu")
        assert await asyncio.wait_for(received.get(), 20) == b"end"
        assert received.empty()
