"""MQTT persistent sessions resume on any node of a cluster with what was published while their
client was away: a real etcd, `shardgate serve --cluster` processes and paho clients.

The messages go to a reliable stream of six shards spread over the three nodes, so a resumed
session replays shards it now owns, shards another node owns (read from that node's journal)
and shards the node it left owns.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest
from shardgate.client import SyncClient

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess
from tests.mqtt_clients import V5, V311, Paho

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
