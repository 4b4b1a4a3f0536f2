"""MQTT persistent sessions resume on any node of a cluster with what was published while their
client was away: a real etcd, `shardgate serve --cluster` processes and paho clients.

The messages go to a reliable stream of six shards spread over the three nodes, so a resumed
session replays shards it now owns, shards another node owns (read from that node's journal)
and shards the node it left owns.
"""

from __future__ import annotations

import base64
import json
import urllib.request
import zlib
from collections import defaultdict
from collections.abc import Callable

import pytest
from shardgate.client import SyncClient
from shardgate.protocols.mqtt import packets as p

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer
from tests.mqtt_clients import V5, V311, Paho, RawClient

Cluster = Callable[..., list[ClusterNodeProcess]]

TOPICS = [f"away/device-{index}" for index in range(12)]


def spread_stream(nodes: list[ClusterNodeProcess]) -> None:
    """The reliable stream `away` (six shards), created once every node is up so that its
    shards are placed on all of them (a reliable shard stays where it was placed)."""
    with SyncClient(nodes[0].grpc_url) as client:
        client.admin.create_stream("away", mode="reliable", partitions=6, routes=["away/#"])
    for node in nodes:
        wait_for(lambda node=node: len(node.status()["placement"].get("away", [])) == 6, timeout=20)
    assert len(shards_per_node(nodes[0])) == len(nodes)


def shards_per_node(node: ClusterNodeProcess) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for owner, _epoch in node.status()["placement"]["away"]:
        counts[owner] += 1
    return counts


def publish_round(publisher: Paho, count: int, qos: int, tag: str) -> dict[str, list[bytes]]:
    """`count` messages per topic, acknowledged; what each topic was sent, in order."""
    sent: dict[str, list[bytes]] = defaultdict(list)
    for sequence in range(count):
        for topic in TOPICS:
            payload = f"{tag}-{topic}-{sequence}".encode()
            publisher.publish(topic, payload, qos=qos)
            sent[topic].append(payload)
    return sent


def received_by_topic(client: Paho, total: int) -> dict[str, list[bytes]]:
    got: dict[str, list[bytes]] = defaultdict(list)
    for message in client.expect_n(total, timeout=30):
        got[message.topic].append(message.payload)
    return got


@pytest.mark.parametrize("qos", [1, 2])
@pytest.mark.parametrize("protocol", [pytest.param(V5, id="5.0"), pytest.param(V311, id="3.1.1")])
def test_a_persistent_session_resumes_on_another_node_with_what_was_published_while_away(
        cluster: Cluster, qos: int, protocol: int) -> None:
    n1, n2, n3 = cluster(3)
    spread_stream([n1, n2, n3])
    client_id = f"roamer-{qos}-{protocol}"
    away = Paho(n1.mqtt_port, client_id, protocol, clean=False, session_expiry=3600)
    granted = away.subscribe("away/#", qos=qos)[0]
    assert getattr(granted, "value", granted) == qos
    away.disconnect()

    publisher = Paho(n3.mqtt_port, "publisher", V5)
    sent = publish_round(publisher, 5, qos, "away")

    back = Paho(n2.mqtt_port, client_id, protocol, clean=False, session_expiry=3600, connect=False)
    flags, _rc, _props = back.connect()
    assert flags.session_present
    got = received_by_topic(back, sum(len(v) for v in sent.values()))
    assert got == sent  # every message, in order per topic (so per shard)
    back.expect_none(within=0.5)

    # the subscription came along: live messages reach the client on its new node
    live = publish_round(publisher, 2, qos, "live")
    assert received_by_topic(back, sum(len(v) for v in live.values())) == live
    back.expect_none(within=0.5)
    back.disconnect()
    publisher.disconnect()


