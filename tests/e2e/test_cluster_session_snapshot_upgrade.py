"""A persistent MQTT session whose snapshot in etcd was written by an earlier version (version 1,
positional entries) resumes on a node of this version, and its next snapshot is written in the
current encoding (`protocols/mqtt/snapshot.py`). Real etcd, two `shardgate serve --cluster`
nodes, a real MQTT client."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from shardgate.core.message import now_ms

from shardgate.cluster import keys
from shardgate.cluster.etcd import EtcdClient
from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer
from tests.e2e.test_cluster_state_sessions import etcd_get
from tests.mqtt_clients import V5, Paho

Cluster = Callable[..., list[ClusterNodeProcess]]
SNAPSHOTS = "/shardgate/test.state/sessions/"  # the fixtures' cluster is named "test"


def plant(etcd: EtcdServer, key: str, value: bytes) -> None:
    async def put() -> None:
        client = EtcdClient([etcd.url])
        try:
            await client.put(key, value)
        finally:
            await client.close()

    asyncio.run(put())


def test_a_session_snapshot_of_version_1_resumes_and_is_written_again_in_version_2(
        cluster: Cluster, etcd: EtcdServer) -> None:
    now = now_ms()
    # as a node of the earlier version left it: offline, held by a node gone since (n9)
    plant(etcd, SNAPSHOTS + "veteran", keys.encode({
        "version": 1, "node": "n9", "client_id": "veteran", "online": False, "expiry": 3600,
        "disconnected_ms": now, "taken_ms": now,
        "subscriptions": [["upgrade/#", 1, False, False, 0, None]], "shared": [],
        "cursors": [], "messages": [], "inflight": [], "queued": [], "qos2": [],
    }))
    n1, n2 = cluster(2)
    back = Paho(n1.mqtt_port, "veteran", V5, clean=False, session_expiry=3600, connect=False)
    flags, _rc, _props = back.connect()
    assert flags.session_present
    # its subscription came back with it: a message published on the other node arrives
    publisher = Paho(n2.mqtt_port, "upgrade-publisher", V5)
    publisher.publish("upgrade/x", b"after the upgrade", qos=1)
    message = back.expect(timeout=30)
    assert (message.topic, message.payload) == ("upgrade/x", b"after the upgrade")
    back.disconnect()

    def rewritten() -> bool:
        state = etcd_get(etcd, SNAPSHOTS + "veteran") or {}
        return state.get("version") == 2 and state.get("node") == "n1" and not state.get("online")

    wait_for(rewritten, timeout=30)
    state = etcd_get(etcd, SNAPSHOTS + "veteran")
    assert state is not None
    assert [entry["filter"] for entry in state["subscriptions"]] == ["upgrade/#"]
    publisher.disconnect()
