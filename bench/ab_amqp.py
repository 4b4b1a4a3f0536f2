"""A/B of the AMQP broker path: the same workload on an earlier Shardgate revision and on this
checkout, interleaved round by round.

For each round each build runs one `bench_amqp.py` mode (one publisher and one consumer process)
on its own `shardgate serve`; the report gives messages per second and the server process's CPU
time per message (user + system), which a machine loaded by other work disturbs much less than
wall-clock throughput. The earlier revision is taken with `git archive` into a temporary
directory and put first on PYTHONPATH (laid out as `pyproject.toml`'s package-dir says), so
nothing is checked out or installed. `--after REV` takes the other side from a revision the
same way (both sides then run as plain Python, without this checkout's compiled modules), and
`--fsync` sets the journal's fsync policy of both (the default stream is reliable). Run:
`python bench/ab_amqp.py --before 6002853 --mode plain --rounds 5`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from bench_amqp import free_port, run_mode, wait_port  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def export_revision(revision: str, into: Path) -> Path:
    """`revision`'s tree under `into`, importable as `shardgate`; returns the PYTHONPATH entry."""
    tree = into / "tree"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(BENCH_DIR.parent), "archive", "--format=tar", revision],
        check=True, capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    layout = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = into / "path" / "shardgate"
    package.mkdir(parents=True)
    for entry in (tree / layout["shardgate"]).iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in layout.items():
        if name != "shardgate":
            link = package / name.split(".", 1)[1]
            if link.exists() or link.is_symlink():
                link.unlink()
            link.symlink_to(tree / folder)
    return into / "path"


@contextlib.contextmanager
def serve(workdir: Path, pythonpath: str | None,
          fsync: str = "interval") -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    env["SHARDGATE_JOURNAL__FSYNC"] = fsync
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    log = open(workdir / "shardgate.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(workdir / "data"),
         "--host", "127.0.0.1", "--mqtt-port", str(free_port()), "--mqtt-ws-port", "0",
         "--amqp-port", str(port), "--grpc-port", "0", "--http-port", "0", "--log-level", "warning"],
        env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT,
        cwd=workdir,  # `-m` puts the working directory first on sys.path: not a checkout
    )
    log.close()
    try:
        wait_port(port, proc, 60)
        yield proc, port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="git revision to compare against")
    parser.add_argument("--after", default=None, help="git revision (default: this checkout)")
    parser.add_argument("--fsync", default="interval", help="journal.fsync policy of both")
    parser.add_argument("--mode", default="plain", choices=("plain", "confirms+acks"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--window", type=int, default=1024)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="ab-amqp-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        for name in ("before", "after"):
            (root / name).mkdir()
        before_path = export_revision(args.before, root / "before")
        after_path = export_revision(args.after, root / "after") if args.after else None
        builds = {
            "before": stack.enter_context(serve(root / "before", str(before_path), args.fsync)),
            "after": stack.enter_context(
                serve(root / "after", str(after_path) if after_path else None, args.fsync)),
        }
        for round_ in range(args.rounds):
            for name, (proc, port) in builds.items():
                start = cpu_seconds(proc.pid)
                result = run_mode(port, args.mode, args.messages, args.size, args.window, 180,
                                  tag=f"ab{round_}")
                cpu_us = (cpu_seconds(proc.pid) - start) / args.messages * 1e6
                results[name].append((result["msgs_per_s"], cpu_us))
                print(f"round {round_ + 1} {name:6s} {result['msgs_per_s']:8,.0f} msg/s "
                      f"{cpu_us:6.1f} µs CPU/msg", flush=True)
    for name, rows in results.items():
        print(f"{name}: median {statistics.median(r[0] for r in rows):,.0f} msg/s, "
              f"median {statistics.median(r[1] for r in rows):.1f} µs server CPU per message")
    return 0


if __name__ == "__main__":
    sys.exit(main())
