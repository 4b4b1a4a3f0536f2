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
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError):
            value = check()
            if value:
                return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready within {timeout:.0f} s")
        time.sleep(0.1)


def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def cluster() -> Iterator[dict[str, dict[str, Any]]]:
    """Yield {node id: {"amqp": port, "http": port}} once both nodes serve and are placed."""
    with tempfile.TemporaryDirectory(prefix="bench-amqp-cluster-") as tmp:
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
                amqp, http = free_port(), free_port()
                start(node_id, [
                    sys.executable, "-m", "shardgate", "serve", "--cluster", url, "--node-id", node_id,
                    "--cluster-port", "0", "--host", "127.0.0.1", "--mqtt-port", str(free_port()),
                    "--mqtt-ws-port", "0", "--grpc-port", "0", "--amqp-port", str(amqp),
                    "--http-port", str(http), "--data-dir", str(workdir / node_id),
                ])
                nodes[node_id] = {"amqp": amqp, "http": http}

            def placed() -> bool:
                for info in nodes.values():
                    status = http_json(f"http://127.0.0.1:{info['http']}/api/cluster")
                    if len(status["nodes"]) != 2 or "default" not in status["placement"]:
                        return False
                    info["status"] = status
                return True

            wait_until(placed, 60, "the two nodes")
            yield nodes
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
    home = statistics.median(rates["home node"])
    for label, values in rates.items():
        median = statistics.median(values)
        print(f"{label:>10}: {median:8.0f} msg/s (runs: {', '.join(f'{v:.0f}' for v in values)}) "
              f"{median / home:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
