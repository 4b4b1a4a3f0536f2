"""A durable AMQP queue's home node restarting while another node, the owner of the shard the
queue reads, goes on storing what a publisher sends: the queue has every acknowledged message
once, in publish order (real etcd, two `shardgate serve --cluster` nodes, aio-pika with
publisher confirms).

The queue's cursor on the owner's shard is restored from the home's store at start, before the
node knows the shard map; the owner's pushes reach the home as soon as their link is up. The
cursor must not take those pushes before the start has placed it on the owner's journal at its
saved floor: it did, then replayed from the floor, so the early pushes came twice and what was
stored during the stop arrived after them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import aiormq
import pytest

from tests.conftest import free_port
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer
from tests.e2e.test_cluster_amqp_queues import amqp_url, by_shard_owner, eventually, wait_joined


@pytest.fixture
def amqp_nodes(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ClusterNodeProcess]]:
    nodes = [
        ClusterNodeProcess(tmp_path / f"n{index}", f"n{index}", etcd.url,
                           extra_args=["--amqp-port", str(free_port())]).start()
        for index in (1, 2)
    ]
    wait_joined(nodes)
    yield nodes
    for node in nodes:
        if node.alive():
            node.kill()


class Publisher:
    """Publishes numbered persistent messages one at a time with confirms (so the order is the
    publish order) until stopped; keeps the bodies the broker acknowledged."""

    def __init__(self, url: str, routing_key: str) -> None:
        self.url = url
        self.routing_key = routing_key
        self.acknowledged: list[bytes] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Publisher:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def _run(self) -> None:
        number = 0
        async with await aio_pika.connect(self.url) as connection:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange("amq.topic")
            while not self._stop.is_set():
                body = f"m{number:05d}".encode()
                number += 1
                # not mandatory: while the home is down no live node routes to the queue; the
                # owner stores the message all the same
                confirmation = await exchange.publish(
                    aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    self.routing_key, mandatory=False)
                assert isinstance(confirmation, aiormq.spec.Basic.Ack), confirmation
                self.acknowledged.append(body)

    async def until_more(self, count: int) -> None:
        target = len(self.acknowledged) + count

        async def published() -> bool:
            assert self._task is not None
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise AssertionError("the publisher stopped")
            return len(self.acknowledged) >= target

        await eventually(published, timeout=30)

    async def stop(self) -> list[bytes]:
        self._stop.set()
        assert self._task is not None
        await asyncio.wait_for(self._task, 30)
        return self.acknowledged


async def queue_depth(url: str, name: str) -> int:
    async with await aio_pika.connect(url) as connection:
        queue = await (await connection.channel()).declare_queue(name, passive=True)
        return int(queue.declaration_result.message_count)


async def test_a_restarted_queue_home_has_every_message_once_in_order(
        amqp_nodes: list[ClusterNodeProcess]) -> None:
    owner, home = by_shard_owner(amqp_nodes)
    async with await aio_pika.connect(amqp_url(home)) as connection:
        queue = await (await connection.channel()).declare_queue("restart-q", durable=True)
        await queue.bind("amq.topic", "restart.#")
    publisher = Publisher(amqp_url(owner), "restart.a").start()
    try:
        await publisher.until_more(20)
        assert await asyncio.to_thread(home.terminate) == 0
        await publisher.until_more(20)  # stored on the owner during the stop
        # the home starts while the owner goes on storing and pushing
        await asyncio.to_thread(home.start)
        await asyncio.to_thread(wait_joined, amqp_nodes)
        await publisher.until_more(50)
    finally:
        acknowledged = await publisher.stop()
    expected = len(acknowledged)

    async def depth_reached() -> bool:
        with contextlib.suppress(aio_pika.exceptions.AMQPError, OSError):
            return await queue_depth(amqp_url(home), "restart-q") >= expected
        return False

    await eventually(depth_reached, timeout=30)
    async with await aio_pika.connect(amqp_url(home)) as connection:
        q = await (await connection.channel()).declare_queue("restart-q", passive=True)
        bodies = []
        while (message := await q.get(no_ack=True, fail=False)) is not None:
            bodies.append(message.body)
    duplicates = len(bodies) - len(set(bodies))
    assert duplicates == 0, f"{duplicates} messages came twice"
    assert bodies == acknowledged
