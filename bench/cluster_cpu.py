"""CPU seconds per forwarded message of each node, on the bench's two-node cluster.

Wall-clock throughput on a shared, loaded machine swings 2× between runs; the CPU a node spends
per message does much less, so it is what tells whether a change made the forwarded path
dearer. Starts etcd and two `shardgate serve --cluster` nodes (`_cluster.two_nodes`, the nodes
run by this interpreter, so the `shardgate` of whichever environment runs this script), and
runs the forwarded placement of `run_cluster_bench.py` (publisher on the node that does not own
the default stream's shard, subscriber on the owner; `mqtt_load.py`, QoS 1, window 100)
`--runs` times. For each run it prints one JSON line: the generator's delivered msg/s, and per
node the CPU seconds (utime + stime of its process, less what it spends idle: measured over
`IDLE_S` before the run) and the messages the data plane counted
over the same span (forwarded out of the publisher's node, in at the owner), their quotient in
microseconds, the messages per link frame (the batching), and, on the publisher's node, the
mean round trip of a forwarded batch to the owner's answer and the messages per batch. At the
end, how many times a node logged that it gave up messages held for a peer whose routes it did
not know (never, in a steady cluster).

`--profile DIR` also records both nodes with py-spy (`py-spy record --nonblocking`, 100 Hz)
during the last run, as speedscope files named by role.

Like the other runners it imports nothing from shardgate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _cluster import two_nodes

BENCH = Path(__file__).resolve().parent
LOAD = BENCH / "mqtt_load.py"
CLK_TCK = os.sysconf("SC_CLK_TCK")
IDLE_S = 3.0
UNROUTED_WARNING = "did not reach this node in time"
METRIC = re.compile(r'^shardgate_cluster_(forwarded_messages_total|link_frames_total|forward_latency_seconds_sum'
                    r'|forward_latency_seconds_count)\{(?:direction="(in|out)",)?node="[^"]*"\} (\S+)$')


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (its threads included), from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def counters(http_port: int) -> dict[str, float]:
    """The node's forwarded-message and link-frame counters, as "forwarded_in", "frames_out"..."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = {}
    for line in text.splitlines():
        match = METRIC.match(line)
        if match:
            name = {"forwarded_messages_total": "forwarded", "link_frames_total": "frames",
                    "forward_latency_seconds_sum": "wait_s", "forward_latency_seconds_count": "waits"}[match[1]]
            found[f"{name}_{match[2]}" if match[2] else name] = float(match[3])
    return found


def profile(pid: int, path: Path, seconds: float) -> subprocess.Popen[bytes] | None:
    beside = Path(sys.executable).parent / "py-spy"  # a venv's, run without activating it
    spy = str(beside) if beside.exists() else shutil.which("py-spy") or "py-spy"
    if not Path(spy).exists() and shutil.which(spy) is None:
        print("py-spy not found: no profile", file=sys.stderr)
        return None
    return subprocess.Popen([spy, "record", "--nonblocking", "--rate", "100", "--format", "speedscope",
                             "--duration", str(int(seconds)), "--pid", str(pid), "--output", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def one_run(owner: dict, other: dict, duration: float, window: int, profile_dir: Path | None,
            label: str) -> dict:
    nodes = {"publisher's node": other, "owner": owner}
    # what each node spends with no traffic (timers, its etcd lease, the probes), per second:
    # taken off, so a slow run's fewer messages do not carry more of it each
    idle_start = {role: cpu_seconds(node["pid"]) for role, node in nodes.items()}
    idle_t0 = time.monotonic()
    time.sleep(IDLE_S)
    idle_rate = {role: (cpu_seconds(node["pid"]) - idle_start[role]) / (time.monotonic() - idle_t0)
                 for role, node in nodes.items()}
    t0 = time.monotonic()
    before = {role: (cpu_seconds(node["pid"]), counters(node["http"])) for role, node in nodes.items()}
    spies = []
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
        for role, node in nodes.items():
            name = f"{label}-{'owner' if role == 'owner' else 'publisher'}.speedscope.json"
            spies.append(profile(node["pid"], profile_dir / name, duration + 1))
    cmd = [sys.executable, str(LOAD), "throughput", "--port", str(other["mqtt"]), "--sub-port", str(owner["mqtt"]),
           "--qos", "1", "--window", str(window), "--duration", str(duration), "--warmup", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    after = {role: (cpu_seconds(node["pid"]), counters(node["http"])) for role, node in nodes.items()}
    span = time.monotonic() - t0
    for spy in spies:
        if spy is not None:
            spy.wait(30)
    try:
        load = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        load = {"error": proc.stderr.strip()[-300:]}
    result: dict = {"label": label, "rate": load.get("rate"), "load_avg": round(os.getloadavg()[0], 2)}
    for role, key in (("publisher's node", "forwarded_out"), ("owner", "forwarded_in")):
        cpu = after[role][0] - before[role][0] - idle_rate[role] * span
        delta = {name: after[role][1].get(name, 0.0) - before[role][1].get(name, 0.0) for name in after[role][1]}
        messages = delta.get(key, 0.0)
        frames = delta.get("frames_out" if role != "owner" else "frames_in", 0.0)
        result[role] = {
            "cpu_s": round(cpu, 3), "idle_cpu_per_s": round(idle_rate[role], 3), "messages": int(messages),
            "us_per_message": round(cpu / messages * 1e6, 2) if messages else None,
            "messages_per_frame": round(messages / frames, 1) if frames else None,
        }
        if delta.get("waits"):  # the publisher's node: a forwarded batch's round trip to the owner
            result[role]["batch_round_trip_ms"] = round(delta["wait_s"] / delta["waits"] * 1e3, 3)
            result[role]["messages_per_batch"] = round(messages / delta["waits"], 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    parser.add_argument("--window", type=int, default=100, help="the publisher's QoS 1 window")
    parser.add_argument("--label", default="", help="a name for the lines printed")
    parser.add_argument("--profile", type=Path, help="record both nodes with py-spy in the last run, here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the nodes on the way out
    with tempfile.TemporaryDirectory(prefix="bench-cluster-cpu-") as tmp, \
            two_nodes(Path(tmp), "mqtt", 60) as nodes:
        owner_id = nodes["n1"]["status"]["placement"]["default"][0][0]
        other_id = next(node for node in nodes if node != owner_id)
        for run in range(args.runs):
            last = run == args.runs - 1
            result = one_run(nodes[owner_id], nodes[other_id], args.duration, args.window,
                             args.profile if last else None, args.label or "run")
            result["run"] = run + 1
            print(json.dumps(result), flush=True)
            time.sleep(1.0)
        # an owner holds messages for a peer whose routes it does not know, and gives them up
        # with this warning after 10 s: in a steady cluster it must never appear
        held = sum((Path(tmp) / f"{node}.log").read_text(errors="replace").count(UNROUTED_WARNING)
                   for node in nodes)
        print(json.dumps({"label": args.label or "run", "unrouted_warnings": held}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
