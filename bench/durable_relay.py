"""Draining a durable gRPC subscription on its holder against through another node's relay.

Starts a real etcd and two `shardgate serve --cluster` nodes on loopback. Per run and side
it makes a Shared durable subscription held by the node that owns the default stream's shard,
publishes `--messages` 64-byte messages to it with the SDK, attaches an anchor consumer there
with credit 1 (it takes one message and then none, and keeps the subscription there), then
drains the backlog (all but the anchor's one) with one SDK consumer (credit 1000, acks batched
by the SDK): on the holder itself, or on the other node, whose stream is relayed to the holder
over the cluster port with every ack going back there (`shardgate/cluster/durables.py`). It
prints messages per second for each, the median of `--runs`, runs interleaved.

    python bench/durable_relay.py --messages 20000 --runs 3

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

from _cluster import print_medians, two_nodes
from shardgate.client import Client


@contextlib.contextmanager
def cluster() -> Iterator[dict[str, str]]:
    """Yield the gRPC urls of the holder and the other node once both serve and are placed."""
    with tempfile.TemporaryDirectory(prefix="bench-durable-relay-") as tmp, \
            two_nodes(Path(tmp), "grpc") as nodes:
        # the holder is the owner of the default stream's shard: only the relay differs
        owner = nodes["n1"]["status"]["placement"]["default"][0][0]
        other = next(node for node in nodes if node != owner)
        yield {"holder": f"127.0.0.1:{nodes[owner]['grpc']}", "other": f"127.0.0.1:{nodes[other]['grpc']}"}


async def run_once(urls: dict[str, str], name: str, drain_on: str, messages: int) -> float:
    """Messages per second draining subscription `name` from node `drain_on`."""
    topic = f"relay/{name}"
    async with Client(urls["holder"]) as holder, Client(urls[drain_on]) as drainer:
        # define the subscription on the holder, store the backlog, then attach the anchor: the backlog
        # is then read from the journal, each message to a consumer with credit for it
        first = holder.consumer(name, [topic], type="shared", durable=True, reconnect=False)
        await first.subscribe()
        await first.close()
        producer = holder.producer()
        body = b"x" * 64
        for start in range(0, messages, 500):
            await asyncio.gather(*(producer.send(topic, body) for _ in range(min(500, messages - start))))
        anchor = holder.consumer(name, [topic], type="shared", durable=True, credit=1, reconnect=False)
        await anchor.subscribe()
        consumer = drainer.consumer(name, [topic], type="shared", durable=True, reconnect=False)
        started = time.perf_counter()
        await consumer.subscribe()
        seen = 0
        wanted = messages - 1  # the anchor took one
        async def drain() -> None:
            nonlocal seen
            async for message in consumer:
                message.ack()
                seen += 1
                if seen >= wanted:
                    return
        try:
            await asyncio.wait_for(drain(), 120)
        except TimeoutError:
            raise RuntimeError(f"{name}: {seen} of {wanted} drained in 120 s") from None
        elapsed = time.perf_counter() - started
        await consumer.close()
        await anchor.close()
        await holder.admin.delete_subscription(name)
    return seen / elapsed


async def measure(urls: dict[str, str], messages: int, runs: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {"holder": [], "relayed": []}
    for run in range(runs):
        for label, node in (("holder", "holder"), ("relayed", "other")):
            rates[label].append(await run_once(urls, f"bench-{run}-{label}", node, messages))
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    with cluster() as urls:
        rates = asyncio.run(measure(urls, args.messages, args.runs))
    print_medians(rates)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
