"""Memory per idle MQTT connection: the broker's resident memory growth for N idle clients.

Starts ``python -m shardgate serve`` with its defaults on a scratch data directory (free
loopback ports), records its ``VmRSS`` once it is up and idle, opens ``--connections`` MQTT
3.1.1 connections (clean session, keepalive 600 s, a unique client id each; at most 200
CONNECTs in flight), waits for every CONNACK, lets the broker settle for ``--settle`` seconds
and records ``VmRSS`` again. The figure is (RSS with the connections − RSS before) / N, in KiB.
The connections are then closed and the broker stopped. Everything listens and connects on
127.0.0.1 only; the client is a few lines of asyncio here (it does not import shardgate).

    python bench/bench_memory_idle.py [--connections 5000] [--settle 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _proc import HOST, start_broker, stop_process


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def connect_packet(client_id: str, keepalive: int = 600) -> bytes:
    """An MQTT 3.1.1 CONNECT with a clean session (client ids are short: one length byte)."""
    cid = client_id.encode()
    body = b"\x00\x04MQTT\x04\x02" + keepalive.to_bytes(2, "big") + len(cid).to_bytes(2, "big") + cid
    return bytes([0x10, len(body)]) + body


async def open_idle(port: int, count: int, parallel: int = 200) -> list[asyncio.StreamWriter]:
    """`count` connections that got their CONNACK (refused or dropped ones raise)."""
    gate = asyncio.Semaphore(parallel)
    writers: list[asyncio.StreamWriter] = []

    async def one(index: int) -> None:
        async with gate:
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(connect_packet(f"idle-{index}"))
            connack = await asyncio.wait_for(reader.readexactly(4), 30)
            if connack[0] != 0x20 or connack[3] != 0:
                raise RuntimeError(f"connection {index} refused: {connack.hex()}")
            writers.append(writer)

    await asyncio.gather(*(one(i) for i in range(count)))
    return writers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=5000)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before each RSS")
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.connections + 100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.connections + 1000), hard))
    scratch = Path(tempfile.mkdtemp(prefix="sg-idle-"))
    proc, ports = start_broker(scratch / "data", scratch / "broker.log")
    port = ports["mqtt"]
    try:
        time.sleep(args.settle)
        before = rss_kib(proc.pid)

        async def hold() -> tuple[int, float]:
            started = time.monotonic()
            writers = await open_idle(port, args.connections)
            elapsed = time.monotonic() - started
            await asyncio.sleep(args.settle)
            during = rss_kib(proc.pid)
            for writer in writers:
                writer.close()
            return during, elapsed

        during, elapsed = asyncio.run(hold())
        per = (during - before) / args.connections
        load = os.getloadavg()
        print(f"| idle MQTT connections | {args.connections} |")
        print(f"| broker RSS before / with them (MiB) | {before / 1024:.1f} / {during / 1024:.1f} |")
        print(f"| memory per idle connection (KiB) | **{per:.2f}** |")
        print(f"| connect rate (connections/s) | {args.connections / elapsed:,.0f} |")
        print(f"| load average (1/5/15 min) | {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} |")
        return 0
    finally:
        stop_process(proc, grace=30)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
