"""Where a CONNECT waits, measured inside the broker.

`ConnectTiming` keeps, for the last few thousand CONNECTs that opened a session, three spans:
from the read that carried the CONNECT to the session being open (session take-over and
restore), from there to the CONNACK handed to the socket (the turn's output flush and, when
the CONNACK reports session state just written, the metadata commit's fsync), and, of that,
the wait for the commit. Beside them, the event loop's lateness: a timer due every
`LAG_PROBE_S` that measures how late it fires, which is how long the turns around it took
(a CONNECT that arrives during a long turn is read only after it).

`summary()` gives percentiles in milliseconds; the admin API shows them under
`/api/info` (`mqtt_connect_timing`). The cost is a clock read per CONNECT and one timer every
`LAG_PROBE_S` while any MQTT client is connected (an idle broker does not wake up for it):
nothing per message. Samples are kept as doubles in one array per span, not as float objects:
thousands of small objects made while clients come and go, and kept until replaced, would each
keep a page of Python's heap from being returned after the load.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...core.scheduling import Scheduler, Timer

SAMPLES = 20_000
LAG_PROBE_S = 0.02

clock = time.perf_counter


class Samples:
    """The last `size` values appended (a ring of doubles in one array)."""

    __slots__ = ("_values", "_size", "_next")

    def __init__(self, size: int = SAMPLES) -> None:
        self._values = array("d")
        self._size = size
        self._next = 0

    def append(self, value: float) -> None:
        if len(self._values) < self._size:
            self._values.append(value)
        else:
            self._values[self._next] = value
            self._next = (self._next + 1) % self._size

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[float]:
        return iter(self._values)


def _percentiles(values: Samples) -> dict[str, float]:
    if not values:
        return {"count": 0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)
    last = len(ordered) - 1
    return {
        "count": len(ordered),
        "p50": round(ordered[min(last, int(0.5 * len(ordered)))] * 1e3, 3),
        "p99": round(ordered[min(last, int(0.99 * len(ordered)))] * 1e3, 3),
        "max": round(ordered[last] * 1e3, 3),
    }


class ConnectTiming:
    """CONNECT → CONNACK spans inside the broker, and the event loop's lateness."""

    __slots__ = ("read_to_open", "open_to_written", "durable_wait", "total", "persistent_total",
                 "loop_lag", "_probe", "_scheduler", "_due", "_busy")

    def __init__(self) -> None:
        self.read_to_open = Samples()
        self.open_to_written = Samples()
        self.durable_wait = Samples()
        self.total = Samples()
        self.persistent_total = Samples()
        self.loop_lag = Samples()
        self._probe: Timer | None = None
        self._scheduler: Scheduler | None = None
        self._due = 0.0
        # Whether there is anything to measure the loop for (clients connected).
        self._busy: Callable[[], bool] = lambda: True

    def record(self, marks: list[float], written: float, persistent: bool) -> None:
        """`marks`: [read, opened, durable (0.0: nothing waited)] clock values."""
        read, opened, durable = marks[0], marks[1], marks[2]
        if not opened:
            return  # refused, or closed before its session opened
        self.read_to_open.append(opened - read)
        self.open_to_written.append(written - opened)
        if durable:
            self.durable_wait.append(durable - opened)
        self.total.append(written - read)
        if persistent:
            self.persistent_total.append(written - read)

    # ------------------------------------------------------------------ loop lag probe
    def start_probe(self, scheduler: Scheduler, busy: Callable[[], bool] | None = None) -> None:
        """Measure the loop's lateness while `busy()` says so; `resume_probe` when it may
        have become true again."""
        self._scheduler = scheduler
        if busy is not None:
            self._busy = busy
        self.resume_probe()

    def resume_probe(self) -> None:
        scheduler = self._scheduler
        if self._probe is None and scheduler is not None:
            self._due = clock() + LAG_PROBE_S
            self._probe = scheduler.call_later(LAG_PROBE_S, self._tick)

    def stop_probe(self) -> None:
        self._scheduler = None
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None

    def _tick(self) -> None:
        now = clock()
        self.loop_lag.append(max(0.0, now - self._due))
        self._probe = None
        if self._scheduler is not None and self._busy():
            self._due = now + LAG_PROBE_S
            self._probe = self._scheduler.call_later(LAG_PROBE_S, self._tick)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            "read_to_session_open_ms": _percentiles(self.read_to_open),
            "session_open_to_connack_written_ms": _percentiles(self.open_to_written),
            "of_which_metadata_commit_wait_ms": _percentiles(self.durable_wait),
            "read_to_connack_written_ms": _percentiles(self.total),
            "persistent_read_to_connack_written_ms": _percentiles(self.persistent_total),
            "event_loop_lag_ms": _percentiles(self.loop_lag),
        }
