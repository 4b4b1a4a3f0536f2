"""`session_snapshots.etcd_value`: a session snapshot too large for one etcd request is written
there without the newest of its queued messages (etcd refuses the whole value otherwise, and
every later write of it: the rolling restart's 2.7 MB session), the oldest kept in order, and logged once per session while it stays over the limit."""

from __future__ import annotations

import logging

import pytest
from shardgate.protocols.mqtt.snapshot import QueuedEntry, SessionSnapshot

from shardgate.cluster.session_snapshots import etcd_value


def _snapshot(count: int) -> SessionSnapshot:
    queued = [QueuedEntry("fast", 0, index, 1, False, [], "x" * 100) for index in range(count)]
    return SessionSnapshot(client_id="big", node="n1", expiry=600, queued=queued)


def test_a_snapshot_that_fits_is_written_whole() -> None:
    state = _snapshot(10)
    assert etcd_value(state, limit=10_000) == state.encode()


def test_a_snapshot_over_the_limit_keeps_its_oldest_queued_messages_within_it() -> None:
    state = _snapshot(1_000)
    assert len(state.encode()) > 50_000
    value = etcd_value(state, limit=50_000)
    assert len(value) <= 50_000
    written = SessionSnapshot.decode(value)
    offsets = [entry.offset for entry in written.queued]
    assert 0 < len(offsets) < 1_000
    assert offsets == list(range(len(offsets)))  # the oldest, in order
    assert len(state.queued) == 1_000  # the snapshot itself is left whole


def test_the_trimming_is_logged_once_per_session_until_it_fits_again(caplog: pytest.LogCaptureFixture) -> None:
    trimmed: set[str] = set()
    big, small = _snapshot(1_000), _snapshot(10)

    def warnings() -> int:
        return sum("over the 50000 etcd takes" in record.getMessage() for record in caplog.records)

    with caplog.at_level(logging.WARNING, logger="shardgate.cluster.session_snapshots"):
        for _write in range(3):  # a connected session's checkpoints
            assert len(etcd_value(big, limit=50_000, trimmed=trimmed)) <= 50_000
        assert warnings() == 1
        etcd_value(small, limit=50_000, trimmed=trimmed)  # back under the limit
        etcd_value(big, limit=50_000, trimmed=trimmed)  # and over it again
        assert warnings() == 2
        etcd_value(big, limit=50_000)  # (without a record of what was logged: every time)
        assert warnings() == 3