def test_taking_over_a_connected_session_resends_its_unacknowledged_messages_with_dup(
        cluster: Cluster) -> None:
    """The client is still connected to n1 with QoS 1 messages it has not acknowledged when it
    connects to n2: n1 ends that connection with 0x8E, and n2 sends the same messages again,
    under the same packet ids, marked DUP, then the rest of the backlog."""
    n1, n2, n3 = cluster(3)
    spread_stream([n1, n2, n3])
    expiry = p.Properties(session_expiry_interval=3600, receive_maximum=4)
    old = RawClient(n1.mqtt_port, version=5)
    assert old.connect("slow-reader", clean=False, properties=expiry).reason_code == 0
    old.send(p.Subscribe(1, [p.SubscriptionRequest("away/#", 1)]))
    assert isinstance(old.receive(), p.Suback)
    publisher = Paho(n3.mqtt_port, "publisher", V5)
    sent = publish_round(publisher, 2, 1, "held")
    unacked = [old.receive() for _ in range(4)]  # the client's receive maximum: no more
    assert all(isinstance(packet, p.Publish) and not packet.dup for packet in unacked)

    new = RawClient(n2.mqtt_port, version=5)
    connack = new.connect("slow-reader", clean=False, properties=p.Properties(session_expiry_interval=3600))
    assert connack.session_present
    ended = old.receive_until_closed()
    assert any(isinstance(packet, p.Disconnect) and packet.reason_code == 0x8E for packet in ended)

    total = sum(len(payloads) for payloads in sent.values())
    got: dict[str, list[bytes]] = defaultdict(list)
    resent = []
    while sum(len(payloads) for payloads in got.values()) < total:
        packet = new.receive(timeout=30)
        assert isinstance(packet, p.Publish), packet
        if packet.dup:
            resent.append((packet.packet_id, packet.topic, packet.payload))
        got[packet.topic].append(packet.payload)
        new.send(p.Puback(packet.packet_id))
    assert sorted(resent) == sorted((packet.packet_id, packet.topic, packet.payload) for packet in unacked)
    assert got == sent  # nothing lost, nothing twice, in order per topic
    with pytest.raises(AssertionError, match="no packet"):
        new.receive(timeout=0.5)
    new.close()
    publisher.disconnect()


def etcd_get(etcd: EtcdServer, key: str) -> dict | None:
    """A key's JSON value, through etcd's HTTP gateway."""
    request = urllib.request.Request(
        f"{etcd.url}/v3/kv/range", data=json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode(),
        method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        kvs = json.loads(response.read()).get("kvs", [])
    return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None


def owners(node: ClusterNodeProcess) -> dict[str, str]:
    """Each topic's shard owner (the stream hashes the topic name)."""
    placement = node.status()["placement"]["away"]
    return {topic: placement[zlib.crc32(topic.encode()) % len(placement)][0] for topic in TOPICS}


def test_a_session_whose_node_died_resumes_elsewhere_and_gets_that_nodes_messages_when_it_returns(
        cluster: Cluster, etcd: EtcdServer) -> None:
    n1, n2, n3 = cluster(3)
    spread_stream([n1, n2, n3])
    owner = owners(n2)
    away = Paho(n1.mqtt_port, "orphan", V5, clean=False, session_expiry=3600)
    away.subscribe("away/#", qos=1)
    away.disconnect()
    # the offline session's snapshot is in etcd (written once, at the disconnect)
    wait_for(lambda: (etcd_get(etcd, "/shardgate/test.state/sessions/orphan") or {}).get("node") == "n1",
             timeout=20)
    publisher = Paho(n3.mqtt_port, "publisher", V5)
    before = publish_round(publisher, 2, 1, "before")  # some of it on n1's shards
    n1.kill()
    wait_for(lambda: {e["node_id"] for e in n2.status()["nodes"]} == {"n2", "n3"}, timeout=20)
    alive = [topic for topic in TOPICS if owner[topic] != "n1"]
    during: dict[str, list[bytes]] = defaultdict(list)
    for topic in alive:
        payload = f"during-{topic}".encode()
        publisher.publish(topic, payload, qos=1)
        during[topic].append(payload)

    back = Paho(n2.mqtt_port, "orphan", V5, clean=False, session_expiry=3600, connect=False)
    flags, _rc, _props = back.connect()
    assert flags.session_present
    expected_now = {topic: before[topic] + during[topic] for topic in alive}
    assert received_by_topic(back, sum(len(v) for v in expected_now.values())) == expected_now
    back.expect_none(within=0.5)

    # n1 returns with its journal: what it held for the session arrives on n2, and n1 drops
    # its own stale copy of the session (etcd says n2 holds it now)
    n1.start()
    held = {topic: before[topic] for topic in TOPICS if owner[topic] == "n1"}
    assert received_by_topic(back, sum(len(v) for v in held.values())) == held
    back.expect_none(within=0.5)
    assert (etcd_get(etcd, "/shardgate/test.state/sessions/orphan") or {}).get("node") == "n2"
    back.disconnect()
    publisher.disconnect()
