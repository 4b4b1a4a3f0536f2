"""N cluster nodes on N cores against one node on one core, on this machine.

One `shardgate serve` pinned to core 0 (`taskset`), then a cluster of as many
`shardgate serve --cluster` nodes as the machine has cores (at most `--nodes`), node i pinned
to core i, with a local etcd. The same load runs against both: `--generators` copies of
`bench/mqtt_load.py throughput` at once, each one publisher → one subscriber on a topic of its
own (64-byte payloads) on a stream of 8 shards (memory-only, so the disk does not decide the
result; placed across the nodes by the controller). On the cluster the clients are spread by
listing every node's address: generator i connects its publisher and its subscriber to node
i mod N, so a message is stored on its shard's owner, which may be another node (forwarded,
then pushed back). The generators are not pinned: on a machine with as many cores as nodes they
compete with the nodes for CPU, which the result shows.

Prints the summed delivered msg/s for each (QoS 0 and QoS 1, median of `--runs`), and with
`--write` replaces the `## Cluster: N nodes on N cores` section of RESULTS.md. Imports nothing
from shardgate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _cluster import ETCD, Processes, start_etcd
from _proc import free_port, http_json, wait_until
from run_cluster_bench import LOAD, machine, write_section

SECTION = "## Cluster: N nodes on N cores"
CONFIG = """
[[streams]]
name = "load"
mode = "non-reliable"
partitions = 8
routes = ["bench/#"]
"""
QOS_ARGS = {0: ["--qos", "0"], 1: ["--qos", "1", "--window", "100"]}


def pinned(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if shutil.which("taskset") else []


def serve_args(workdir: Path, name: str, mqtt: int, http: int) -> list[str]:
    config = workdir / f"{name}.toml"
    config.write_text(CONFIG)
    return [sys.executable, "-m", "shardgate", "serve", "--config", str(config), "--host", "127.0.0.1",
            "--mqtt-port", str(mqtt), "--mqtt-ws-port", "0", "--grpc-port", "0", "--amqp-port", "0",
            "--http-port", str(http), "--data-dir", str(workdir / name)]


def start_single(procs: Processes, workdir: Path) -> list[dict[str, Any]]:
    mqtt, http = free_port(), free_port()
    procs.start("single", [*pinned(0), *serve_args(workdir, "single", mqtt, http)])
    wait_until(lambda: http_json(f"http://127.0.0.1:{http}/api/info"), 60, "the single node")
    return [{"mqtt": mqtt, "http": http}]


def start_cluster(procs: Processes, workdir: Path, count: int) -> list[dict[str, Any]]:
    url = start_etcd(procs)
    nodes = []
    for index in range(count):
        name, mqtt, http = f"n{index + 1}", free_port(), free_port()
        procs.start(name, [*pinned(index), *serve_args(workdir, name, mqtt, http),
                           "--cluster", url, "--node-id", name, "--cluster-port", "0"])
        nodes.append({"mqtt": mqtt, "http": http, "name": name})

    def placed() -> bool:
        for node in nodes:
            status = http_json(f"http://127.0.0.1:{node['http']}/api/cluster")
            shards = status["placement"].get("load", [])
            if len(status["nodes"]) != count or len(shards) != 8:
                return False
            if len({owner for owner, _epoch in shards}) != count:
                return False  # not balanced yet
        return True

    wait_until(placed, 60, "the cluster")
    time.sleep(1.0)  # the links and routes settle after the placement
    return nodes


def run_generators(nodes: list[dict[str, Any]], generators: int, qos: int, duration: float) -> float:
    """Summed delivered msg/s of `generators` concurrent 1 → 1 loads, spread over `nodes`."""
    procs = []
    for index in range(generators):
        node = nodes[index % len(nodes)]
        procs.append(subprocess.Popen(
            [sys.executable, str(LOAD), "throughput", "--port", str(node["mqtt"]),
             *QOS_ARGS[qos], "--duration", str(duration), "--warmup", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL))
    total = 0.0
    for proc in procs:
        out, err = proc.communicate(timeout=duration + 120)
        try:
            result = json.loads(out.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            raise RuntimeError(f"generator failed: {err.strip()[-300:]}") from None
        if "error" in result:
            raise RuntimeError(f"generator failed: {result['error']}")
        total += float(result["rate"])
    return total


def measure(setup: str, count: int, generators: int, runs: int, duration: float,
            log: Any) -> dict[int, list[float]]:
    found: dict[int, list[float]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        workdir = Path(tmp)
        procs = Processes(workdir)
        try:
            nodes = start_single(procs, workdir) if setup == "single" else start_cluster(procs, workdir, count)
            for run in range(runs):
                for qos in (1, 0):  # QoS 0 last: an overloaded run leaves a backlog behind
                    rate = run_generators(nodes, generators, qos, duration)
                    found[qos].append(rate)
                    log(f"{setup} run {run + 1} QoS {qos}: {rate:,.0f} msg/s")
                    time.sleep(2.0)
        finally:
            procs.stop()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=os.cpu_count() or 2, help="cluster nodes (one per core)")
    parser.add_argument("--generators", type=int, default=4, help="concurrent 1 → 1 loads")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--write", action="store_true", help="replace the section in RESULTS.md")
    args = parser.parse_args(argv)
    count = min(args.nodes, len(os.sched_getaffinity(0)))
    if not Path(ETCD).exists():
        print("etcd is not installed (apt-get install etcd-server)", file=sys.stderr)
        return 2

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    about = machine()
    single = measure("single", 1, args.generators, args.runs, args.duration, log)
    cluster = measure("cluster", count, args.generators, args.runs, args.duration, log)
    rows = ["| load | one node, one core (msg/s) | "
            f"{count} nodes, {count} cores (msg/s) | ratio |", "|---|---:|---:|---:|"]
    for qos in (0, 1):
        one, many = statistics.median(single[qos]), statistics.median(cluster[qos])
        rows.append(f"| QoS {qos}, {args.generators} × (1 → 1) | {one:,.0f} | {many:,.0f} | "
                    f"{many / one:.2f}× |")
    text = "\n".join(rows)
    print(text)
    if args.write:
        command = "python bench/cluster_scaling.py " + " ".join(argv if argv is not None else sys.argv[1:])
        every = "\n".join(
            f"| {name} | QoS {qos} | {' / '.join(f'{v:,.0f}' for v in values[qos])} |"
            for name, values in (("one node", single), ("cluster", cluster)) for qos in (0, 1))
        write_section(f"""{SECTION}

Recorded by `{command.strip()}` (method: the docstring of `bench/cluster_scaling.py`).

- Machine: {about}.
- One node pinned to core 0, against {count} cluster nodes pinned one per core with a local
  etcd; {args.generators} generator processes (`bench/mqtt_load.py throughput`, one publisher
  and one subscriber each, on a topic of their own, on a memory-only stream of 8 shards),
  spread over the nodes by address, not pinned: they compete with the nodes for the cores.

{text}

| setup | load | runs (msg/s) |
|---|---|---|
{every}
""", heading=SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
