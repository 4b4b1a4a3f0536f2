"""The MQTT session registry of a cluster (client id → node, in etcd): a client that connects
to another node takes its session over, and the node it was on ends the old connection with
DISCONNECT 0x8E as a single node does."""

from __future__ import annotations

from collections.abc import Callable

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess
from tests.mqtt_clients import V5, Paho

Cluster = Callable[..., list[ClusterNodeProcess]]


def sessions_on(node: ClusterNodeProcess, seen_from: ClusterNodeProcess) -> int:
    status = seen_from.status()
    return next(entry["sessions"] for entry in status["nodes"] if entry["node_id"] == node.node_id)


def test_connecting_to_another_node_takes_the_session_over_with_0x8e(cluster: Cluster) -> None:
    n1, n2 = cluster(2)
    first = Paho(n1.mqtt_port, "device-7", V5)
    wait_for(lambda: sessions_on(n1, seen_from=n2) == 1, timeout=20)
    second = Paho(n2.mqtt_port, "device-7", V5)
    reason, properties = first.disconnects.get(timeout=20)
    first.client.loop_stop()  # no automatic reconnect (it would take the session back)
    assert reason == 0x8E  # Session taken over
    assert "taken over on n2" in properties.ReasonString
    wait_for(lambda: sessions_on(n2, seen_from=n1) == 1 and sessions_on(n1, seen_from=n1) == 0,
             timeout=20)
    assert second.disconnects.empty()
    second.client.disconnect()
    second.client.loop_stop()
    # the session ended with its connection (clean start, no expiry): the registry forgets it
    wait_for(lambda: sessions_on(n2, seen_from=n1) == 0, timeout=20)
