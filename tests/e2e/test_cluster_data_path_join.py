"""A shard's new owner that does not know yet what another node's clients subscribe to (it has
just joined or restarted, and that node's route set is still on its way over their link) must
not lose what it stores meanwhile: every message a subscriber there wants reaches it once the
routes arrive, once, in order. Found by `test_cluster_faults_map.py` (a node joining while
clients publish QoS 1): 1-2 acknowledged messages in 2 of 18 runs never reached the subscriber.

Three whole nodes (every listener up) joined by their data planes over real loopback links,
with a fixed shard map (no etcd: `StaticClusterView`), so the window stays open as long as the
test wants: node c owns every shard; b and c know all three nodes; a does not know c yet, so
it has not dialed c and c has not got a's routes (as a node whose link to a joining node is
still opening). a's subscriber holds `orders/#`; b and c publish to c's shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from shardgate.protocols.mqtt import packets as p

from shardgate.cluster.data_plane import DataPlane
from shardgate.cluster.membership import NodeInfo, ShardAssignment, StaticClusterView
from tests.conftest import ThreadedBroker, wait_for
from tests.e2e.cluster_fixtures import start_with_free_ports
from tests.mqtt_clients import V5, Paho, RawClient

OWNER = "c"


@dataclass
class Node:
    node_id: str
    server: ThreadedBroker
    view: StaticClusterView
    plane: DataPlane

    def knows_routes_of(self, other: str) -> int:
        return self.server.call(lambda: len(self.plane.remote.routes_of(other)))

    def linked(self) -> bool:
        """Every link to a node this node's peer accepts: "a" does not know "c" yet, and a node
        takes a link only from a node it knows (cluster link authentication), so "c"'s link to
        "a" connects once "a" learns of "c"."""
        return self.server.call(lambda: all(
            link.connected for peer, link in self.plane.links.items()
            if not (self.node_id == "c" and peer == "a")))


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[dict[str, Node]]:
    nodes: dict[str, Node] = {}
    try:
        for node_id in ("a", "b", "c"):
            server = start_with_free_ports(tmp_path / node_id)
            broker = server.app.broker
            every_shard = {
                (name, shard.index): ShardAssignment(name, shard.index, OWNER, 1)
                for name, stream in broker.streams.items() for shard in stream.shards
            }
            view = StaticClusterView(node_id, {}, every_shard)
            plane = DataPlane(broker, view)
            server.call(plane.start())
            server.app.data_plane = plane
            nodes[node_id] = Node(node_id, server, view, plane)
        infos = {n.node_id: NodeInfo(n.node_id, f"127.0.0.1:{n.plane.port}") for n in nodes.values()}
        for node in nodes.values():
            node.view.node_infos = {k: v for k, v in infos.items() if node.node_id != "a" or k != "c"}
            node.server.call(node.view.changed)
        wait_for(lambda: all(node.linked() for node in nodes.values()))
        yield nodes
    finally:
        for node in nodes.values():
            node.server.call(node.plane.stop())
        for node in nodes.values():
            node.server.stop()


def a_learns_of_c(trio: dict[str, Node]) -> None:
    a = trio["a"]
    a.view.node_infos["c"] = NodeInfo("c", f"127.0.0.1:{trio['c'].plane.port}")
    a.server.call(a.view.changed)
    wait_for(lambda: trio["c"].knows_routes_of("a") >= 1)


def publish_acknowledged(client: RawClient, topic: str, payloads: list[str], first_id: int) -> None:
    for packet_id, payload in enumerate(payloads, first_id):
        client.send(p.Publish(topic, payload.encode(), 1, packet_id=packet_id))
        puback = client.receive()
        assert isinstance(puback, p.Puback) and puback.packet_id == packet_id, puback
        assert puback.reason_code == 0, puback.properties.reason_string


@pytest.mark.parametrize("publisher", ["b", "c"], ids=["forwarded-to-the-owner", "on-the-owner"])
def test_messages_stored_before_a_subscribers_routes_reach_the_owner_are_delivered_once_they_do(
    trio: dict[str, Node], publisher: str,
) -> None:
    a, c = trio["a"], trio["c"]
    subscriber = Paho(a.server.mqtt_port, "steady", V5)
    subscriber.subscribe("orders/#", 1)
    wait_for(lambda: trio["b"].knows_routes_of("a") >= 1)
    assert c.knows_routes_of("a") == 0, "the window this test is about: c lacks a's routes"
    client = RawClient(trio[publisher].server.mqtt_port, version=5)
    client.connect(f"via-{publisher}")
    early = [f"early-{index}" for index in range(20)]
    publish_acknowledged(client, "orders/1", early, 1)
    a_learns_of_c(trio)
    late = [f"late-{index}" for index in range(20)] + ["last"]
    publish_acknowledged(client, "orders/1", late, 100)
    # every acknowledged message arrives, in order; "last" comes after any repeat would have
    received = []
    while not received or received[-1] != "last":
        received.append(subscriber.expect().payload.decode())
    assert received == early + late
    client.close()
    subscriber.disconnect()


def test_the_owner_holds_the_unknown_nodes_messages_bounded_and_counts_what_it_gives_up(
    trio: dict[str, Node], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node in the view whose routes never come (it cannot dial the owner): the owner keeps
    acknowledging publishes, and after the bound gives the held messages up, counted as
    dropped pushes, instead of holding them for ever."""
    import shardgate.cluster.unrouted as unrouted

    monkeypatch.setattr(unrouted, "UNROUTED_WAIT_S", 0.2)
    c = trio["c"]
    client = RawClient(c.server.mqtt_port, version=5)
    client.connect("publisher")
    publish_acknowledged(client, "orders/1", [f"m-{index}" for index in range(10)], 1)
    wait_for(lambda: c.server.call(lambda: c.plane.stats.pushes_dropped) == 10)
    assert c.server.call(lambda: c.plane.unrouted_held()) == 0
    publish_acknowledged(client, "orders/1", ["after"], 20)
    client.close()
