"""The MQTT session registry of a cluster (client id → node, in etcd): a client that connects
to another node takes its session over, and the node it was on ends the old connection with
DISCONNECT 0x8E as a single node does."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess
from tests.mqtt_clients import V5, V311, Paho

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


@pytest.mark.parametrize("protocol", [V5, V311], ids=["mqtt5", "mqtt311"])
def test_a_takeover_right_after_connecting_ends_only_the_old_connection(
    cluster: Cluster, protocol: int,
) -> None:
    """Issue 27, bug 1: a clean-start client connects to n1, and at once the same client id
    to n2 (before the registry entry of the first has reached n2): exactly one connection
    ends, the old one; the new one stays. Several rounds, as the race did not lose every time."""
    n1, n2 = cluster(2)
    for attempt in range(5):
        client_id = f"racer-{protocol}-{attempt}"
        first = Paho(n1.mqtt_port, client_id, protocol)
        first.client.reconnect_delay_set(300, 300)  # no automatic reconnect during the test
        second = Paho(n2.mqtt_port, client_id, protocol)
        second.client.reconnect_delay_set(300, 300)
        first.disconnects.get(timeout=20)
        first.client.loop_stop()
        # both nodes name n2 as the session's node ...
        wait_for(lambda: sessions_on(n2, seen_from=n1) == 1 and sessions_on(n2, seen_from=n2) == 1
                 and sessions_on(n1, seen_from=n2) == 0, timeout=20)
        # ... and the new connection stays up (the bug ended it within half a second)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert second.disconnects.empty(), f"round {attempt}: the new connection was ended too"
            time.sleep(0.05)
        assert second.client.is_connected()
        second.client.disconnect()
        second.client.loop_stop()
        wait_for(lambda: sessions_on(n2, seen_from=n1) == 0 and sessions_on(n2, seen_from=n2) == 0,
                 timeout=20)
