"""Server subprocesses started by test fixtures (brokers, etcd), ended after the test that
started them (see `_end_processes_left_running` in tests/conftest.py)."""

from __future__ import annotations

import contextlib
import subprocess

# Every server process a fixture starts (brokers, etcd), in order: whichever a test leaves
# running is ended after it (`_end_processes_left_running`), so none outlives the run.
tracked_processes: list[subprocess.Popen[bytes]] = []


def track_process(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """Register a server subprocess to be ended after the current test if still running."""
    tracked_processes.append(proc)
    return proc


def end_process(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL `proc` if it still runs, and reap it."""
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
