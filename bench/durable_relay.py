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
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from amqp_remote_queue import free_port, http_json, wait_until
from shardgate.client import Client

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


@contextlib.contextmanager
def cluster() -> Iterator[dict[str, str]]:
    """Yield the gRPC urls of the holder and the other node once both serve and are placed."""
    with tempfile.TemporaryDirectory(prefix="bench-durable-relay-") as tmp:
        workdir = Path(tmp)
        procs: list[subprocess.Popen[bytes]] = []

        def start(name: str, args: list[str]) -> None:
            with open(workdir / f"{name}.log", "wb") as log:
                procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))

        try:
            client, peer = free_port(), free_port()
            url = f"http://127.0.0.1:{client}"
            start("etcd", [
                ETCD, "--name", "bench", "--data-dir", str(workdir / "etcd"),
                "--listen-client-urls", url, "--advertise-client-urls", url,
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"bench=http://127.0.0.1:{peer}",
            ])
            wait_until(lambda: http_json(f"{url}/health").get("health") == "true", 30, "etcd")
            nodes: dict[str, dict[str, Any]] = {}
            for node_id in ("n1", "n2"):
                grpc_port, http = free_port(), free_port()
                start(node_id, [
                    sys.executable, "-m", "shardgate", "serve", "--cluster", url, "--node-id", node_id,
                    "--cluster-port", "0", "--host", "127.0.0.1", "--mqtt-port", str(free_port()),
                    "--mqtt-ws-port", "0", "--grpc-port", str(grpc_port), "--amqp-port", "0",
                    "--http-port", str(http), "--data-dir", str(workdir / node_id),
                ])
                nodes[node_id] = {"grpc": f"127.0.0.1:{grpc_port}", "http": http}

            def placed() -> bool:
                for info in nodes.values():
                    status = http_json(f"http://127.0.0.1:{info['http']}/api/cluster")
                    if len(status["nodes"]) != 2 or "default" not in status["placement"]:
                        return False
                    info["owner"] = status["placement"]["default"][0][0]
                return True

            wait_until(placed, 60, "the two nodes")
            # the holder is the owner of the default stream's shard: only the relay differs
            owner = nodes["n1"]["owner"]
            other = next(node for node in nodes if node != owner)
            yield {"holder": nodes[owner]["grpc"], "other": nodes[other]["grpc"]}
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in reversed(procs):
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


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
    local = statistics.median(rates["holder"])
    for label, values in rates.items():
        median = statistics.median(values)
        print(f"{label:>8}: {median:8.0f} msg/s (runs: {', '.join(f'{v:.0f}' for v in values)}) "
              f"{median / local:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
