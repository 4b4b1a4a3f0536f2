"""A node that left the cluster and never returns stops pinning its owners' journals after a
bound (issue 14): the cursor floors it reported count for `departed_floors_retention_s`, then
owners ignore them, and `shardgate cluster status` says so (shardgate/cluster/floors.py). Real
etcd, real nodes, a persistent MQTT session on the node that dies; a bound of a few seconds."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer
from tests.e2e.test_cluster_state_sessions import (
    SMALL_JOURNAL,
    Cluster,
    create_spread,
    low_watermark,
    topic_on,
)
from tests.mqtt_clients import V5, Paho

# (a key before any section header lands in the fixture's [cluster] section)
BOUND_S = 4
CONFIG = f"departed_floors_retention_s = {BOUND_S}\n{SMALL_JOURNAL}"


def cluster_status(node: ClusterNodeProcess) -> str:
    """The command's output; it exits 3 while shards are unavailable (a departed node's)."""
    shown = subprocess.run(
        [sys.executable, "-m", "shardgate", "cluster", "status", "--http-url",
         f"http://127.0.0.1:{node.ports['http']}"],
        capture_output=True, text=True, timeout=60)
    assert shown.returncode in (0, 3), shown.stderr
    return shown.stdout


def test_a_departed_nodes_cursor_floors_stop_pinning_the_owners_journal_after_the_bound(
        cluster: Cluster, etcd: EtcdServer) -> None:
    n1, n2 = cluster(2, extra_config=CONFIG)
    # one copy per shard: n1's shard takes publishes once n2 is dead (on two nodes a
    # replicated shard, both replicas needed in sync, refuses them)
    create_spread(n1, [n1, n2], "kept", replicas=1)
    topic, shard = topic_on(n1, "kept", "n1")
    name = f"kept/{shard}"
    keeper = Paho(n2.mqtt_port, "keeper", V5, clean=False, session_expiry=3600)
    keeper.subscribe("kept/#", qos=1)
    keeper.disconnect()
    wait_for(lambda: n1.status()["cursor_floors"].get(name) == 0, timeout=20)

    n2.kill()  # and never comes back
    departed = wait_for(lambda: (d := n1.status()["departed_floors"].get("n2", {})).get("departed_ms") and d,
                        timeout=20, interval=0.1)
    assert departed["floors"][name] == 0
    assert departed["ignored_from_ms"] == departed["departed_ms"] + BOUND_S * 1000
    status = wait_for(lambda: (s := n1.status())["departed_floors"]["n2"]["ignored"] and s,
                      timeout=30, interval=0.2)
    assert name not in status["cursor_floors"]  # n1 no longer keeps its journal for n2
    assert "cursor floors of departed node n2" in cluster_status(n1)
    assert "ignored (departed_floors_retention_s has passed)" in cluster_status(n1)
    assert etcd.keys(".state/floors/n2")  # the report itself stays, for a late return

    # retention (1 byte per shard, small segments) now deletes what only n2's session needed
    publisher = Paho(n1.mqtt_port, "publisher", V5)
    for number in range(150):
        publisher.publish(topic, f"after-{number:04d}-{'x' * 40}".encode(), qos=1)
    wait_for(lambda: low_watermark(n1, "kept", shard) > 0, timeout=40)
    publisher.disconnect()
