"""Loop `bench_replication.py`'s failover (SIGKILL of a replicated shard's leader while a
paho-mqtt QoS 1 publisher on another node publishes one message at a time) until a kill's
first acknowledgement by the new leader misses its deadline, and keep what explains it.

Each round starts a fresh three-node cluster (etcd on loopback, a stream of 1 shard,
3 replicas, 2 in sync), puts the bench's throughput load on the leader (as the bench does
before its first kill), then kills the leader `--kills` times, restarting it on its data dir
after each. When a kill has no acknowledgement within `--deadline` seconds, the work
directory is kept (every node's and etcd's log, the data dirs), with:
- `etcd-dump.txt` / `etcd-dump.json`: every key of etcd at the deadline;
- `status-<node>.json`: each live node's `/api/cluster` at the deadline;
- `publisher.log`: the publisher's paho events (connects, disconnects, each publish and
  acknowledgement with its monotonic time) and the kill's time;
and the loop stops after watching `--watch` more seconds for a late acknowledgement.

A diagnosis tool, not a benchmark: it prints no figures for RESULTS.md. Imports nothing from
shardgate.

    python bench/failover_loop.py --rounds 20 --kills 5 --deadline 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _cluster import Processes, start_etcd
from _proc import free_port, http_json, wait_until
from bench_replication import Cluster, load, stream_config


class LoopCluster(Cluster):
    """The bench's cluster of three nodes and 3 replicas, not waited for here: the loop waits,
    and keeps what it finds when it never settles."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.replicas = workdir, 3
        self.procs = Processes(workdir)
        self.etcd = start_etcd(self.procs)
        config = workdir / "streams.toml"
        config.write_text(stream_config(3))
        self.nodes = {}
        for index in range(3):
            name = f"n{index + 1}"
            self.nodes[name] = {"mqtt": free_port(), "http": free_port(), "config": config}
            self.start(name)


