"""The dashboard's traffic history: a ring of the last span's samples, oldest first, kept as
columns of numbers so that a sample leaves no object behind (a few long-lived objects made
every few seconds under load would keep the load's arenas of the small-object heap)."""

from __future__ import annotations

import gc
import sys

from shardgate.admin.history import TrafficHistory


def counting_reader() -> tuple[list[int], TrafficHistory]:
    calls = [0]

    def read() -> dict[str, int]:
        calls[0] += 1
        return {"messages_in": 1_000_000 + calls[0], "connections": calls[0] % 7}

    return calls, TrafficHistory(read, interval_s=1.0, span_s=3.0)


def test_the_history_holds_the_last_span_oldest_first() -> None:
    _, history = counting_reader()
    assert history.view()["samples"] == []
    for _ in range(6):
        history.sample()
    samples = history.view()["samples"]
    assert [point["messages_in"] for point in samples] == [1_000_003, 1_000_004, 1_000_005, 1_000_006]
    assert [point["connections"] for point in samples] == [3, 4, 5, 6]
    assert all(isinstance(point["messages_in"], int) for point in samples)
    times = [point["t"] for point in samples]
    assert times == sorted(times) and isinstance(times[0], float)


def test_a_sample_keeps_no_object() -> None:
    history = TrafficHistory(lambda: {"messages_in": 10**9 + len(str(object())), "bytes_in": 2**40},
                             interval_s=1.0, span_s=5_000.0)
    history.sample()  # the columns are made by the first sample
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(2_000):
        history.sample()
    gc.collect()
    # A dict per sample (with its float and ints) would keep over 10,000 blocks here.
    assert sys.getallocatedblocks() - before < 200
