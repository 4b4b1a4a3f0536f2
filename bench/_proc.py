"""Process plumbing the bench runners share: free loopback ports, waiting on a condition,
reading a JSON admin endpoint, starting one `shardgate serve` that reports its ports, and
stopping a process (SIGTERM, then SIGKILL). Imports nothing from shardgate."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def wait_until(check: Any, timeout: float, what: str) -> Any:
    """Calls `check` every 0.1 s until it returns something true (connection errors and
    half-written answers count as not yet), and returns that; raises after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError):
            value = check()
            if value:
                return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready within {timeout:.0f} s")
        time.sleep(0.1)


def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.loads(response.read())


def stop_process(proc: subprocess.Popen[bytes], grace: float = 15, signal_first: bool = True) -> None:
    """SIGTERM `proc` (unless `signal_first` is false: already signalled), wait `grace`
    seconds for it to exit, then SIGKILL it."""
    if signal_first and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def start_broker(data_dir: Path, log_path: Path,
                 http_port: int = 0) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """Start one `shardgate serve` on loopback (MQTT on a free port, WebSocket, gRPC and AMQP
    off, the admin API on `http_port`, 0 for any) and return it with the ports it reports in
    its port file, once it has written that file."""
    port_file = data_dir.parent / "ports.json"
    command = [
        sys.executable, "-m", "shardgate", "serve", "--data-dir", str(data_dir), "--host", HOST,
        "--mqtt-port", str(free_port()), "--mqtt-ws-port", "0", "--grpc-port", "0",
        "--http-port", str(http_port), "--amqp-port", "0", "--port-file", str(port_file),
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"broker exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        if port_file.exists():
            ports = json.loads(port_file.read_text())
            return proc, {k: int(v) for k, v in ports.items()}
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("broker did not write its port file within 60 s")
