"""Placement computation time: the controller's `place()` for many nodes and shards.

Scenarios (each timed `--repeat` times, best and median printed):
- initial: every shard new, placed on N live nodes;
- join: one node joins a placed cluster (it takes its fair share);
- death: one node dies (its non-reliable shards move, reliable ones stay);
- steady: nothing changed (the common case: every watch event re-runs placement).
A tenth of the streams are reliable. Prints a markdown table. Nothing here is imported by
the broker.

    python bench/bench_placement.py [--nodes 100] [--shards 100000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from shardgate.cluster.placement import ShardPlacement, ShardSpec, place

PARTITIONS = 10


def shard_specs(count: int) -> list[ShardSpec]:
    streams = count // PARTITIONS
    return [
        ShardSpec(f"stream-{stream}", index, reliable=stream % 10 == 0)
        for stream in range(streams) for index in range(PARTITIONS)
    ]


def timed(run: Callable[[], object], repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--shards", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    specs = shard_specs(args.shards)
    nodes = [f"node-{index:03d}" for index in range(args.nodes)]
    load = {node: float(index % 7) for index, node in enumerate(nodes)}
    placed: dict[tuple[str, int], ShardPlacement] = place(specs, {}, nodes[:-1], load)
    scenarios: dict[str, Callable[[], object]] = {
        "initial (all shards new)": lambda: place(specs, {}, nodes, load),
        "join (one node joins)": lambda: place(specs, placed, nodes, load),
        "death (one node dies)": lambda: place(specs, placed, nodes[:-2], load),
        "steady (nothing changed)": lambda: place(specs, placed, nodes[:-1], load),
    }
    print(f"{len(nodes)} nodes, {len(specs)} shards ({PARTITIONS} per stream, 1 stream in 10 reliable)\n")
    print("| scenario | best (s) | median (s) |")
    print("|---|---:|---:|")
    for name, run in scenarios.items():
        best, median = timed(run, args.repeat)
        print(f"| {name} | {best:.3f} | {median:.3f} |")


if __name__ == "__main__":
    main()
