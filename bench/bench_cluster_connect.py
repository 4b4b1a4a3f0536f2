"""Persistent-session CONNECT rate: a single node against a node of a cluster.

In cluster mode every session a client opens is recorded in etcd's session registry
(client id → node; written asynchronously, never on the CONNACK path), so connecting should
cost about the same. Each round opens `--total` MQTT 5.0 connections, `--concurrency` at a
time, each a new client id with clean start off and a one-hour session expiry (a persistent
session), waits for CONNACK, sends DISCONNECT and closes. Rounds alternate between a plain
`shardgate serve` and one node of a two-node `serve --cluster` against a local etcd.

    python bench/bench_cluster_connect.py [--total 2000] [--concurrency 20] [--rounds 3]

Prints a markdown table of connections per second (best and median of the rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
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

from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode

V5 = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.1)
    raise RuntimeError("timed out waiting")


@contextlib.contextmanager
def process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "ab") as out:
        # (cluster nodes need a cluster secret; the single node ignores it)
        env = {**os.environ, "SHARDGATE_CLUSTER__SECRET": "bench-cluster-secret-0123456789abcdef",
               "SHARDGATE_ARCHIVE__PER_NODE": "true"}
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def serve_args(data: Path, mqtt: int, http: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(data), "--mqtt-port",
            str(mqtt), "--mqtt-ws-port", "0", "--amqp-port", "0", "--grpc-port", "0",
            "--http-port", str(http), *extra]


def info_ok(http: int, path: str = "/api/info") -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{http}{path}", timeout=2) as reply:
        return reply.status == 200


async def connect_once(port: int, client_id: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    props = p.Properties(session_expiry_interval=3600)
    writer.write(encode(p.Connect("MQTT", V5, False, 60, client_id, None, None, None, props), V5))
    header = await reader.readexactly(2)
    if header[0] >> 4 != 2:
        raise RuntimeError(f"expected CONNACK, got {header!r}")
    body = await reader.readexactly(header[1])
    if body[1] != 0:
        raise RuntimeError(f"CONNACK reason {body[1]:#x}")
    writer.write(encode(p.Disconnect(0, p.Properties()), V5))
    await writer.drain()
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


async def connect_rate(port: int, total: int, concurrency: int, prefix: str) -> float:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(total):
        queue.put_nowait(index)

    async def worker() -> None:
        while not queue.empty():
            await connect_once(port, f"{prefix}-{queue.get_nowait()}")

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    etcd = shutil.which("etcd")
    if etcd is None:
        sys.exit("etcd is not installed (apt-get install etcd-server)")
    work = Path(tempfile.mkdtemp(prefix="bench-connect-"))
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    single_mqtt, single_http = free_port(), free_port()
    n1_mqtt, n1_http, n2_mqtt, n2_http = free_port(), free_port(), free_port(), free_port()
    results: dict[str, list[float]] = {"single node": [], "cluster node": []}
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(process(
                [etcd, "--data-dir", str(work / "etcd"), "--listen-client-urls", url,
                 "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", f"default=http://127.0.0.1:{peer}"], work / "etcd.log"))
            stack.enter_context(process(serve_args(work / "single", single_mqtt, single_http),
                                        work / "single.log"))
            for name, mqtt, http in (("n1", n1_mqtt, n1_http), ("n2", n2_mqtt, n2_http)):
                stack.enter_context(process(
                    serve_args(work / name, mqtt, http, "--cluster", url, "--node-id", name,
                               "--cluster-port", "0"), work / f"{name}.log"))
            wait_until(lambda: info_ok(single_http))
            wait_until(lambda: len(json.load(urllib.request.urlopen(
                f"http://127.0.0.1:{n1_http}/api/cluster", timeout=2))["nodes"]) == 2)
            for round_ in range(args.rounds):
                for name, port in (("single node", single_mqtt), ("cluster node", n1_mqtt)):
                    rate = asyncio.run(connect_rate(port, args.total, args.concurrency,
                                                    f"r{round_}-{name[0]}"))
                    results[name].append(rate)
                    print(f"round {round_ + 1}: {name}: {rate:,.0f} connects/s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.total} persistent-session CONNECTs per round, {args.concurrency} at a time, "
          f"{args.rounds} rounds\n")
    print("| node | best (connects/s) | median (connects/s) |")
    print("|---|---:|---:|")
    for name, rates in results.items():
        print(f"| {name} | {max(rates):,.0f} | {statistics.median(rates):,.0f} |")
    ratio = statistics.median(results["cluster node"]) / statistics.median(results["single node"])
    print(f"\ncluster / single (medians): {ratio:.2f}×")


if __name__ == "__main__":
    main()
