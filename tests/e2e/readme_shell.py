"""What the README tests share to run its commands as a user would: whether a port the README
names is free, and ending every process a backgrounded command (`... &`) started, its whole
process group, waiting until each has exited (a node still leaving a cluster, or a broker
still holding the default ports, must not meet the next test)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.conftest import wait_for


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of the group remains."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def end_groups(background: Sequence[subprocess.Popen[Any]], timeout: float = 40) -> None:
    """SIGTERM the process group of each backgrounded command (started with
    `start_new_session=True`), wait for every process of each group, SIGKILL what outlives
    `timeout`."""
    for process in reversed(background):
        # the whole group, even when its shell has exited: what it started may still run
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    for process in reversed(background):
        deadline = time.monotonic() + timeout
        while (process.poll() is None or group_alive(process.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if process.poll() is None or group_alive(process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
            wait_for(lambda process=process: not group_alive(process.pid), timeout=10)
