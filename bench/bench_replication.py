"""What replication costs and how fast it fails over: three `shardgate serve --cluster` nodes
and a local etcd on loopback, a reliable stream of one shard.

- **Throughput**: `bench/mqtt_load.py throughput` at QoS 1 (one publisher, one subscriber, both
  on the shard's leader, so no forwarding is measured) on the stream with `replicas = 1`, then,
  on a fresh cluster, with `replicas = 3` and `min_insync_replicas = 2`: an acknowledgement
  then waits until a follower holds the message. Median of `--runs`; the ratio is 3 over 1.
- **Latency**: `bench/mqtt_load.py latency` at 1,000 msg/s QoS 1 on each: p50 and p99.
- **Failover** (3 replicas): a paho-mqtt QoS 1 publisher on a node that does not lead the
  shard publishes one message at a time; the leader is SIGKILLed; the time from the kill to
  the first acknowledgement after it (the forwarding node retries the publish until the new
  leader takes it) is one sample. The killed node is restarted on its data dir and the next
  kill waits until all three replicas are in sync again. `--kills` samples; median and max.

Every node runs with its defaults (lease, fsync policy). Prints a table; `--write` replaces
the `## Replication` section of RESULTS.md. Imports nothing from shardgate.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _cluster import ETCD, Processes, start_etcd
from _proc import free_port, http_json, wait_until
from run_cluster_bench import LOAD, machine, write_section

SECTION = "## Replication"
STREAM = "load"


def stream_config(replicas: int) -> str:
    insync = "min_insync_replicas = 2\n" if replicas > 1 else ""
    return (f'[[streams]]\nname = "{STREAM}"\nmode = "reliable"\npartitions = 1\n'
            f'routes = ["bench/#"]\nreplicas = {replicas}\n{insync}')


class Cluster:
    """etcd and three nodes on fixed ports, so that a killed node restarts as itself."""

    def __init__(self, workdir: Path, replicas: int, count: int = 3) -> None:
        self.workdir, self.replicas = workdir, replicas
        self.procs = Processes(workdir)
        self.etcd = start_etcd(self.procs)
        config = workdir / "streams.toml"
        config.write_text(stream_config(replicas))
        self.nodes: dict[str, dict[str, Any]] = {}
        for index in range(count):
            name = f"n{index + 1}"
            self.nodes[name] = {"mqtt": free_port(), "http": free_port(), "config": config}
            self.start(name)
        wait_until(self.settled, 120, "the cluster")

    def start(self, name: str) -> None:
        node = self.nodes[name]
        node["proc"] = self.procs.start(f"{name}-{int(time.time())}", [
            sys.executable, "-m", "shardgate", "serve", "--config", str(node["config"]),
            "--cluster", self.etcd, "--node-id", name, "--cluster-port", "0",
            "--host", "127.0.0.1", "--mqtt-port", str(node["mqtt"]), "--mqtt-ws-port", "0",
            "--grpc-port", "0", "--amqp-port", "0", "--http-port", str(node["http"]),
            "--data-dir", str(self.workdir / name)])

    def status(self, name: str) -> dict[str, Any]:
        return http_json(f"http://127.0.0.1:{self.nodes[name]['http']}/api/cluster")

    def shard(self, asked: str) -> dict[str, Any]:
        return self.status(asked)["replicas"][STREAM][0]

    def settled(self, asked: str | None = None) -> str | None:
        """The shard's leader once every node is live and (with replicas) all are in sync."""
        for name in ([asked] if asked else list(self.nodes)):
            status = self.status(name)
            if len(status["nodes"]) != len(self.nodes) or status["unavailable_shards"]:
                return None
            placed = status["replicas"].get(STREAM, [None])[0]
            if placed is None:
                return None
            if self.replicas > 1 and len(placed["isr"]) != self.replicas:
                return None
        return str(self.shard(asked or "n1")["leader"])

    def stop(self) -> None:
        self.procs.stop()


def load(mode: str, port: int, extra: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, str(LOAD), mode, "--port", str(port), *extra],
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "error" in result:
        raise RuntimeError(f"{mode} failed: {result['error']}")
    return result


