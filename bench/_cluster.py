"""A local cluster for the bench runners: a one-member etcd on loopback and
`shardgate serve --cluster` nodes, each process logging to a file of the work directory, all
stopped at the end nodes first (so each node drains and leaves while etcd still answers).
Also the report of a comparison's medians. Imports nothing from shardgate."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _proc import free_port, http_json, stop_process, wait_until

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


# The nodes a bench starts share this cluster secret (`[cluster] secret`, through the
# environment): a node without one refuses to start.
CLUSTER_SECRET = "bench-cluster-secret-0123456789abcdef"


def node_env() -> dict[str, str]:
    """The environment of a bench's processes: this one's, with the cluster secret (and an
    archive per node, which a cluster otherwise refuses)."""
    return {**os.environ, "SHARDGATE_CLUSTER__SECRET": CLUSTER_SECRET,
            "SHARDGATE_ARCHIVE__PER_NODE": "true"}  # each node's own archive is fine here


class Processes:
    """Everything started, stopped with SIGTERM (then SIGKILL) at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=self.workdir, start_new_session=True, env=node_env())
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        """Stop the nodes (SIGTERM, then SIGKILL), and etcd (started first) once they are gone:
        a node drains and leaves while etcd still answers (stopped together, the nodes lost
        etcd mid-shutdown and logged warnings about it)."""
        first, rest = self.procs[:1], self.procs[1:]
        for group in (rest, first):
            for proc in reversed(group):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in reversed(group):
                stop_process(proc, signal_first=False)


def start_etcd(procs: Processes) -> str:
    """Start a one-member etcd in the work directory; its client url once it is healthy."""
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    procs.start("etcd", [
        ETCD, "--name", "bench", "--data-dir", str(procs.workdir / "etcd"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"bench=http://127.0.0.1:{peer}",
    ])
    wait_until(lambda: http_json(f"{url}/health").get("health") == "true", 30, "etcd")
    return url


@contextlib.contextmanager
def two_nodes(workdir: Path, listener: str,
                     timeout: float = 60) -> Iterator[dict[str, dict[str, Any]]]:
    """Start etcd and nodes n1 and n2 with `listener` ("mqtt", "grpc" or "amqp") on a free
    port (the other listeners off, MQTT on any port) and yield
    {node id: {listener: port, "http": port, "pid": pid, "status": /api/cluster}} once both
    serve and the default stream is placed; stop them all (nodes first) at the end."""
    procs = Processes(workdir)
    try:
        url = start_etcd(procs)
        nodes: dict[str, dict[str, Any]] = {}
        for node_id in ("n1", "n2"):
            ports = {"mqtt": free_port(), "grpc": 0, "amqp": 0, listener: free_port(), "http": free_port()}
            proc = procs.start(node_id, [
                sys.executable, "-m", "shardgate", "serve", "--cluster", url, "--node-id", node_id,
                "--cluster-port", "0", "--host", "127.0.0.1", "--mqtt-port", str(ports["mqtt"]),
                "--mqtt-ws-port", "0", "--grpc-port", str(ports["grpc"]), "--amqp-port", str(ports["amqp"]),
                "--http-port", str(ports["http"]), "--data-dir", str(workdir / node_id),
            ])
            nodes[node_id] = {listener: ports[listener], "http": ports["http"], "pid": proc.pid}

        def placed() -> bool:
            for info in nodes.values():
                status = http_json(f"http://127.0.0.1:{info['http']}/api/cluster")
                if len(status["nodes"]) != 2 or "default" not in status["placement"]:
                    return False
                info["status"] = status
            return True

        wait_until(placed, timeout, "the two nodes")
        yield nodes
    finally:
        procs.stop()


def print_medians(rates: dict[str, list[float]]) -> None:
    """Print each label's median msg/s over its runs and its ratio to the first label's."""
    first = statistics.median(next(iter(rates.values())))
    width = max(len(label) for label in rates)
    for label, values in rates.items():
        median = statistics.median(values)
        print(f"{label:>{width}}: {median:8.0f} msg/s (runs: {', '.join(f'{v:.0f}' for v in values)}) "
              f"{median / first:.2f}x")
