"""Consuming an AMQP queue from its home node against from another node of a cluster.

Starts a real etcd and two `shardgate serve --cluster` nodes on loopback. It declares a durable
queue on the node that owns the default stream's shard (its home), fills it with persistent
messages (publisher confirms, 64-byte bodies) and drains it with an aio-pika consumer
(prefetch 200, one ack per message). The consumer runs once on the home node (local) and once
on the other node, where every delivery and ack crosses the cluster port (`remote.py`). It
prints messages per second for each, the median of `--runs`.

    python bench/amqp_remote_queue.py --messages 20000 --runs 3

Like the other runners it only starts processes and talks to them as a client would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
from _cluster import print_medians, two_nodes


@contextlib.contextmanager
def cluster() -> Iterator[dict[str, dict[str, Any]]]:
    """Yield {node id: {"amqp": port, "http": port, ...}} once both nodes serve and are placed."""
    with tempfile.TemporaryDirectory(prefix="bench-amqp-cluster-") as tmp, \
            two_nodes(Path(tmp), "amqp") as nodes:
        yield nodes


async def fill(url: str, queue: str, count: int) -> None:
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True)
        body = b"x" * 64
        for start in range(0, count, 500):
            await asyncio.gather(*(
                channel.default_exchange.publish(
                    aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT), queue)
                for _ in range(min(500, count - start))))


async def drain(url: str, queue: str, count: int) -> float:
    """Messages per second consuming `count` messages with acks, prefetch 200."""
    done = asyncio.Event()
    seen = 0

    async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal seen
        await message.ack()
        seen += 1
        if seen == count:
            done.set()

    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=200)
        consumer = await channel.get_queue(queue, ensure=False)
        started = time.perf_counter()
        tag = await consumer.consume(take)
        await asyncio.wait_for(done.wait(), 300)
        elapsed = time.perf_counter() - started
        await consumer.cancel(tag)
    return count / elapsed


async def measure(nodes: dict[str, dict[str, Any]], messages: int, runs: int) -> dict[str, list[float]]:
    owner = next(iter(nodes.values()))["status"]["placement"]["default"][0][0]
    other = next(node for node in nodes if node != owner)
    url = {node: f"amqp://guest:guest@127.0.0.1:{info['amqp']}/" for node, info in nodes.items()}
    rates: dict[str, list[float]] = {"home node": [], "other node": []}
    for run in range(runs):
        for label, consumer in (("home node", owner), ("other node", other)):
            queue = f"bench-{run}-{consumer}"
            await fill(url[owner], queue, messages)
            rates[label].append(await drain(url[consumer], queue, messages))
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    with cluster() as nodes:
        rates = asyncio.run(measure(nodes, args.messages, args.runs))
    print_medians(rates)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
