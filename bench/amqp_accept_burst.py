"""A burst of AMQP connections against a busy broker: how long the connections wait in the
kernel's accept queue, on an earlier Shardgate revision and on this checkout, interleaved.

Each build runs its own `shardgate serve` (as `ab_amqp.py` starts them: an earlier revision is
exported with `git archive`). Per round and build, a publisher and a consumer keep the broker
busy (`bench_amqp.py`'s `plain` mode, so every loop iteration has work), and a separate process
opens `--burst` connections at once and does the AMQP handshake on each (protocol header to
connection.open-ok). Meanwhile the listening socket's accept queue is sampled every 2 ms with
`ss -ltn` (its Recv-Q). Reported: the largest accept queue seen, how long it stayed non-empty
(first to last sample with a connection waiting), and the handshake times
(connect to open-ok) of the burst, median / p99 / max.
Run: `python bench/amqp_accept_burst.py --before f3cb456 --rounds 3 --burst 500`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from ab_amqp import export_revision, serve  # noqa: E402
from bench_amqp import run_mode  # noqa: E402

HEADER = b"AMQP\x00\x00\x09\x01"


async def _handshake(port: int) -> float:
    from pamqp import commands, frame

    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    buffer = bytearray()

    async def next_frame() -> object:
        while True:
            if len(buffer) >= 7:
                size = int.from_bytes(buffer[3:7], "big") + 8
                if len(buffer) >= size:
                    value = frame.unmarshal(bytes(buffer[:size]))[2]
                    del buffer[:size]
                    return value
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("closed during the handshake")
            buffer.extend(data)

    writer.write(HEADER)
    await next_frame()  # connection.start
    writer.write(frame.marshal(commands.Connection.StartOk(
        client_properties={}, mechanism="PLAIN", response="\0guest\0guest"), 0))
    await next_frame()  # connection.tune
    writer.write(frame.marshal(commands.Connection.TuneOk(channel_max=16, frame_max=131072, heartbeat=0), 0)
                 + frame.marshal(commands.Connection.Open(virtual_host="/"), 0))
    opened = await next_frame()
    assert isinstance(opened, commands.Connection.OpenOk), opened
    elapsed = time.perf_counter() - start
    writer.close()
    return elapsed


def _burst(port: int, count: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    async def run() -> list[float]:
        return list(await asyncio.gather(*(_handshake(port) for _ in range(count))))

    out.put(asyncio.run(run()))


def accept_queue(port: int) -> int:
    """The Recv-Q of the listening socket on `port` (connections waiting to be accepted)."""
    lines = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True,
                           text=True, check=False).stdout.splitlines()
    return max((int(line.split()[1]) for line in lines if line.split()), default=0)


def one_round(port: int, burst: int, messages: int) -> dict[str, float]:
    load = threading.Thread(target=run_mode, args=(port, "plain", messages, 256, 1024, 180),
                            kwargs={"tag": f"burst{time.monotonic_ns()}"}, daemon=True)
    load.start()
    time.sleep(1.0)  # the load under way
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_burst, args=(port, burst, out))
    proc.start()
    deepest = 0
    first_waiting = last_waiting = 0.0
    times: list[float] | None = None
    deadline = time.monotonic() + 120
    while times is None and time.monotonic() < deadline:
        waiting = accept_queue(port)
        if waiting:
            last_waiting = time.monotonic()
            first_waiting = first_waiting or last_waiting
        deepest = max(deepest, waiting)
        with contextlib.suppress(Exception):
            times = out.get(timeout=0.002)
    proc.join(10)
    load.join(180)
    if times is None:
        raise TimeoutError("the burst did not complete")
    times.sort()
    return {"deepest": deepest, "queued_s": last_waiting - first_waiting, "median_ms": statistics.median(times) * 1e3,
            "p99_ms": times[int(len(times) * 0.99) - 1] * 1e3, "max_ms": times[-1] * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=500)
    parser.add_argument("--messages", type=int, default=100000, help="of the load, per round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="burst-amqp-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        for name in ("before", "after"):
            (root / name).mkdir()
        before_path = export_revision(args.before, root / "before")
        builds = {
            "before": stack.enter_context(serve(root / "before", str(before_path))),
            "after": stack.enter_context(serve(root / "after", None)),
        }
        for round_ in range(args.rounds):
            for name, (_proc, port) in builds.items():
                row = one_round(port, args.burst, args.messages)
                load = Path("/proc/loadavg").read_text().split()[0]
                print(f"round {round_ + 1} {name:6s} load {load:>5s}  accept queue max "
                      f"{row['deepest']:4.0f}  non-empty for {row['queued_s']:5.2f} s  handshake median {row['median_ms']:7.1f} ms  "
                      f"p99 {row['p99_ms']:7.1f} ms  max {row['max_ms']:7.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
