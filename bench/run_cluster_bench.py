"""Cross-node publish → subscribe against same-node, on a two-node cluster on this machine.

Starts a real etcd (Debian's `etcd-server`) and two `shardgate serve --cluster` nodes on
loopback, finds which node owns the default stream's shard (`/api/cluster`), and runs
`bench/mqtt_load.py` (raw MQTT 3.1.1, 64-byte payloads, the serve defaults: a journaled default
stream) in three placements of the publisher and the subscriber:

- same node: both on the shard's owner (what a single node does, plus the cluster's checks);
- forwarded: the publisher on the other node, which forwards each publish to the owner, the
  subscriber on the owner;
- pushed: the publisher on the owner, the subscriber on the other node, to which the owner
  pushes each stored message.

For each: QoS 0 and QoS 1 throughput (1 → 1), and the latency of QoS 1 at a fixed 5,000 msg/s
(p50 / p99 at the subscriber). `--write` replaces the `## Cluster` section of RESULTS.md.

Like the other runners it only starts processes and reads their output; it imports nothing
from shardgate.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _cluster import ETCD, two_nodes

BENCH = Path(__file__).resolve().parent
LOAD = BENCH / "mqtt_load.py"
RESULTS = BENCH / "RESULTS.md"
SECTION = "## Cluster data path"
START_TIMEOUT = 60.0


@contextlib.contextmanager
def two_node_cluster(warnings: list[str]) -> Iterator[dict[str, dict[str, Any]]]:
    """Yield {node id: {"mqtt": port, "http": port, "pid": pid}} once both serve and the
    default stream is placed; the nodes' warnings and errors go to `warnings` at the end."""
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        workdir = Path(tmp)
        try:
            with two_nodes(workdir, "mqtt", START_TIMEOUT) as nodes:
                yield nodes
        finally:
            for node_id in ("n1", "n2"):  # what went wrong, if anything, before the logs go
                path = workdir / f"{node_id}.log"
                lines = path.read_text(errors="replace").splitlines() if path.exists() else []
                for line in [ln for ln in lines if " WARNING " in ln or " ERROR " in ln]:
                    warnings.append(f"{node_id}: {line}")


