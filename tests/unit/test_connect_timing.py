"""The broker's CONNECT timing keeps the last samples of each span and reports percentiles."""

from __future__ import annotations

from shardgate.protocols.mqtt.timing import ConnectTiming, Samples


def test_samples_keep_the_last_values_appended() -> None:
    samples = Samples(size=4)
    for value in range(1, 11):
        samples.append(float(value))
    assert len(samples) == 4
    assert sorted(samples) == [7.0, 8.0, 9.0, 10.0]


def test_summary_reports_percentiles_in_milliseconds() -> None:
    timing = ConnectTiming()
    for i in range(1, 101):  # read at 0, session open after i ms, CONNACK 1 ms later
        timing.record([0.0, i / 1000, 0.0], i / 1000 + 0.001, persistent=i % 2 == 0)
    summary = timing.summary()
    assert summary["read_to_session_open_ms"] == {"count": 100, "p50": 51.0, "p99": 100.0, "max": 100.0}
    assert summary["persistent_read_to_connack_written_ms"]["count"] == 50
    assert summary["of_which_metadata_commit_wait_ms"]["count"] == 0
    assert summary["event_loop_lag_ms"] == {"count": 0, "p50": 0.0, "p99": 0.0, "max": 0.0}
