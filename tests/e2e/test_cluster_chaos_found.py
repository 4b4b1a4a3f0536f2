"""Defects the randomized fault run (`bench/cluster_chaos.py`) found, each as the smallest test
that reproduces it with real clients and real processes.

Seed 2: a persistent MQTT session on a node that was frozen (SIGSTOP past its lease) never got
the messages other nodes stored meanwhile on their shards. The owners dropped the pushes meant
for the frozen node (it was unreachable, then out of their view), and the node's durable
cursors, following the pushes, went on from the next push as if nothing was missing. Now an
owner says on its next frame that it dropped pushes (`pushes_lost`), a new link session counts
as such too, and the receiving node's durable cursors on that owner's shards read its journal
again from their positions.
"""

from __future__ import annotations

import contextlib
import signal

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    topics_of,
    wait_settled,
)
from tests.e2e.test_cluster_cross_node import routes_reach
from tests.e2e.test_cluster_faults import nodes  # noqa: F401  (the fixture: n1, n2, stream `safe`)
from tests.mqtt_clients import V5, Paho


def test_a_persistent_session_on_a_frozen_node_gets_what_another_node_stored_meanwhile(
    nodes: list[ClusterNodeProcess],  # noqa: F811
) -> None:
    n1, n2 = nodes
    topics = topics_of(n1.status(), "safe", "safe/f", owner="n1", per_shard=2)
    keeper = Paho(n2.mqtt_port, "keeper", V5, clean=False, session_expiry=600)
    keeper.subscribe("safe/f/#", 1)
    routes_reach(nodes, n2)
    publisher = ContinuousPublisher(n1.mqtt_port, "on-n1", topics)
    try:
        wait_for(lambda: publisher.count() >= 50, timeout=60)
        assert n2.proc is not None
        n2.proc.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: "n2" not in {e["node_id"] for e in n1.status()["nodes"]}, timeout=30)
            mark = publisher.count()
            wait_for(lambda: publisher.count() >= mark + 50, timeout=30)  # stored while n2 is away
        finally:
            n2.proc.send_signal(signal.SIGCONT)
        wait_settled(nodes)
        mark = publisher.count()
        wait_for(lambda: publisher.count() >= mark + 50, timeout=30)
    finally:
        publisher.stop()
    acknowledged = set(publisher.acknowledged)
    received: set[str] = set()

    def take() -> bool:
        while not keeper.messages.empty():
            received.add(keeper.messages.get().payload.decode())
        return acknowledged <= received

    with contextlib.suppress(AssertionError):
        wait_for(take, timeout=20, interval=0.1)
    keeper.disconnect()
    missing = sorted(acknowledged - received, key=lambda payload: int(payload.rsplit("-", 1)[1]))
    assert not missing, (
        f"{len(missing)} of {len(acknowledged)} acknowledged messages never reached the session "
        f"on the node that was frozen: {missing[:10]}")