def run_load(mode: str, pub: dict[str, Any], sub: dict[str, Any], pids: list[int],
             args: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, str(LOAD), mode, "--port", str(pub["mqtt"]), "--sub-port", str(sub["mqtt"]),
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"generator exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    return result


# In this order: an overloaded QoS 0 run leaves a backlog behind, so it comes last (and the
# runner pauses after it).
SCENARIOS = (
    ("lat50", "latency", ["--qos", "1", "--rate", "5000"], "p50_ms", "QoS 1 latency p50 at 5,000 msg/s (ms)"),
    ("lat99", "latency", ["--qos", "1", "--rate", "5000"], "p99_ms", "QoS 1 latency p99 at 5,000 msg/s (ms)"),
    ("qos1", "throughput", ["--qos", "1", "--window", "100"], "rate", "QoS 1 throughput, 1 → 1, window 100 (msg/s)"),
    ("qos0", "throughput", ["--qos", "0"], "rate", "QoS 0 throughput, 1 → 1 (msg/s)"),
)
SETTLE_S = 3.0
PLACEMENTS = ("same node", "forwarded", "pushed")


def measure(runs: int, duration: float, log: Any) -> tuple[dict[tuple[str, str], list[float]], dict[str, Any]]:
    values: dict[tuple[str, str], list[float]] = {}
    info: dict[str, Any] = {"warnings": [], "machine": machine()}
    with two_node_cluster(info["warnings"]) as nodes:
        status = nodes["n1"]["status"]
        owner_id = status["placement"]["default"][0][0]
        other_id = next(node for node in nodes if node != owner_id)
        owner, other = nodes[owner_id], nodes[other_id]
        info["owner"] = owner_id
        pids = [owner["pid"], other["pid"]]
        where = {"same node": (owner, owner), "forwarded": (other, owner), "pushed": (owner, other)}
        done_latency: dict[str, dict[str, Any]] = {}
        for run in range(runs):
            for placement in PLACEMENTS:
                pub, sub = where[placement]
                for key, mode, args, field, _title in SCENARIOS:
                    if key == "lat99":
                        result = done_latency[placement]
                    else:
                        result = run_load(mode, pub, sub, pids,
                                          [*args, "--duration", str(duration), "--warmup", "1"])
                        if mode == "latency":
                            done_latency[placement] = result
                        if key == "qos0":
                            time.sleep(SETTLE_S)
                    log(f"run {run + 1} {placement} {key}: {json.dumps(result)}")
                    value = result.get(field)
                    if isinstance(value, int | float):
                        values.setdefault((placement, key), []).append(float(value))
    for line in info["warnings"][:40]:
        log(line)
    return values, info


def table(values: dict[tuple[str, str], list[float]]) -> str:
    lines = ["| scenario | same node | forwarded | pushed | cross-node / same-node |",
             "|---|---:|---:|---:|---:|"]
    for key, _mode, _args, _field, title in SCENARIOS:
        cells = []
        medians = {}
        for placement in PLACEMENTS:
            runs = values.get((placement, key), [])
            medians[placement] = statistics.median(runs) if runs else None
            value = medians[placement]
            cells.append("—" if value is None else (f"{value:,.0f}" if "throughput" in title else f"{value:.3f}"))
        same = medians["same node"]
        worst = [m for m in (medians["forwarded"], medians["pushed"]) if m is not None]
        if same and worst:
            cross = min(worst) if "throughput" in title else max(worst)
            ratio = f"{cross / same:.2f}×"
        else:
            ratio = "—"
        lines.append(f"| {title} | {' | '.join(cells)} | {ratio} |")
    return "\n".join(lines)


def machine() -> str:
    load = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    return (f"{len(os.sched_getaffinity(0))} CPUs; Linux {platform.release()}; Python "
            f"{platform.python_version()}; {dt.date.today().isoformat()}; load average at start {load}")


def section(command: str, text: str, info: dict[str, Any], values: dict[tuple[str, str], list[float]]) -> str:
    runs = "\n".join(
        f"| {placement} | {key} | {' / '.join(f'{v:,.3f}' if v < 100 else f'{v:,.0f}' for v in found)} |"
        for (placement, key), found in sorted(values.items())
    )
    return f"""{SECTION}

Recorded by `{command}` (method: [README.md](README.md#cluster-data-path)).

- Machine: {info.get("machine") or machine()}.
- Two `shardgate serve --cluster` nodes and etcd on this machine, no CPU pinning; the
  generator (`bench/mqtt_load.py`) on the same cores. The default stream's shard was owned by
  {info.get('owner', '?')}.
- same node: publisher and subscriber on the owner; forwarded: publisher on the other node
  (each publish forwarded to the owner over the cluster port, acknowledged once the owner has
  it in its journal); pushed: subscriber on the other node (the owner pushes each message).
  The last column is the worse of the two cross-node placements over same node.
{_lease_note(info)}- QoS 0 at full speed overloads the broker on this machine: the subscriber may get nothing in
  the window (a 0 in the table), and what a node does then is not a cross-node effect.

{text}

<details><summary>Every run</summary>

| placement | scenario | runs |
|---|---|---|
{runs}

</details>
"""


def _lease_note(info: dict[str, Any]) -> str:
    expired = sum("lease of node" in line and "expired" in line for line in info.get("warnings", []))
    if not expired:
        return "- No node lost its etcd lease during the runs: the placements held throughout.\n"
    return (f"- A node's etcd lease expired {expired} times during the runs (its event loop too busy "
            "to refresh it in time): the shard moved between the nodes, so for part of some runs "
            "the placement was not the one named.\n")


def write_section(text: str, path: Path = RESULTS, heading: str = SECTION) -> None:
    """Replace the section under `heading` in `path` with `text` (appended if absent)."""
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = old.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        before = "\n".join(lines[:start]).rstrip("\n")
        after = "\n".join(lines[end:])
        new = (before + "\n\n" if before else "") + text.rstrip("\n") + "\n"
        if after:
            new += "\n" + after.rstrip("\n") + "\n"
    path.write_text(new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per scenario (median shown)")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    parser.add_argument("--write", action="store_true", help="replace the Cluster section of RESULTS.md")
    args = parser.parse_args(argv)
    if not Path(ETCD).exists():
        print("etcd is not installed (apt-get install etcd-server)", file=sys.stderr)
        return 2

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    values, info = measure(args.runs, args.duration, log)
    text = table(values)
    print(text)
    if args.write:
        command = "python bench/run_cluster_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section(section(command.strip(), text, info, values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
