"""Unit tests of the cluster's will claims (shardgate/cluster/wills.py) and of how `shardgate
cluster status` shows a departed node's cursor floors (shardgate/cluster/floors.py)."""

from __future__ import annotations

from shardgate.cluster.cli import render_status
from shardgate.cluster.wills import publish_at_ms, responsible

NOW = 1_000_000
WILL = {"node": "n2", "lease": 7, "delay": 30, "expiry": 3600, "disconnected_ms": NOW - 1_000}


def test_a_will_answers_to_its_holder_until_claimed_then_to_its_claimer() -> None:
    assert responsible(WILL) == ("n2", 7)
    assert responsible({**WILL, "claim": {"node": "n1", "lease": 9}}) == ("n1", 9)


def test_a_claimed_will_is_due_at_once_its_delay_having_run() -> None:
    assert publish_at_ms(WILL, NOW) == NOW - 1_000 + 30_000
    assert publish_at_ms({**WILL, "claim": {"node": "n1", "lease": 9}}, NOW) == NOW


def status_with(departed: dict) -> dict:
    return {
        "cluster": "test", "controller": "n1", "shards": 2, "streams": 1,
        "nodes": [{"node_id": "n1", "cluster_address": "127.0.0.1:7001", "listeners": {},
                   "leaving": False, "controller": True, "shards": 2}],
        "cursor_floors": {}, "departed_floors": departed,
    }


def test_cluster_status_shows_a_departed_nodes_floors_kept_until_the_bound_then_ignored() -> None:
    kept = {"n2": {"departed_ms": 0, "ignored": False, "ignored_from_ms": 86_400_000,
                   "floors": {"kept/0": 5}}}
    assert render_status(status_with(kept)).splitlines()[-1] == (
        "cursor floors of departed node n2 (kept/0 from 5): kept until 1970-01-02 00:00:00 UTC")
    ignored = {"n2": {**kept["n2"], "ignored": True}}
    assert render_status(status_with(ignored)).splitlines()[-1] == (
        "cursor floors of departed node n2 (kept/0 from 5): ignored (departed_floors_retention_s has passed)")
    assert "departed" not in render_status(status_with({}))
