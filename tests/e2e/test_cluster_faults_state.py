"""Retained messages, wills and history across nodes when connections and nodes fail (issue
14: "retained messages and wills ... shared"): a will of a client whose connection drops on one
node reaches subscribers on another, a will delayed past a reconnect on another node is never
published, a will whose client's node dies is published once by a survivor (after its will
delay; never after a clean DISCONNECT), retained messages outlive the node that stored them,
and a replay from the earliest offset on any node reads every shard."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    EtcdServer,
    protocol_node,
    read_back,
    settled_nodes,
    topics_of,
    wait_settled,
)
from tests.mqtt_clients import V5, V311, Paho

STREAMS = '[[streams]]\nname = "status"\nmode = "reliable"\npartitions = 4\nroutes = ["status/#"]\n'
# Presence: non-reliable, so a dead node's shards move to a survivor (a will to a reliable
# shard of the dead node itself waits for that node to come back).
PRESENCE = '[[streams]]\nname = "presence"\nmode = "non-reliable"\npartitions = 2\nroutes = ["presence/#"]\n'


@pytest.fixture
def pair(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ClusterNodeProcess]]:
    with settled_nodes([protocol_node(tmp_path, name, etcd.url, STREAMS + PRESENCE).start() for name in ("n1", "n2")]) as nodes:
        yield nodes


def will(topic: str, payload: str, *, retain: bool = False, delay: int | None = None) -> dict:
    properties = None
    if delay is not None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties
        properties = Properties(PacketTypes.WILLMESSAGE)
        properties.WillDelayInterval = delay
    return {"topic": topic, "payload": payload, "qos": 1, "retain": retain, "properties": properties}


def routes_known(nodes: list[ClusterNodeProcess]) -> None:
    """Until a subscription made on n2 is known to n1 (a will published there finds it)."""
    from tests.e2e.test_cluster_cross_node import routes_reach
    routes_reach(nodes, nodes[1])


@pytest.mark.parametrize("version", [V311, V5], ids=["3.1.1", "5.0"])
def test_a_will_of_a_connection_dropped_on_one_node_reaches_the_other_and_is_retained(
    pair: list[ClusterNodeProcess], version: int,
) -> None:
    n1, n2 = pair
    watcher = Paho(n2.mqtt_port, "watcher", version)
    watcher.subscribe("status/#", 1)
    routes_known(pair)
    device = Paho(n1.mqtt_port, "device-1", version, will=will("status/device-1", "offline", retain=True))
    device.drop()  # no DISCONNECT: the will goes
    message = watcher.expect()
    assert (message.topic, message.payload) == ("status/device-1", b"offline")
    # retained too: a subscriber that comes later, on either node, reads it
    for node in (n2, n1):
        late = Paho(node.mqtt_port, f"late-{node.node_id}", version)
        wait_for(lambda late=late: late.subscribe("status/device-1", 1) and not late.messages.empty(),
                 timeout=15, interval=0.2)
        got = late.expect()
        assert (got.payload, got.retain) == (b"offline", True)
        late.disconnect()


def test_a_delayed_will_is_not_published_when_its_session_resumes_on_another_node(
    pair: list[ClusterNodeProcess],
) -> None:
    n1, n2 = pair
    watcher = Paho(n2.mqtt_port, "watcher", V5)
    watcher.subscribe("status/#", 1)
    routes_known(pair)
    options = {"clean": False, "session_expiry": 300}
    device = Paho(n1.mqtt_port, "device-2", V5, will=will("status/device-2", "offline", delay=3), **options)
    device.drop()
    # back within the will delay, on the other node: the session (and its will) moves there
    again = Paho(n2.mqtt_port, "device-2", V5, **options)
    again.publish("status/device-2", "online", 1)
    assert watcher.expect().payload == b"online"
    watcher.expect_none(within=4.5)  # past the will delay: the will was cancelled
    again.disconnect()


def test_a_retained_message_outlives_the_node_that_stored_it(pair: list[ClusterNodeProcess]) -> None:
    n1, n2 = pair
    status = n1.status()
    topic = topics_of(status, "status", "status/kept", owner="n1")[0]
    publisher = Paho(n1.mqtt_port, "setter", V5)
    publisher.publish(topic, "kept", 1, retain=True)
    publisher.disconnect()
    n1.kill()

    def read_on(node: ClusterNodeProcess) -> bytes:
        late = Paho(node.mqtt_port, f"late-{node.node_id}", V5)
        try:
            late.subscribe(topic, 1)
            return late.expect(timeout=1).payload
        finally:
            late.disconnect()

    assert wait_for(lambda: read_on(n2) == b"kept", timeout=15, interval=0.2)
    n1.start()
    wait_settled(pair)
    assert wait_for(lambda: read_on(n1) == b"kept", timeout=15, interval=0.2)


def will_kept(etcd: EtcdServer, client_id: str) -> bool:
    """Whether `client_id`'s will is kept in etcd for survivors (see cluster/wills.py)."""
    return any(key.endswith(f".state/wills/{client_id}") for key in etcd.keys(".state/wills/"))


