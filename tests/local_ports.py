"""Loopback ports for servers that tests start."""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (bind to 0, a client's connect)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


EPHEMERAL_LOW, EPHEMERAL_HIGH = _ephemeral_range()
# Ports for tests come from below the ephemeral range: the kernel never hands those to a client
# connection or a bind to port 0, so between the pick and the broker's bind (or across a
# broker's restart) no other socket on the machine can take one, except another test that
# picked the same port on purpose, which the random pick and the bind check make rare.
_PICK_LOW, _PICK_HIGH = (16384, EPHEMERAL_LOW - 1) if EPHEMERAL_LOW > 20000 else (0, 0)


def _worker_slice(low: int, high: int) -> tuple[int, int]:
    """The part of [low, high] for this pytest-xdist worker (`gw<N>` of PYTEST_XDIST_WORKER_COUNT,
    which xdist sets in each worker): workers never pick each other's ports. The whole range
    outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not (high and worker.startswith("gw") and worker[2:].isdigit() and count > 1):
        return low, high
    size = (high - low + 1) // count
    index = int(worker[2:]) % count
    return low + index * size, low + (index + 1) * size - 1


_PICK_LOW, _PICK_HIGH = _worker_slice(_PICK_LOW, _PICK_HIGH)
_picker = random.Random(os.getpid() ^ time.monotonic_ns())
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback TCP port that nothing listens on, for a server the test starts next."""
    if _PICK_HIGH:
        if len(_handed_out) > (_PICK_HIGH - _PICK_LOW) // 2:
            _handed_out.clear()
        for _ in range(200):
            port = _picker.randint(_PICK_LOW, _PICK_HIGH)
            if port in _handed_out:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as sock:  # no room below the ephemeral range: let the kernel pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
