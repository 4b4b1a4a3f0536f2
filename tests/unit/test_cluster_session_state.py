"""When an MQTT session's snapshot in etcd counts as expired (`cluster.session_snapshots.expired`), and
how `shardgate cluster status` shows the journal an owner keeps for other nodes' cursors."""

from __future__ import annotations

from shardgate.protocols.mqtt.session import NEVER_EXPIRES
from shardgate.protocols.mqtt.snapshot import SessionSnapshot

from shardgate.cluster.cli import render_status
from shardgate.cluster.session_snapshots import expired

NOW = 1_000_000


def test_an_offline_snapshot_expires_its_expiry_after_the_disconnect() -> None:
    state = SessionSnapshot(expiry=10, disconnected_ms=NOW - 10_000, online=False)
    assert expired(state, NOW)
    assert not expired(SessionSnapshot(expiry=10, disconnected_ms=NOW - 9_999), NOW)


def test_a_session_that_never_expires_never_does() -> None:
    assert not expired(SessionSnapshot(expiry=NEVER_EXPIRES, disconnected_ms=0), NOW)


def test_an_online_snapshot_expires_only_after_its_node_is_gone_for_the_expiry() -> None:
    state = SessionSnapshot(expiry=10, disconnected_ms=NOW - 3_600_000, online=True)
    assert not expired(state, NOW)  # its node is alive: that node's timer decides
    assert not expired(state, NOW, holder_gone_ms=NOW - 9_000)
    assert expired(state, NOW, holder_gone_ms=NOW - 10_000)


def test_an_offline_snapshot_of_a_dead_node_keeps_its_own_disconnect_time() -> None:
    state = SessionSnapshot(expiry=10, disconnected_ms=NOW - 10_000, online=False)
    assert expired(state, NOW, holder_gone_ms=NOW - 1_000)


def test_status_shows_the_journal_kept_for_cursors_on_other_nodes() -> None:
    status = {
        "cluster": "c", "controller": "n1", "shards": 2, "streams": 1,
        "nodes": [{"node_id": "n1", "cluster_address": "127.0.0.1:7001", "listeners": {},
                   "leaving": False, "controller": True, "shards": 2}],
        "cursor_floors": {"kept/0": 17, "kept/1": 0},
    }
    assert render_status(status).splitlines()[-1] == (
        "journal kept here for cursors on other nodes: kept/0 from 17, kept/1 from 0")
    assert "journal kept" not in render_status({**status, "cursor_floors": {}})


def test_moved_sessions_are_checkpointed_soon_a_batch_at_a_time_and_all_within_the_bound() -> None:
    from shardgate.cluster.session_snapshots import (
        CHECKPOINT_S,
        MAX_BATCH_PUTS,
        SOON_CHECKPOINT_S,
        checkpoints_due,
    )
    now = 100.0
    # a few moving sessions: each checkpointed once SOON_CHECKPOINT_S has passed, not before
    assert checkpoints_due({"a": now - SOON_CHECKPOINT_S, "b": now - SOON_CHECKPOINT_S / 2}, now) == ["a"]
    assert checkpoints_due({"new": float("-inf")}, now) == ["new"]
    # many: one batch of the sooner ones, longest ago first, plus every one past the bound
    sooner = {f"s{i}": now - SOON_CHECKPOINT_S - i * 0.001 for i in range(MAX_BATCH_PUTS * 3)}
    overdue = {f"o{i}": now - CHECKPOINT_S for i in range(MAX_BATCH_PUTS * 2)}
    due = checkpoints_due({**sooner, **overdue}, now)
    assert set(overdue) <= set(due)
    taken = [client_id for client_id in due if client_id in sooner]
    assert len(taken) == MAX_BATCH_PUTS
    assert taken == [f"s{i}" for i in range(MAX_BATCH_PUTS * 3 - 1, MAX_BATCH_PUTS * 2 - 1, -1)]
