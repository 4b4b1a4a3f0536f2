"""gRPC SDK throughput: streaming publish, unary publish and consume, against a real broker.

Starts `python -m shardgate serve` in a subprocess (gRPC on a free port, through
SHARDGATE_GRPC_PORT) so that broker and client each get their own core, then measures with the
SDK:

- stream publish: `Producer.send_nowait` of 100 B messages, batched over one PublishStream;
- unary publish: `Producer.publish`, one round trip each, sequential and 32 concurrent;
- consume: one consumer draining what a streaming producer sends (live subscription, one
  `receive()` and one `ack()` per message; acks travel in batches);
- backlog: a durable subscription replaying, from earliest, what a reliable stream already
  holds, with `receive()` per message and with `receive_batch()`.

    python bench/bench_grpc.py [--messages 200000] [--mode non-reliable|reliable] [--profile]

`--profile` prints the top of a cProfile of the client side of the streaming publish.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardgate.client import Client

PAYLOAD = b"x" * 100


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_broker(data_dir: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    port_file = data_dir / "ports.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    env["SHARDGATE_GRPC_PORT"] = str(port)
    env["SHARDGATE_LOG_LEVEL"] = "warning"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(data_dir / "data"),
         "--mqtt-port", "0", "--mqtt-ws-port", "0", "--amqp-port", "0", "--port-file", str(port_file)],
        env=env,
    )
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the broker did not start")
        time.sleep(0.05)
    return proc, json.loads(port_file.read_text()).get("grpc", port)


async def stream_publish(client: Client, topic: str, count: int, window: int = 20_000) -> float:
    producer = client.producer("bench")
    started = time.perf_counter()
    pending: list[asyncio.Future[object]] = []
    for _ in range(count):
        pending.append(producer.send_nowait(topic, PAYLOAD))  # type: ignore[arg-type]
        if len(pending) >= window:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)
    elapsed = time.perf_counter() - started
    await producer.close()
    return count / elapsed


async def unary_publish(client: Client, topic: str, count: int, concurrency: int) -> float:
    producer = client.producer("bench-unary")
    per_worker = count // concurrency

    async def worker() -> None:
        for _ in range(per_worker):
            await producer.publish(topic, PAYLOAD)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return per_worker * concurrency / (time.perf_counter() - started)


async def consume(client: Client, topic: str, count: int) -> tuple[float, float, int]:
    """Publish `count` messages while one consumer drains them. A live subscription drops the
    oldest messages a consumer cannot keep up with (beyond the server's pending limit), so
    this reports how many arrived and the rate at which they did."""
    consumer = await client.consumer("bench-consumer", [topic], credit=5000).subscribe()
    received = 0
    started = time.perf_counter()
    last = started

    async def drain() -> None:
        nonlocal received, last
        while received < count:
            try:
                message = await consumer.receive(2.0)
            except TimeoutError:
                return
            message.ack()
            received += 1
            last = time.perf_counter()

    drainer = asyncio.ensure_future(drain())
    publish_rate = await stream_publish(client, topic, count)
    await drainer
    rate = received / max(last - started, 1e-9)
    await consumer.close()
    return publish_rate, rate, received


async def backlog(client: Client, stream: str, count: int, batched: bool) -> float:
    """Drain `count` messages a reliable stream already holds through a new durable
    subscription from earliest; no producer competes for the client's CPU."""
    name = f"bench-backlog-{'batch' if batched else 'single'}"
    consumer = await client.consumer(name, stream=stream, durable=True, position="earliest",
                                     credit=5000).subscribe()
    received = 0
    started = time.perf_counter()
    while received < count:
        if batched:
            messages = await consumer.receive_batch(1000, 10.0)
        else:
            messages = [await consumer.receive(10.0)]
        for message in messages:
            message.ack()
        received += len(messages)
    rate = received / (time.perf_counter() - started)
    await consumer.close()
    await client.admin.delete_subscription(name)
    return rate


async def run(url: str, messages: int, mode: str, profile: bool) -> dict[str, float]:
    async with Client(url) as client:
        stream = f"bench-{mode}"
        await client.admin.create_stream(stream, mode=mode)
        results: dict[str, float] = {}
        await stream_publish(client, stream, 10_000)  # warm up
        profiler = cProfile.Profile() if profile else None
        if profiler is not None:
            profiler.enable()
        results["stream_publish_msg_s"] = await stream_publish(client, stream, messages)
        print(f"stream publish: {results['stream_publish_msg_s']:.0f} msg/s", file=sys.stderr)
        if profiler is not None:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
        results["unary_publish_msg_s"] = await unary_publish(client, stream, 3000, 1)
        results["unary_publish_32_concurrent_msg_s"] = await unary_publish(client, stream, 6400, 32)
        pub_rate, consume_rate, received = await consume(client, f"{stream}/consumed", messages // 2)
        results["publish_while_consuming_msg_s"] = pub_rate
        results["consume_msg_s"] = consume_rate
        results["consumed_of_published_pct"] = 100 * received / (messages // 2)
        backlog_stream = "bench-backlog"
        await client.admin.create_stream(backlog_stream, mode="reliable")
        filled = await stream_publish(client, backlog_stream, messages // 2)
        print(f"backlog filled at {filled:.0f} msg/s", file=sys.stderr)
        results["consume_backlog_msg_s"] = await backlog(client, backlog_stream, messages // 2, False)
        results["consume_backlog_batch_msg_s"] = await backlog(
            client, backlog_stream, messages // 2, True)
        print(json.dumps({k: round(v) for k, v in results.items()}), file=sys.stderr)
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--mode", choices=["non-reliable", "reliable"], default="non-reliable")
    parser.add_argument("--url", help="use a running broker instead of starting one")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url
        if url is None:
            proc, port = start_broker(Path(tmp))
            url = f"127.0.0.1:{port}"
        try:
            try:
                import uvloop

                results = uvloop.run(run(url, args.messages, args.mode, args.profile))
            except ImportError:
                results = asyncio.run(run(url, args.messages, args.mode, args.profile))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(20)
    print(json.dumps({"mode": args.mode, "messages": args.messages, "payload_bytes": len(PAYLOAD),
                      **{k: round(v) for k, v in results.items()}}, indent=2))


if __name__ == "__main__":
    main()
