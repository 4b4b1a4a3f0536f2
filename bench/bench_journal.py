"""Append throughput of the journal under each fsync policy, against the machine's raw limit.

Many asyncio appenders each append a batch of 100-byte records and wait for its commit, as
protocol adapters do before acknowledging; the journal groups them into one write + fsync per
pass. An appender either awaits each append before the next (window 1: a publisher waiting for
every ack) or keeps up to `window` appends unacknowledged (MQTT receive-maximum, AMQP publisher
confirms). In the same run, a plain loop of os.write + fdatasync writes pre-framed batches of
the same size as the journal's mean commit group: the most a single writer gets from this disk
at that group size.

    python bench/bench_journal.py [--seconds 2] [--repeat 2] [--scenarios 64x1x1 ...] [--dir PATH]
    python bench/bench_journal.py --framing    # CPU per record of append alone (no disk)

A scenario is APPENDERSxRECORDS_PER_APPENDxWINDOW. `--framing` measures the process CPU time
per record of `append` + `commit_waiter` for 1, 16 and 256 records per append, best of 40
rounds of 2,000 records (the groups are written between rounds, outside the measure).
Prints a markdown table. Nothing here is imported by the broker.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from shardgate.storage.journal import JournalStorage
from shardgate.storage.journal.record import DEFAULT_CHECKSUM, encode

RECORD_BYTES = 100


@dataclass
class Result:
    name: str
    appenders: int
    batch: int
    window: int
    group: float
    records: int
    seconds: float
    fsyncs: int

    @property
    def rate(self) -> float:
        return self.records / self.seconds

    @property
    def mbps(self) -> float:
        return self.rate * RECORD_BYTES / 1e6


async def run_journal(
    directory: Path, policy: str, appenders: int, batch: int, window: int, seconds: float
) -> Result:
    store = JournalStorage(directory, fsync=policy)
    shard = store.open_shard("bench", 0)
    data = os.urandom(RECORD_BYTES)
    deadline = time.perf_counter() + seconds
    done = 0

    async def appender() -> None:
        nonlocal done
        records = [(0, data)] * batch
        unacked: deque[asyncio.Future[None]] = deque()
        while time.perf_counter() < deadline:
            shard.append(records)
            waiter = shard.commit_waiter()
            if waiter is not None:
                unacked.append(waiter)
            while len(unacked) >= window:
                await unacked.popleft()
                done += batch
        for waiter in unacked:
            await waiter
            done += batch

    started = time.perf_counter()
    await asyncio.gather(*(appender() for _ in range(appenders)))
    elapsed = time.perf_counter() - started
    stats = store.stats
    group = stats.records / stats.groups if stats.groups else 0.0
    result = Result(
        f"journal `{policy}`", appenders, batch, window, group, done, elapsed, stats.fsyncs
    )
    assert shard.committed_offset >= done
    store.close()
    return result


def run_raw(directory: Path, group: int, seconds: float, fsync: bool) -> Result:
    """os.write (+ fdatasync) of pre-framed batches of `group` records, as fast as it goes."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "raw.log"
    frame = encode(0, 0, os.urandom(RECORD_BYTES))
    chunk = frame * max(1, group)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    records = syncs = 0
    started = time.perf_counter()
    deadline = started + seconds
    try:
        while time.perf_counter() < deadline:
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fdatasync(fd)
                syncs += 1
            records += max(1, group)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - started
    name = "raw os.write + fdatasync" if fsync else "raw os.write"
    return Result(name, 1, max(1, group), 1, float(max(1, group)), records, elapsed, syncs)


async def framing_cost(directory: Path, batch: int, rounds: int = 40, per_round: int = 2000) -> float:
    """Best process CPU ns per record of append + commit_waiter, `batch` records per append."""
    store = JournalStorage(directory, fsync="os")
    shard = store.open_shard("bench", 0)
    records = [(int(time.time() * 1000), os.urandom(150))] * batch
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(per_round // batch):
            shard.append(records)
            shard.commit_waiter()
        elapsed = time.process_time() - started
        best = min(best, elapsed / ((per_round // batch) * batch) * 1e9)
        await store.flush()
    store.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument(
        "--scenarios", nargs="+", default=["64x1x1", "64x16x1", "512x16x1", "64x1x16", "64x16x8"]
    )
    parser.add_argument("--policies", nargs="+", default=["always", "interval", "os"])
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temp dir)"
    )
    parser.add_argument("--repeat", type=int, default=2, help="runs per row; the best is kept")
    parser.add_argument("--no-uvloop", action="store_true")
    parser.add_argument("--framing", action="store_true", help="CPU per record of append only")
    args = parser.parse_args()
    if args.framing:
        base = Path(tempfile.mkdtemp(prefix="bench-framing-", dir=args.dir))
        try:
            for batch in (1, 16, 256):
                cost = asyncio.run(framing_cost(base / str(batch), batch))
                print(f"{batch:4d} records per append: {cost:6.0f} ns CPU per record")
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return

    runner = asyncio.run
    loop_name = "asyncio"
    if not args.no_uvloop:
        try:
            import uvloop

            runner = uvloop.run
            loop_name = "uvloop"
        except ImportError:
            pass

    base = Path(tempfile.mkdtemp(prefix="bench-journal-", dir=args.dir))
    rows: list[tuple[Result, Result]] = []
    try:
        for scenario in args.scenarios:
            appenders, batch, window = (int(part) for part in scenario.split("x"))
            for policy in args.policies:
                best: Result | None = None
                best_raw: Result | None = None
                for attempt in range(args.repeat):
                    work = base / f"{policy}-{scenario}-{attempt}"
                    result = runner(
                        run_journal(work, policy, appenders, batch, window, args.seconds)
                    )
                    if best is None or result.rate > best.rate:
                        best = result
                    if policy == "interval":
                        raw = interval_bound(appenders * batch * window, result)
                    else:
                        raw = run_raw(
                            work / "raw",
                            round(result.group),
                            args.seconds,
                            fsync=policy == "always",
                        )
                    if best_raw is None or raw.rate > best_raw.rate:
                        best_raw = raw
                    shutil.rmtree(work)
                assert best is not None and best_raw is not None
                rows.append((best, best_raw))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print(
        f"Journal append throughput, {RECORD_BYTES}-byte records, {loop_name}, "
        f"{DEFAULT_CHECKSUM} checksums, {os.cpu_count()} CPUs, best of {args.repeat} runs of "
        f"{args.seconds:g} s\n"
    )
    print(
        "| policy | appenders × records/append × window | mean group | fsyncs/s | records/s "
        "| MB/s | baseline (same group size) | baseline records/s | ratio |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|---:|")
    for result, raw in rows:
        print(
            f"| {result.name} | {result.appenders} × {result.batch} × {result.window} "
            f"| {result.group:.0f} "
            f"| {result.fsyncs / result.seconds:.0f} | {result.rate:,.0f} | {result.mbps:.1f} "
            f"| {raw.name} | {raw.rate:,.0f} | {result.rate / raw.rate:.2f} |"
        )


def interval_bound(outstanding: int, result: Result) -> Result:
    """Appenders that wait for their commit can get at most `outstanding` records committed
    per fsync interval: the baseline of the `interval` policy is that bound, not the disk."""
    interval = 0.05
    return Result(
        "bound: unacked records / 50 ms",
        1,
        outstanding,
        1,
        float(outstanding),
        round(outstanding / interval * result.seconds),
        result.seconds,
        0,
    )


if __name__ == "__main__":
    main()
