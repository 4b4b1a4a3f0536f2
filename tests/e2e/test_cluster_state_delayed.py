"""Delayed messages in a cluster: held in etcd by the node that accepted them (saved before the
publisher's acknowledgement, shardgate/cluster/delayed.py), and published when due through the
normal path, so a subscriber on any node receives them, wherever the target shard lives."""

from __future__ import annotations

import time
from collections.abc import Callable

from tests.e2e.cluster_fixtures import ClusterNodeProcess
from tests.mqtt_clients import V5, Paho

Cluster = Callable[..., list[ClusterNodeProcess]]


def test_a_delayed_message_published_on_one_node_reaches_subscribers_on_the_others_when_due(
        cluster: Cluster) -> None:
    n1, n2, n3 = cluster(3)
    watchers = [Paho(node.mqtt_port, f"watcher-{node.node_id}", V5) for node in (n2, n3)]
    for watcher in watchers:
        watcher.subscribe("later/#", qos=1)
    publisher = Paho(n1.mqtt_port, "scheduler", V5)
    sent_at = time.monotonic()
    for index in range(4):  # topics on several shards
        publisher.publish(f"$delayed/4/later/job-{index}", f"job {index}", qos=1)
    for watcher in watchers:
        watcher.expect_none(within=0.8)  # held, not delivered at once
    for watcher in watchers:
        got = sorted((m.topic, m.payload) for m in watcher.expect_n(4, timeout=20))
        assert got == [(f"later/job-{i}", f"job {i}".encode()) for i in range(4)]
    assert time.monotonic() - sent_at >= 3.9
    for watcher in watchers:
        watcher.expect_none(within=0.3)
        watcher.disconnect()
    publisher.disconnect()
