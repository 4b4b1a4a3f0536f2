"""Where the memory kept after a load sits: pymalloc's arenas at start, peak and idle, and the
objects that keep the load's arenas.

Runs `bench/soak.py` (its arguments pass through) with `bench/bench_memory_probe` on the
broker's ``PYTHONPATH``; the probe samples the broker (see its docstring) into a JSON-lines
file, and this script prints, from it, the baseline, the peak and the last idle sample (after
the broker's idle release), then what sits in the mappings made since the baseline: how many
live small objects, in how many 16 KiB pools, by kind and by holder.

    python bench/bench_memory_arenas.py -- --minutes 1.5 --clients 200 --rounds 1 --settle 25
    python bench/bench_memory_arenas.py --read /tmp/probe.jsonl   # print a recorded run

The soak's own report (RSS baseline, peak, final) is printed before this summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 1 << 20


def summarize(path: Path) -> str:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    baseline = next((r for r in records if r.get("event") == "baseline"), None)
    idle = [r for r in records if r.get("event") == "idle"]
    if baseline is None or not idle:
        return f"{path}: no baseline or no idle sample (the load did not start or not end)"
    peak = max(records, key=lambda r: r["blocks"])
    last = idle[-1]

    def row(name: str, r: dict) -> str:
        return (f"| {name} | {r['t']} | {r['blocks']:,} | {r['arenas_allocated_current']} "
                f"({r['arenas_highwater_mark']}) | {r['bytes_in_allocated_blocks'] / MIB:.1f} | "
                f"{r['bytes_in_available_blocks'] / MIB:.1f} | {r['unused_pool_bytes'] / MIB:.1f} | "
                f"{r['rss_anon_kib'] / 1024:.1f} |")

    lines = [
        "| sample | t (s) | blocks | arenas (high-water) | MiB in blocks | MiB free in pools "
        "| MiB in unused pools | RssAnon (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        row("baseline", baseline), row("peak blocks", peak), row("last idle", last),
        "",
        f"Mappings made since the baseline: {last['new_mapping_kib'] / 1024:.1f} MiB, holding "
        f"{last['pinned_objects']:,} live small objects in {last['pinned_pools']} pools of 16 KiB.",
        "By kind: " + ", ".join(f"{kind} {count}" for kind, count in last["kinds"]),
        "By holder:",
        *(f"- {holder}: {count}" for holder, count in last["holders"]),
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--read", type=Path, help="print the summary of a recorded probe file")
    parser.add_argument("--out", type=Path, help="where the probe writes (default: a temp file)")
    parser.add_argument("soak_args", nargs="*", help="arguments for bench/soak.py (after --)")
    args = parser.parse_args()
    if args.read:
        print(summarize(args.read))
        return 0
    out = args.out or Path(tempfile.mkstemp(prefix="memory-probe-", suffix=".jsonl")[1])
    out.write_text("")
    env = dict(os.environ, BENCH_MEMORY_PROBE_OUT=str(out))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE / "bench_memory_probe"), env.get("PYTHONPATH")) if p)
    code = subprocess.call([sys.executable, str(HERE / "soak.py"), *args.soak_args], env=env)
    print(f"\nprobe: {out}")
    print(summarize(out))
    return code


if __name__ == "__main__":
    sys.exit(main())