def test_a_will_is_published_when_the_node_of_its_client_dies(
    pair: list[ClusterNodeProcess], etcd: EtcdServer,
) -> None:
    n1, n2 = pair
    watcher = Paho(n2.mqtt_port, "watcher", V5)
    watcher.subscribe("presence/#", 1)
    routes_known(pair)
    topic = "presence/device-3"
    Paho(n1.mqtt_port, "device-3", V5, will=will(topic, "offline", retain=True))
    assert wait_for(lambda: will_kept(etcd, "device-3"), timeout=10, interval=0.1)
    n1.kill()
    message = watcher.expect(timeout=15)  # the lease TTL is 3 s
    assert (message.topic, message.payload) == (topic, b"offline")
    watcher.expect_none(within=3)  # published once
    assert wait_for(lambda: not will_kept(etcd, "device-3"), timeout=10, interval=0.1)  # claim gone
    late = Paho(n2.mqtt_port, "late-device-3", V5)  # and retained, as its will said
    late.subscribe(topic, 1)
    got = late.expect(timeout=10)
    assert (got.payload, got.retain) == (b"offline", True)
    late.disconnect()


def test_a_will_delay_runs_on_the_survivor_when_the_node_of_its_client_dies(
    pair: list[ClusterNodeProcess], etcd: EtcdServer,
) -> None:
    n1, n2 = pair
    watcher = Paho(n2.mqtt_port, "watcher", V5)
    watcher.subscribe("presence/#", 1)
    routes_known(pair)
    topic = "presence/device-5"
    Paho(n1.mqtt_port, "device-5", V5, will=will(topic, "offline", delay=4),
         clean=False, session_expiry=300)
    assert wait_for(lambda: will_kept(etcd, "device-5"), timeout=10, interval=0.1)
    n1.kill()
    watcher.expect_none(within=4)  # not before the lease runs out and the delay has run
    assert watcher.expect(timeout=15).payload == b"offline"


def test_no_will_after_a_clean_disconnect_when_the_node_later_dies(
    pair: list[ClusterNodeProcess], etcd: EtcdServer,
) -> None:
    n1, n2 = pair
    watcher = Paho(n2.mqtt_port, "watcher", V5)
    watcher.subscribe("presence/#", 1)
    routes_known(pair)
    topic = "presence/device-4"
    device = Paho(n1.mqtt_port, "device-4", V5, will=will(topic, "offline"),
                  clean=False, session_expiry=300)
    assert wait_for(lambda: will_kept(etcd, "device-4"), timeout=10, interval=0.1)
    device.disconnect()  # DISCONNECT 0x00: the will is discarded
    assert wait_for(lambda: not will_kept(etcd, "device-4"), timeout=10, interval=0.1)
    n1.kill()
    assert wait_for(lambda: [node["node_id"] for node in n2.status()["nodes"]] == ["n2"],
                    timeout=15, interval=0.2)
    watcher.expect_none(within=3)  # n2 controls the cluster now: it found no will to publish


def test_a_consumer_from_the_earliest_offset_on_any_node_replays_every_shard(
    pair: list[ClusterNodeProcess],
) -> None:
    n1, n2 = pair
    topics = topics_of(n1.status(), "status", "status/history")
    publisher = Paho(n1.mqtt_port, "history", V5)
    for topic in topics:
        publisher.publish(topic, topic, 1)
    publisher.disconnect()
    got = asyncio.run(read_back(n2.grpc_url, ["status/history/#"], set(topics), timeout=15))
    assert set(got) == set(topics)