class TracedPublisher(threading.Thread):
    """The bench's publisher (one QoS 1 message at a time, paho 3.1.1 with its automatic
    reconnect), writing every event to a list of (monotonic time, text)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        import paho.mqtt.client as mqtt

        self.events: list[tuple[float, str]] = []
        self.acks: list[float] = []
        self.running = True
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"failover-{port}",
                                  protocol=mqtt.MQTTv311)
        self.client.on_connect = lambda c, u, f, rc, p=None: self.note(f"connected {rc}")
        self.client.on_disconnect = lambda c, u, f, rc, p=None: self.note(f"disconnected {rc}")
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def note(self, text: str) -> None:
        self.events.append((time.monotonic(), text))

    def run(self) -> None:
        sequence = 0
        while self.running:
            sequence += 1
            info = self.client.publish("bench/failover", str(sequence), qos=1)
            self.note(f"publish {sequence} mid {info.mid} rc {info.rc}")
            try:
                info.wait_for_publish(timeout=60)
            except (RuntimeError, ValueError) as exc:
                self.note(f"publish {sequence}: {exc!r}")
                time.sleep(0.05)
                continue
            if info.is_published():
                self.acks.append(time.monotonic())
                if sequence % 50 == 0 or len(self.acks) < 3:
                    self.note(f"ack {sequence}")
            else:
                self.note(f"publish {sequence}: no acknowledgement in 60 s")

    def ack_after(self, instant: float) -> float | None:
        return next((t for t in reversed(self.acks) if t > instant), None) if self.acks and \
            self.acks[-1] > instant else None

    def stop(self) -> None:
        self.running = False
        self.join(70)
        self.client.loop_stop()
        self.client.disconnect()


def dump(cluster: Cluster, keep: Path, publisher: TracedPublisher, killed_at: float,
         leader: str) -> None:
    dump_state(cluster, keep, skip=leader)
    lines = [f"{t - killed_at:+9.3f} {text}" for t, text in list(publisher.events)]
    (keep / "publisher.log").write_text(f"killed {leader} at 0\n" + "\n".join(lines) + "\n")


def dump_state(cluster: Cluster, keep: Path, skip: str | None = None) -> None:
    """etcd's keys and each live node's /api/cluster, into `keep`."""
    keep.mkdir(parents=True, exist_ok=True)
    etcdctl = shutil.which("etcdctl") or "/usr/bin/etcdctl"
    for fmt, name in (("simple", "etcd-dump.txt"), ("json", "etcd-dump.json")):
        out = subprocess.run([etcdctl, "--endpoints", cluster.etcd, "get", "", "--prefix", "-w", fmt],
                             capture_output=True, timeout=30)
        (keep / name).write_bytes(out.stdout + out.stderr)
    for name in cluster.nodes:
        if name == skip:
            continue
        try:
            status = http_json(f"http://127.0.0.1:{cluster.nodes[name]['http']}/api/cluster")
        except (OSError, ValueError) as exc:
            status = {"error": repr(exc)}
        (keep / f"status-{name}.json").write_text(json.dumps(status, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--deadline", type=float, default=10.0)
    parser.add_argument("--watch", type=float, default=60.0)
    parser.add_argument("--load", type=float, default=3.0, help="seconds of each load run")
    parser.add_argument("--load-runs", type=int, default=1,
                        help="throughput then latency loads (as the bench's --runs) first")
    parser.add_argument("--keep", default="/tmp/failover-caught")
    args = parser.parse_args(argv)

    def log(text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {text} (load {os.getloadavg()[0]:.2f})", flush=True)

    for round_ in range(args.rounds):
        workdir = Path(tempfile.mkdtemp(prefix="failover-loop-"))
        caught = False
        cluster = LoopCluster(workdir)
        try:
            leader = wait_until(cluster.settled, 120, "the cluster")
            if args.load:
                for _ in range(args.load_runs):
                    load("throughput", cluster.nodes[leader]["mqtt"], [
                        "--qos", "1", "--window", "100", "--duration", str(args.load), "--warmup", "1"])
                    load("latency", cluster.nodes[leader]["mqtt"], [
                        "--qos", "1", "--rate", "1000", "--duration", str(args.load), "--warmup", "1"])
            for kill in range(args.kills):
                leader = wait_until(cluster.settled, 180, "all replicas in sync")
                other = next(name for name in cluster.nodes if name != leader)
                publisher = TracedPublisher(cluster.nodes[other]["mqtt"])
                publisher.start()
                try:
                    wait_until(lambda p=publisher: len(p.acks) >= 200, 60, "200 acknowledgements")
                    proc = cluster.nodes[leader]["proc"]
                    killed_at = time.monotonic()
                    publisher.note("kill")
                    proc.kill()
                    deadline = killed_at + args.deadline
                    while publisher.ack_after(killed_at) is None and time.monotonic() < deadline:
                        time.sleep(0.02)
                    first = publisher.ack_after(killed_at)
                    if first is None:
                        keep = Path(args.keep) / f"{time.strftime('%H%M%S')}-r{round_}-k{kill}"
                        log(f"round {round_ + 1} kill {kill + 1}: leader {leader} killed, no "
                            f"acknowledgement on {other} in {args.deadline:.0f} s: keeping {keep}")
                        dump(cluster, keep / "at-deadline", publisher, killed_at, leader)
                        end = killed_at + args.deadline + args.watch
                        while publisher.ack_after(killed_at) is None and time.monotonic() < end:
                            time.sleep(0.1)
                        late = publisher.ack_after(killed_at)
                        log("late acknowledgement after "
                            f"{late - killed_at:.2f} s" if late else f"still none after {args.watch:.0f} s more")
                        dump(cluster, keep / "after-watch", publisher, killed_at, leader)
                        caught = True
                        return_keep = keep
                        break
                    log(f"round {round_ + 1} kill {kill + 1}: leader {leader} killed, first "
                        f"acknowledgement on {other} after {first - killed_at:.2f} s")
                finally:
                    publisher.stop()
                proc.wait(10)
                cluster.start(leader)
        except (RuntimeError, OSError, ValueError) as exc:
            # a cluster that never settled (or a kill's restart that never caught up) is kept too
            caught = True
            return_keep = Path(args.keep) / f"{time.strftime('%H%M%S')}-r{round_}-stuck"
            log(f"round {round_ + 1}: {exc!r}: keeping {return_keep}")
            return_keep.mkdir(parents=True, exist_ok=True)
            dump_state(cluster, return_keep / "at-error")
        finally:
            cluster.stop()
            if caught:
                shutil.copytree(workdir, return_keep / "workdir", dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("*.seg", "*.log.idx"))
            shutil.rmtree(workdir, ignore_errors=True)
        if caught:
            return 1
    log(f"no kill missed its deadline in {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