class Publisher(threading.Thread):
    """One QoS 1 message at a time; the monotonic time of every acknowledgement."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        import paho.mqtt.client as mqtt

        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"failover-{port}",
                                  protocol=mqtt.MQTTv311)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.acks: list[float] = []
        self.running = True

    def run(self) -> None:
        sequence = 0
        while self.running:
            sequence += 1
            info = self.client.publish("bench/failover", str(sequence), qos=1)
            try:
                info.wait_for_publish(timeout=60)
            except (RuntimeError, ValueError):
                time.sleep(0.05)  # not connected for a moment: paho resends after reconnecting
                continue
            if info.is_published():
                self.acks.append(time.monotonic())

    def first_ack_after(self, instant: float, timeout: float = 60) -> float:
        """The first acknowledgement after `instant` (the list grows in time order)."""
        def found() -> float | None:
            index = bisect.bisect_right(self.acks, instant)
            return self.acks[index] if index < len(self.acks) else None
        return float(wait_until(found, timeout, "an acknowledgement after the kill"))

    def stop(self) -> None:
        self.running = False
        self.join(70)
        self.client.loop_stop()
        self.client.disconnect()


def failovers(cluster: Cluster, kills: int, log: Any) -> list[float]:
    samples = []
    for kill in range(kills):
        leader = wait_until(cluster.settled, 180, "all replicas in sync")
        other = next(name for name in cluster.nodes if name != leader)
        publisher = Publisher(cluster.nodes[other]["mqtt"])
        publisher.start()
        try:
            wait_until(lambda p=publisher: len(p.acks) >= 200, 60, "200 acknowledgements")
            proc = cluster.nodes[leader]["proc"]
            killed_at = time.monotonic()
            proc.kill()
            first = publisher.first_ack_after(killed_at)
        finally:
            publisher.stop()
        proc.wait(10)
        samples.append(first - killed_at)
        log(f"kill {kill + 1}: leader {leader} SIGKILLed, first acknowledgement after "
            f"{samples[-1]:.2f} s")
        cluster.start(leader)
    return samples


def measure(replicas: int, runs: int, duration: float, kills: int, log: Any) -> dict[str, Any]:
    found: dict[str, Any] = {"rates": [], "p50": [], "p99": [], "failover": []}
    with tempfile.TemporaryDirectory(prefix="bench-replication-") as tmp:
        cluster = Cluster(Path(tmp), replicas)
        try:
            leader = wait_until(cluster.settled, 120, "the cluster")
            port = cluster.nodes[leader]["mqtt"]
            for run in range(runs):
                result = load("throughput", port, ["--qos", "1", "--window", "100",
                                                   "--duration", str(duration), "--warmup", "1"])
                found["rates"].append(float(result["rate"]))
                log(f"{replicas} replica(s) run {run + 1}: {result['rate']:,.0f} msg/s QoS 1")
                result = load("latency", port, ["--qos", "1", "--rate", "1000",
                                                "--duration", str(duration), "--warmup", "1"])
                found["p50"].append(float(result["p50_ms"]))
                found["p99"].append(float(result["p99_ms"]))
                log(f"{replicas} replica(s) run {run + 1}: p50 {result['p50_ms']} ms, "
                    f"p99 {result['p99_ms']} ms at 1,000 msg/s")
            if replicas > 1 and kills:
                found["failover"] = failovers(cluster, kills, log)
        finally:
            cluster.stop()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--write", action="store_true", help="replace the section in RESULTS.md")
    args = parser.parse_args(argv)
    if not Path(ETCD).exists():
        print("etcd is not installed (apt-get install etcd-server)", file=sys.stderr)
        return 2

    def log(text: str) -> None:
        print(f"{text} (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)

    about = machine()
    one = measure(1, args.runs, args.duration, 0, log)
    three = measure(3, args.runs, args.duration, args.kills, log)
    median = statistics.median
    rows = ["| stream | QoS 1 msg/s (median) | p50 ms at 1,000 msg/s | p99 ms at 1,000 msg/s |",
            "|---|---:|---:|---:|"]
    for label, found in (("1 replica", one), ("3 replicas, min 2 in sync", three)):
        rows.append(f"| {label} | {median(found['rates']):,.0f} | {median(found['p50']):.2f} | "
                    f"{median(found['p99']):.2f} |")
    ratio = median(three["rates"]) / median(one["rates"])
    lines = [*rows, "", f"Throughput with 3 replicas: {ratio:.2f}× of 1 replica."]
    if three["failover"]:
        lines.append(f"Failover over {len(three['failover'])} SIGKILLs of the leader: median "
                     f"{median(three['failover']):.2f} s, max {max(three['failover']):.2f} s "
                     f"(samples: {', '.join(f'{s:.2f}' for s in three['failover'])}).")
    text = "\n".join(lines)
    print(text)
    if args.write:
        command = "python bench/bench_replication.py " + " ".join(argv if argv is not None else sys.argv[1:])
        runs = "\n".join(f"| {label} | {' / '.join(f'{v:,.0f}' for v in found['rates'])} | "
                         f"{' / '.join(f'{v:.2f}' for v in found['p99'])} |"
                         for label, found in (("1 replica", one), ("3 replicas", three)))
        write_section(f"""{SECTION}

Recorded by `{command.strip()}` (method: the docstring of `bench/bench_replication.py`).

- Machine: {about}.

{text}

| stream | QoS 1 runs (msg/s) | p99 runs (ms) |
|---|---|---|
{runs}
""", heading=SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
