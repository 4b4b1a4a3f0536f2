"""The cluster data path with real clients: two whole Shardgate nodes (every listener up) joined
by their data planes over real loopback gRPC links, with a fixed shard map (no etcd: the
control plane is replaced by a `StaticClusterView`, so these tests prove forwarding, the route
table and pushes alone). A client publishes on one node, a subscriber on the other receives.

Node a owns the even shards of every stream, node b the odd ones; the default stream has four
shards (journaled, as `serve` makes it), so both paths are covered: a publish for a shard of
the other node is forwarded there; a message stored by its owner is pushed to the subscriber's
node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aio_pika
import aiormq
import pytest
from shardgate.client import Client, Unavailable
from shardgate.core.streams import Stream
from shardgate.protocols.mqtt import packets as p

from shardgate.cluster import forwarding
from shardgate.cluster.data_plane import DataPlane
from shardgate.cluster.membership import NodeInfo, ShardAssignment, StaticClusterView
from tests.conftest import ThreadedBroker, wait_for
from tests.e2e.cluster_fixtures import start_with_free_ports
from tests.mqtt_clients import V5, V311, Paho, RawClient

VERSIONS = [pytest.param(V311, id="3.1.1"), pytest.param(V5, id="5.0")]
NODES = ("a", "b")


@dataclass
class Node:
    node_id: str
    server: ThreadedBroker
    view: StaticClusterView
    plane: DataPlane

    @property
    def mqtt_port(self) -> int:
        return self.server.mqtt_port

    def port(self, name: str) -> int:
        return self.server.app.port(name)

    def remote_routes(self, of: str) -> int:
        return self.server.call(lambda: len(self.plane.remote.routes_of(of)))


def owner_of(index: int) -> str:
    return NODES[index % len(NODES)]


def assignments(streams: dict[str, Stream]) -> dict[tuple[str, int], ShardAssignment]:
    return {
        (name, shard.index): ShardAssignment(name, shard.index, owner_of(shard.index), 1)
        for name, stream in streams.items() for shard in stream.shards
    }


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[dict[str, Node]]:
    nodes: dict[str, Node] = {}
    try:
        for node_id in NODES:
            server = start_with_free_ports(tmp_path / node_id)
            broker = server.app.broker
            view = StaticClusterView(node_id, {}, assignments(broker.streams))
            plane = DataPlane(broker, view)
            server.call(plane.start())
            server.app.data_plane = plane
            nodes[node_id] = Node(node_id, server, view, plane)
        infos = {n.node_id: NodeInfo(n.node_id, f"127.0.0.1:{n.plane.port}") for n in nodes.values()}
        for node in nodes.values():
            node.view.node_infos = dict(infos)
            node.server.call(node.view.changed)
        wait_for(lambda: all(
            n.server.call(lambda n=n: all(link.connected for link in n.plane.links.values()))
            for n in nodes.values()
        ))
        yield nodes
    finally:
        for node in nodes.values():
            node.server.call(node.plane.stop())
        for node in nodes.values():
            node.server.stop()


def topic_for(node: Node, owner: str, prefix: str = "orders") -> str:
    """A topic of the default stream whose shard `owner` owns."""
    broker = node.server.app.broker
    for index in range(1000):
        topic = f"{prefix}/{index}"
        if owner_of(broker.stream_for_topic(topic).shard_for(topic, None).index) == owner:
            return topic
    raise AssertionError("no such topic")


def routes_reach(nodes: dict[str, Node], of: str, count: int = 1) -> None:
    """Wait until every other node knows `count` routes of node `of`."""
    wait_for(lambda: all(n.remote_routes(of) >= count for n in nodes.values() if n.node_id != of))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("qos", [0, 1, 2])
@pytest.mark.parametrize("owner", ["a", "b"], ids=["stored-by-publisher-node", "forwarded-to-subscriber-node"])
def test_mqtt_publish_on_one_node_reaches_subscriber_on_the_other(pair, version, qos, owner):
    a, b = pair["a"], pair["b"]
    topic = topic_for(a, owner)
    sub = Paho(b.mqtt_port, "sub", version)
    sub.subscribe("orders/#", qos)
    routes_reach(pair, "b")
    pub = Paho(a.mqtt_port, "pub", version)
    for index in range(20):
        pub.publish(topic, f"m{index}", qos)  # QoS 1/2: waits for PUBACK / PUBCOMP
    received = sub.expect_n(20)
    assert [m.payload for m in received] == [f"m{i}".encode() for i in range(20)]
    assert all(m.qos == qos and m.topic == topic for m in received)
    sub.expect_none()
    pub.disconnect()
    sub.disconnect()


def test_acknowledged_publish_for_the_other_node_is_in_its_journal(pair):
    a, b = pair["a"], pair["b"]
    topic = topic_for(a, "b")
    pub = Paho(a.mqtt_port, "pub", V5)
    pub.publish(topic, b"kept", 1)
    shard = b.server.app.broker.stream_for_topic(topic).shard_for(topic, None)

    def stored() -> list[bytes]:
        assert shard.log is not None
        return [record.data for record in shard.log.read(0)]

    records = b.server.call(stored)
    assert len(records) == 1 and b"kept" in records[0]
    local = a.server.app.broker.stream_for_topic(topic).shard_for(topic, None)
    assert a.server.call(lambda: local.log.next_offset) == 0, "the publisher's node keeps nothing"
    pub.disconnect()


def test_mqtt_shared_subscription_spreads_across_nodes_once_each(pair):
    a, b = pair["a"], pair["b"]
    members = [Paho(node.mqtt_port, f"worker-{node.node_id}", V5) for node in (a, b)]
    for member in members:
        member.subscribe("$share/workers/jobs/#", 1)
    routes_reach(pair, "a")
    routes_reach(pair, "b")
    pub = Paho(a.mqtt_port, "pub", V5)
    for index in range(40):
        pub.publish(f"jobs/{index}", str(index), 1)
    wait_for(lambda: sum(member.messages.qsize() for member in members) >= 40, timeout=30)
    counts = [member.messages.qsize() for member in members]
    got = [int(member.expect().payload) for member, count in zip(members, counts, strict=True)
           for _ in range(count)]
    for member in members:
        member.expect_none()
    assert sorted(got) == list(range(40)), "each message once across the group"
    assert all(counts), f"both nodes' members take messages: {counts}"
    pub.disconnect()
    for member in members:
        member.disconnect()


def test_unsubscribe_on_one_node_stops_delivery_from_the_other(pair):
    a, b = pair["a"], pair["b"]
    sub = Paho(b.mqtt_port, "sub", V5)
    sub.subscribe("news/#", 1)
    sub.subscribe("marker", 1)
    routes_reach(pair, "b", 2)
    sub.unsubscribe("news/#")
    wait_for(lambda: a.remote_routes("b") == 1)
    pub = Paho(a.mqtt_port, "pub", V5)
    pub.publish(topic_for(a, "a", "news"), b"late", 1)
    pub.publish("marker", b"after", 1)
    assert sub.expect().payload == b"after"
    sub.expect_none()


async def test_amqp_publish_confirmed_on_one_node_reaches_consumer_on_the_other(pair):
    a, b = pair["a"], pair["b"]
    received: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
    url_a = f"amqp://guest:guest@127.0.0.1:{a.port('amqp')}/"
    url_b = f"amqp://guest:guest@127.0.0.1:{b.port('amqp')}/"
    async with await aio_pika.connect(url_b) as consumer_conn, await aio_pika.connect(url_a) as producer_conn:
        channel = await consumer_conn.channel()
        queue = await channel.declare_queue("", exclusive=True)
        await queue.bind("amq.topic", "orders.#")
        await queue.consume(received.put, no_ack=True)
        await asyncio.to_thread(routes_reach, pair, "b", 2)  # the queue's name and its binding
        out = await producer_conn.channel(publisher_confirms=True)
        exchange = await out.get_exchange("amq.topic")
        keys = [topic_for(a, owner).replace("/", ".") for owner in ("a", "b")]
        for key in keys:
            confirmation = await exchange.publish(aio_pika.Message(key.encode()), key)
            assert isinstance(confirmation, aiormq.spec.Basic.Ack)
        bodies = sorted([(await asyncio.wait_for(received.get(), 5)).body for _ in keys])
        assert bodies == sorted(key.encode() for key in keys)


async def test_grpc_sdk_publish_on_one_node_reaches_consumer_on_the_other(pair):
    a, b = pair["a"], pair["b"]
    async with Client(f"127.0.0.1:{b.port('grpc')}") as client_b, \
            Client(f"127.0.0.1:{a.port('grpc')}") as client_a:
        consumer = client_b.consumer("cross", ["orders/#"])
        await consumer.subscribe()
        await asyncio.to_thread(routes_reach, pair, "b")
        producer = client_a.producer()
        topics = [topic_for(a, owner) for owner in ("a", "b")]
        for topic in topics:
            receipt = await producer.send(topic, topic)
            assert receipt.offset >= 0 and owner_of(receipt.shard) in NODES
        texts = sorted([(await consumer.receive(5)).text() for _ in topics])
        assert texts == sorted(topics)


def test_publish_while_the_owner_is_gone_gets_a_retryable_error(pair, monkeypatch):
    # a forwarded publish is held for a next leader first (FORWARD_HOLD_S, shortened here: no
    # other node ever leads in this static view), then refused retryably
    monkeypatch.setattr(forwarding, "FORWARD_HOLD_S", 0.3)
    a, b = pair["a"], pair["b"]
    topic = topic_for(a, "b")
    b.server.call(b.plane.stop())
    raw = RawClient(a.mqtt_port, version=5)
    raw.connect("pub")
    raw.send(p.Publish(topic, b"x", 1, packet_id=1))
    puback = raw.receive()
    assert isinstance(puback, p.Puback)
    assert puback.reason_code == 0x80
    assert "retry" in (puback.properties.reason_string or "") or "node b" in (
        puback.properties.reason_string or ""
    )
    raw.close()


async def test_grpc_publish_while_the_owner_is_gone_is_unavailable(pair, monkeypatch):
    # a forwarded publish is held for a next leader first (FORWARD_HOLD_S, shortened here: no
    # other node ever leads in this static view), then refused retryably
    monkeypatch.setattr(forwarding, "FORWARD_HOLD_S", 0.3)
    a, b = pair["a"], pair["b"]
    b.server.call(b.plane.stop())
    async with Client(f"127.0.0.1:{a.port('grpc')}") as client_a:
        with pytest.raises(Unavailable):
            await client_a.producer().send(topic_for(a, "b"), "x")


@pytest.mark.parametrize("version", VERSIONS)
def test_persistent_session_gets_what_was_published_on_another_node_while_it_was_away(pair, version):
    a, b = pair["a"], pair["b"]
    options = {"clean": False, "session_expiry": 300} if version == V5 else {"clean": False}
    sub = Paho(b.mqtt_port, "keeper", version, **options)
    sub.subscribe("orders/#", 1)
    routes_reach(pair, "b")
    sub.disconnect()
    pub = Paho(a.mqtt_port, "pub", version)
    topics = [topic_for(a, owner) for owner in ("a", "b")]
    for topic in topics:
        pub.publish(topic, topic, 1)
    sub = Paho(b.mqtt_port, "keeper", version, **options)
    assert sorted(m.payload.decode() for m in sub.expect_n(2)) == sorted(topics)
    sub.expect_none()
    sub.disconnect()
    pub.disconnect()


@pytest.mark.parametrize("owner", ["a", "b"])
def test_retained_message_set_on_one_node_is_read_on_the_other(pair, owner):
    a, b = pair["a"], pair["b"]
    topic = topic_for(a, owner, "status")
    pub = Paho(a.mqtt_port, "pub", V5)
    pub.publish(topic, b"online", 1, retain=True)
    wait_for(lambda: b.server.call(lambda: b.server.app.broker.retained.get(topic)) is not None)
    late = Paho(b.mqtt_port, "late", V5)
    late.subscribe("status/#", 1)
    message = late.expect()
    assert (message.topic, message.payload, message.retain) == (topic, b"online", True)
    pub.publish(topic, b"", 1, retain=True)
    wait_for(lambda: b.server.call(lambda: b.server.app.broker.retained.get(topic)) is None)
    pub.disconnect()
    late.disconnect()


async def test_amqp_publish_while_the_owner_is_gone_is_nacked(pair, monkeypatch):
    # a forwarded publish is held for a next leader first (FORWARD_HOLD_S, shortened here: no
    # other node ever leads in this static view), then refused retryably
    monkeypatch.setattr(forwarding, "FORWARD_HOLD_S", 0.3)
    a, b = pair["a"], pair["b"]
    b.server.call(b.plane.stop())
    async with await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{a.port('amqp')}/") as conn:
        channel = await conn.channel(publisher_confirms=True)
        exchange = await channel.get_exchange("amq.topic")
        key = topic_for(a, "b").replace("/", ".")
        with pytest.raises(aio_pika.exceptions.DeliveryError):
            await exchange.publish(aio_pika.Message(b"x"), key, mandatory=False)
        # the channel stays usable: a publish for a shard of this node is confirmed
        own = topic_for(a, "a").replace("/", ".")
        confirmation = await exchange.publish(aio_pika.Message(b"y"), own, mandatory=False)
        assert isinstance(confirmation, aiormq.spec.Basic.Ack)


def test_delayed_message_published_on_one_node_reaches_the_other_when_due(pair):
    a, b = pair["a"], pair["b"]
    sub = Paho(b.mqtt_port, "sub", V5)
    sub.subscribe("orders/#", 1)
    routes_reach(pair, "b")
    pub = Paho(a.mqtt_port, "pub", V5)
    topics = [topic_for(a, owner) for owner in ("a", "b")]
    for topic in topics:
        pub.publish(f"$delayed/1/{topic}", topic, 1)
    sub.expect_none(within=0.5)  # held on a until due
    got = sorted(m.payload.decode() for m in sub.expect_n(2))
    assert got == sorted(topics)
    pub.disconnect()
    sub.disconnect()
