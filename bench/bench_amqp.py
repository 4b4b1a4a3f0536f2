"""AMQP publish→consume throughput: Shardgate against RabbitMQ, side by side.

Both brokers (Shardgate started as `python -m shardgate serve`, Debian's `rabbitmq-server`
started on a loopback port with a throw-away node directory) are started once; each repeat then
runs every mode on each broker in turn (interleaved, so that load from other work on the
machine weighs on both alike), with one publisher process and one consumer process (a lean
pamqp client) on a fresh queue, and reports messages per second from the first publish to the
last message consumed, the median over the repeats, and the median of the per-repeat ratios:

- `confirms+acks`: persistent messages, publisher confirms with a window of outstanding
  confirms, consumer with prefetch and one basic.ack per message (the reliable path);
- `plain`: transient messages, no confirms, a no-ack consumer (the fire-and-forget path).

Every child process has a time limit; the brokers are stopped (their process group) at the end.
`--write` records the table in the `## AMQP broker` section of `--results` (default
`bench/RESULTS.md`) and leaves the other sections alone. This script never imports shardgate, so both brokers are driven the same
way. Run: `python bench/bench_amqp.py --messages 20000 --write`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import multiprocessing as mp
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "RESULTS.md"
SECTION = "## AMQP broker"
MODES = ("confirms+acks", "plain")
START_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"broker exited early with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.1)
    raise RuntimeError(f"broker did not listen on {port} within {timeout}s")


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Stop the broker's process group: SIGTERM, then SIGKILL after `timeout`."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@contextlib.contextmanager
def shardgate_broker(workdir: Path, fsync: str) -> Iterator[int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    env["SHARDGATE_JOURNAL__FSYNC"] = fsync
    log = open(workdir / "shardgate.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(workdir / "data"),
         "--host", "127.0.0.1", "--mqtt-port", str(free_port()), "--mqtt-ws-port", "0",
         "--amqp-port", str(port), "--grpc-port", "0", "--http-port", "0", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    log.close()
    try:
        wait_port(port, proc, START_TIMEOUT)
        yield port
    finally:
        stop_group(proc)


@contextlib.contextmanager
def rabbitmq_broker(workdir: Path) -> Iterator[int]:
    # The real script, not Debian's /usr/sbin wrapper (which switches to the rabbitmq user and
    # its /var/lib/rabbitmq): the node must run as us, in our throw-away directory.
    server = "/usr/lib/rabbitmq/bin/rabbitmq-server"
    if not Path(server).exists():
        server = shutil.which("rabbitmq-server") or server
    if not Path(server).exists():
        raise RuntimeError("rabbitmq-server is not installed (apt-get install -y rabbitmq-server)")
    port = free_port()
    home = workdir / "rabbit"
    home.mkdir()
    (home / "enabled_plugins").write_text("[].\n")
    epmd_port = free_port()
    env = dict(os.environ)
    env.update({
        "HOME": str(home),
        "RABBITMQ_NODE_PORT": str(port),
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
        "RABBITMQ_DIST_PORT": str(free_port()),
        "ERL_EPMD_PORT": str(epmd_port),
        "RABBITMQ_NODENAME": f"bench{os.getpid()}@localhost",
        "RABBITMQ_MNESIA_BASE": str(home / "mnesia"),
        "RABBITMQ_LOG_BASE": str(home / "log"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(home / "enabled_plugins"),
        "RABBITMQ_CONFIG_FILE": str(home / "rabbitmq"),
        "RABBITMQ_FEATURE_FLAGS_FILE": str(home / "feature_flags"),
        "RABBITMQ_QUORUM_DIR": str(home / "quorum"),
        "RABBITMQ_PID_FILE": str(home / "rabbit.pid"),
        "ERL_CRASH_DUMP": str(home / "erl_crash.dump"),
    })
    (home / "mnesia").mkdir()
    (home / "log").mkdir()
    (home / "rabbitmq.conf").write_text("loopback_users = none\n")
    log = open(workdir / "rabbitmq.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([server], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=home)
    log.close()
    try:
        wait_port(port, proc, START_TIMEOUT)
        yield port
    finally:
        stop_group(proc)
        # epmd was started for this private port by the node: end it by its own id.
        with contextlib.suppress(Exception):
            out = subprocess.run(["ss", "-Hltnp", f"sport = :{epmd_port}"], capture_output=True,
                                 text=True, timeout=5).stdout
            for part in out.split("pid=")[1:]:
                os.kill(int(part.split(",")[0]), signal.SIGTERM)


# --------------------------------------------------------------------------- workload
# A lean AMQP client on pamqp (the same codec the server uses), so that the load generator is not
# the bottleneck the way a general-purpose client such as aio-pika is on a small machine.


class RawClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buffer = bytearray()

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        from pamqp import commands

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer)
        writer.write(b"AMQP\x00\x00\x09\x01")
        await client.expect(commands.Connection.Start)
        client.send(0, commands.Connection.StartOk(
            client_properties={"product": "bench"}, mechanism="PLAIN", response="\0guest\0guest"))
        tune = await client.expect(commands.Connection.Tune)
        client.send(0, commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))
        client.send(0, commands.Connection.Open(virtual_host="/"))
        await client.expect(commands.Connection.OpenOk)
        client.send(1, commands.Channel.Open())
        await client.expect(commands.Channel.OpenOk)
        return client

    def send(self, channel: int, value: object) -> None:
        from pamqp import frame

        self.writer.write(frame.marshal(value, channel))  # type: ignore[arg-type]

    async def frames(self) -> list[tuple[int, bytes]]:
        """Read at least one whole frame: (frame type, raw frame) for each whole frame."""
        out: list[tuple[int, bytes]] = []
        while not out:
            data = await self.reader.read(1 << 20)
            if not data:
                raise ConnectionError("broker closed the connection")
            buffer = self.buffer
            buffer += data
            pos = 0
            while len(buffer) - pos >= 7:
                size = int.from_bytes(buffer[pos + 3:pos + 7], "big")
                if len(buffer) - pos < size + 8:
                    break
                out.append((buffer[pos], bytes(buffer[pos:pos + size + 8])))
                pos += size + 8
            del buffer[:pos]
        return out

    async def close(self) -> None:
        """connection.close and wait for close-ok: the broker has taken everything we sent (a
        bare socket close may lose publishes the broker had not read yet)."""
        from pamqp import commands, frame

        self.send(0, commands.Connection.Close(200, "bye", 0, 0))
        done = False
        while not done:
            for frame_type, raw in await self.frames():
                if frame_type == 1 and isinstance(frame.unmarshal(raw)[2], commands.Connection.CloseOk):
                    done = True
        self.writer.close()

    async def expect(self, kind: type) -> object:
        from pamqp import frame

        while True:
            for frame_type, raw in await self.frames():
                if frame_type == 1:
                    value = frame.unmarshal(raw)[2]
                    if isinstance(value, kind):
                        return value
                    raise RuntimeError(f"expected {kind.__name__}, got {value!r}")


DELIVER = (60 << 16 | 60).to_bytes(4, "big")
ACK = (60 << 16 | 80).to_bytes(4, "big")


def _consumer(port: int, queue: str, count: int, acks: bool, ready: mp.Event, out: mp.Queue) -> None:
    async def run() -> None:
        from pamqp import commands

        client = await RawClient.connect(port)
        client.send(1, commands.Queue.Declare(queue=queue, durable=acks))
        await client.expect(commands.Queue.DeclareOk)
        client.send(1, commands.Basic.Qos(prefetch_count=256))
        await client.expect(commands.Basic.QosOk)
        client.send(1, commands.Basic.Consume(queue=queue, consumer_tag="bench", no_ack=not acks))
        await client.expect(commands.Basic.ConsumeOk)
        ready.set()
        seen = 0
        while seen < count:
            for frame_type, raw in await client.frames():
                if frame_type == 1 and raw[7:11] == DELIVER:
                    seen += 1
                    if acks:
                        tag = commands.Basic.Deliver()
                        tag.unmarshal(raw[11:-1])
                        client.send(1, commands.Basic.Ack(tag.delivery_tag))
        out.put(("consumer", time.time()))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 10)

    asyncio.run(run())


def _publisher(port: int, queue: str, count: int, size: int, confirms: bool, window: int,
               ready: mp.Event, out: mp.Queue) -> None:
    async def run() -> None:
        from pamqp import body as pbody
        from pamqp import commands, frame, header

        client = await RawClient.connect(port)
        props = commands.Basic.Properties(delivery_mode=2 if confirms else 1)
        payload = b"x" * size
        one = (frame.marshal(commands.Basic.Publish(exchange="", routing_key=queue), 1)
               + frame.marshal(header.ContentHeader(0, size, props), 1)
               + frame.marshal(pbody.ContentBody(payload), 1))
        if confirms:
            client.send(1, commands.Confirm.Select())
            await client.expect(commands.Confirm.SelectOk)
        ready.wait(30)
        start = time.time()
        sent = confirmed = 0
        if confirms:
            while confirmed < count:
                room = min(window - (sent - confirmed), count - sent)
                if room > 0:
                    client.writer.write(one * room)
                    sent += room
                for frame_type, raw in await client.frames():
                    if frame_type == 1 and raw[7:11] == ACK:
                        ack = commands.Basic.Ack()
                        ack.unmarshal(raw[11:-1])
                        confirmed = max(confirmed, ack.delivery_tag) if ack.multiple else confirmed + 1
        else:
            batch = one * window
            while sent < count:
                n = min(window, count - sent)
                client.writer.write(batch if n == window else one * n)
                sent += n
                await client.writer.drain()
        await client.close()
        out.put(("publisher-start", start))
        out.put(("publisher-end", time.time()))

    asyncio.run(run())


def run_mode(
    port: int, mode: str, count: int, size: int, window: int, time_limit: float, tag: str = "",
) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    out = ctx.Queue()
    acks = mode == "confirms+acks"
    queue = f"bench-{mode.replace('+', '-')}{'-' + tag if tag else ''}"
    consumer = ctx.Process(target=_consumer, args=(port, queue, count, acks, ready, out))
    consumer.start()
    if not ready.wait(60):
        consumer.kill()
        raise RuntimeError("consumer did not start")
    publisher = ctx.Process(target=_publisher, args=(port, queue, count, size, acks, window, ready, out))
    publisher.start()
    results: dict[str, float] = {}
    deadline = time.monotonic() + time_limit
    try:
        while len(results) < 3:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{mode} did not finish within {time_limit}s (got {results})")
            with contextlib.suppress(Exception):
                name, value = out.get(timeout=min(left, 1.0))
                results[name] = value
    finally:
        for proc in (publisher, consumer):
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    elapsed = results["consumer"] - results["publisher-start"]
    return {
        "msgs_per_s": count / elapsed,
        "publish_msgs_per_s": count / (results["publisher-end"] - results["publisher-start"]),
        "elapsed_s": elapsed,
    }


# --------------------------------------------------------------------------- report


def table(rows: dict[str, dict[str, dict[str, float]]], brokers: list[str]) -> str:
    header = "| mode | " + " | ".join(f"{b} msg/s" for b in brokers)
    sep = "|---|" + "---:|" * len(brokers)
    if len(brokers) == 2:
        header += f" | {brokers[0]}/{brokers[1]}"
        sep += "---:|"
    lines = [header + " |", sep]
    for mode in MODES:
        values = [rows.get(b, {}).get(mode) for b in brokers]
        if all(v is None for v in values):
            continue
        cells = [f"{v['msgs_per_s']:,.0f}" if v else "n/a" for v in values]
        if len(brokers) == 2:
            cells.append(f"{values[0]['msgs_per_s'] / values[1]['msgs_per_s']:.2f}×"
                         if values[0] and values[1] else "n/a")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_section(text: str, results: Path) -> None:
    current = results.read_text() if results.exists() else "# Benchmark results\n"
    start = current.find(SECTION)
    if start == -1:
        current = current.rstrip() + "\n\n" + text + "\n"
    else:
        end = current.find("\n## ", start + len(SECTION))
        current = current[:start] + text + ("\n" + current[end + 1:] if end != -1 else "\n")
    results.write_text(current)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--brokers", default="shardgate,rabbitmq")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is kept")
    parser.add_argument("--window", type=int, default=1024, help="outstanding confirms")
    parser.add_argument("--fsync", default="interval", help="Shardgate journal.fsync policy")
    parser.add_argument("--time-limit", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--write", action="store_true", help="record the table in --results")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    brokers = [b for b in args.brokers.split(",") if b]
    modes = [m for m in args.modes.split(",") if m]
    rows: dict[str, dict[str, dict[str, float]]] = {}
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    ratios: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        # Each broker is started once; the runs interleave (every repeat runs each mode on each
        # broker in turn), so that a machine loaded by other work weighs on both alike.
        ports: dict[str, int] = {}
        workdirs: dict[str, Path] = {}
        for broker in brokers:
            workdir = workdirs[broker] = Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix=f"bench-amqp-{broker}-")
            ))
            starter = (shardgate_broker(workdir, args.fsync) if broker == "shardgate"
                       else rabbitmq_broker(workdir))
            ports[broker] = stack.enter_context(starter)
        for repeat in range(args.repeats):
            for mode in modes:
                this_round: dict[str, float] = {}
                for broker in brokers:
                    try:
                        result = run_mode(ports[broker], mode, args.messages, args.size,
                                          args.window, args.time_limit, tag=str(repeat))
                    except Exception as exc:  # a failed run is reported and left out
                        print(f"{broker} {mode}: failed: {exc}", file=sys.stderr)
                        for name in ("shardgate.log", "rabbitmq.log"):
                            log = workdirs[broker] / name
                            if log.exists():
                                print(log.read_text(errors="replace")[-2000:], file=sys.stderr)
                        continue
                    runs.setdefault((broker, mode), []).append(result)
                    this_round[broker] = result["msgs_per_s"]
                    print(f"  run {repeat + 1} {broker:10s} {mode:14s} "
                          f"{result['msgs_per_s']:10,.0f} msg/s", flush=True)
                if len(brokers) == 2 and len(this_round) == 2:
                    ratios.setdefault(mode, []).append(
                        this_round[brokers[0]] / this_round[brokers[1]]
                    )
    for (broker, mode), results in runs.items():
        result = sorted(results, key=lambda r: r["msgs_per_s"])[len(results) // 2]  # median
        rows.setdefault(broker, {})[mode] = result
        print(f"{broker:10s} {mode:14s} {result['msgs_per_s']:10,.0f} msg/s "
              f"(publish {result['publish_msgs_per_s']:,.0f} msg/s, {result['elapsed_s']:.2f}s)",
              flush=True)
    for mode, values in ratios.items():
        print(f"{mode}: median of the per-round ratios {statistics.median(values):.2f}× "
              f"({', '.join(f'{v:.2f}' for v in values)})")
    report = table(rows, brokers)
    print(report)
    if args.write:
        text = (
            f"{SECTION}\n\n`python bench/bench_amqp.py --messages {args.messages} "
            f"--size {args.size} --window {args.window} --fsync {args.fsync} "
            f"--repeats {args.repeats}` on {dt.date.today().isoformat()}, {platform.machine()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}. One publisher process "
            "and one consumer process (lean pamqp clients) on one queue; msg/s from the first "
            "publish to the last message consumed, median of the repeats. `confirms+acks`: "
            f"persistent messages to a durable queue, publisher confirms (window {args.window}), "
            "prefetch 256 and one ack per message. `plain`: transient, no confirms, no-ack "
            "consumer.\n\n" + report + "\n"
        )
        write_section(text, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
