"""AMQP exchanges shared by the nodes of a cluster, with aio-pika against a real etcd and
`shardgate serve --cluster` processes: a durable exchange declared on one node is known to the
others (passive declare, bind, publish), and deleting it on another node removes it everywhere."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import aiormq
import pytest

from tests.conftest import free_port, wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer, linked, settled


@pytest.fixture
def amqp_nodes(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ClusterNodeProcess]]:
    nodes = [
        ClusterNodeProcess(tmp_path / f"n{index}", f"n{index}", etcd.url,
                           extra_args=["--amqp-port", str(free_port())]).start()
        for index in (1, 2)
    ]
    names = {node.node_id for node in nodes}
    for node in nodes:
        wait_for(lambda node=node: settled(node, names), timeout=30, interval=0.05)
        wait_for(lambda node=node: linked(node) >= names - {node.node_id}, timeout=30, interval=0.05)
    yield nodes
    for node in nodes:
        if node.alive():
            node.kill()


def amqp_url(node: ClusterNodeProcess) -> str:
    return f"amqp://guest:guest@127.0.0.1:{node.ports['amqp']}/"


async def exchange_exists(url: str, name: str) -> bool:
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        try:
            await channel.declare_exchange(name, passive=True)
            return True
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return False


async def eventually(check, timeout: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


async def test_an_exchange_declared_on_one_node_is_used_and_deleted_through_another(
        amqp_nodes: list[ClusterNodeProcess]) -> None:
    n1, n2 = amqp_nodes
    assert not await exchange_exists(amqp_url(n2), "orders-x")
    received: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
    async with await aio_pika.connect(amqp_url(n1)) as c1, await aio_pika.connect(amqp_url(n2)) as c2:
        ch1 = await c1.channel()
        await ch1.declare_exchange("orders-x", aio_pika.ExchangeType.TOPIC, durable=True)
        await eventually(lambda: exchange_exists(amqp_url(n2), "orders-x"))

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
        await eventually(lambda: _not(exchange_exists(amqp_url(n1), "orders-x")))


async def _not(check) -> bool:
    return not await check
