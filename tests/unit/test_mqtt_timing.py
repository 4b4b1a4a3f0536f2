"""The CONNECT timing's loop-lag probe runs only while there is something to measure."""

from __future__ import annotations

from shardgate.protocols.mqtt.timing import LAG_PROBE_S, ConnectTiming

from tests.manual_clock import ManualClock


def pending_timers(clock: ManualClock) -> int:
    return sum(1 for _, _, timer in clock._timers if not timer.cancelled)


def test_the_loop_lag_probe_sleeps_while_no_client_is_connected_and_wakes_for_one():
    clock = ManualClock()
    clients: set[str] = set()
    timing = ConnectTiming()
    timing.start_probe(clock, lambda: bool(clients))
    clock.advance(LAG_PROBE_S * 1.5)  # the first tick finds nobody connected
    assert pending_timers(clock) == 0
    clock.advance(10.0)
    samples = len(timing.loop_lag)
    assert samples == 1  # an idle broker is not woken up 50 times a second

    clients.add("a")
    timing.resume_probe()
    timing.resume_probe()  # idempotent: one timer
    assert pending_timers(clock) == 1
    clock.advance(LAG_PROBE_S * 10.5)
    assert len(timing.loop_lag) == samples + 10

    clients.clear()
    clock.advance(LAG_PROBE_S * 10)
    assert len(timing.loop_lag) == samples + 11
    assert pending_timers(clock) == 0

    timing.stop_probe()
    timing.resume_probe()  # stopped for good: nothing starts it again
    assert pending_timers(clock) == 0
