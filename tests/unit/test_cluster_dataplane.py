"""The cluster data plane between two in-process nodes on real loopback links: forwarding
to a shard's owner, the route table and pushes to subscribers' nodes, shared subscriptions
spread across nodes, and the retryable errors when ownership is not where the sender thinks."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from shardgate.core.broker import Broker
from shardgate.core.errors import ShardUnavailable
from shardgate.core.message import Message
from shardgate.core.streams import RoutingRule, StreamConfig
from shardgate.core.subscriptions import SubscriptionType
from shardgate.proto import cluster_pb2 as pb
from shardgate.storage.journal import JournalStorage

from shardgate.cluster.data_plane import DataPlane
from shardgate.cluster.frames import pack_records, route_update
from shardgate.cluster.link import MAX_FRAME_BYTES, FrameReader, frame_bytes
from shardgate.cluster.link_auth import (
    HANDSHAKE_MAX_BYTES,
    LINK_MAGIC,
    DialerHandshake,
    NodeCredentials,
)
from shardgate.cluster.membership import NodeInfo, ShardAssignment, StaticClusterView
from shardgate.cluster.plane_ports import NoOwnerReads, NoReplicas, OwnerReads
from shardgate.cluster.routes import Route, RouteDelta


class Recorder:
    """A consumer standing in for a client: keeps what it is handed."""

    def __init__(self, name: str) -> None:
        self.consumer_id = name
        self.available = True
        self.got: list[Message] = []

    def deliver(self, message, subscription, filters):  # type: ignore[no-untyped-def]
        self.got.append(message)


class OwnerReadsOfTest:
    """The planes' `OwnerReads` here: none (as a plane alone) until a test gives one (`reads`)."""

    def __init__(self) -> None:
        self.reads: OwnerReads = NoOwnerReads()

    def owner_log(self, plane, stream, shard, start, filters, since_ms):  # type: ignore[no-untyped-def]
        return self.reads.owner_log(plane, stream, shard, start, filters, since_ms)


class OwnerJournal:
    """The owner's own shard log, read in process, marked as a remote shard's log as
    `shard_reader.OwnerLog` is: a cursor on it is read from the owner again at the owner's
    next word of dropped pushes (without the mark, a cursor that had read it to its end was
    left there, and pushes dropped after that were skipped)."""

    remote_shard = True

    def __init__(self, log: object) -> None:
        self._log = log

    def __getattr__(self, name: str) -> object:
        return getattr(self._log, name)


class JournalOf:
    """`OwnerReads` reading the owner's journal in process (in a real cluster an `OwnerLog`
    reads it over the cluster port); keeps what it was asked for."""

    def __init__(self, owner: Broker) -> None:
        self.owner = owner
        self.asked: list[tuple[str, int, int]] = []

    def owner_log(self, plane, stream, shard, start, filters, since_ms):  # type: ignore[no-untyped-def]
        self.asked.append((stream, shard, start))
        return OwnerJournal(self.owner.streams[stream].shards[shard].log)


class GoneRecorder:
    """The planes' `PeerWatch` here: keeps the peers it is told are gone."""

    def __init__(self) -> None:
        self.gone: list[NodeInfo] = []

    def peer_gone(self, info: NodeInfo) -> None:
        self.gone.append(info)


async def until(condition: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


@dataclass
class Node:
    node_id: str
    broker: Broker
    view: StaticClusterView
    plane: DataPlane
    owner_reads: OwnerReadsOfTest
    peers: GoneRecorder

    def subscribe(self, topic_filter: str, name: str | None = None, shared: bool = False) -> Recorder:
        kind = SubscriptionType.SHARED if shared else SubscriptionType.EXCLUSIVE
        sub = self.broker.subscription(name or f"{self.node_id}:{topic_filter}", kind)
        self.broker.add_filter(sub, topic_filter)
        consumer = Recorder(f"{self.node_id}-{len(sub.consumers)}")
        self.broker.attach(sub, consumer)
        return consumer


def make_broker(journal_dir: Path | None) -> Broker:
    storage = JournalStorage(journal_dir) if journal_dir is not None else None
    broker = Broker(storage=storage)
    broker.create_stream(StreamConfig("orders", partitions=4))
    broker.add_route(RoutingRule("orders/#", "orders"))
    if storage is not None:
        broker.create_stream(StreamConfig("ledger", mode="reliable"))
        broker.add_route(RoutingRule("ledger/#", "ledger"))
    return broker


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[dict[str, Node]]:
    """Nodes a and b. a owns default/0 and orders/0,1; b owns orders/2,3 and ledger/0."""
    owners = {("default", 0): "a", ("orders", 0): "a", ("orders", 1): "a",
              ("orders", 2): "b", ("orders", 3): "b", ("ledger", 0): "b"}
    assignments = {key: ShardAssignment(key[0], key[1], node, 1) for key, node in owners.items()}
    nodes: dict[str, Node] = {}
    for node_id in ("a", "b"):
        broker = make_broker(tmp_path / node_id)
        view = StaticClusterView(node_id, {}, dict(assignments))
        owner_reads, peers = OwnerReadsOfTest(), GoneRecorder()
        plane = DataPlane(broker, view, owner_reads=owner_reads, peers=peers)
        await plane.start()
        nodes[node_id] = Node(node_id, broker, view, plane, owner_reads, peers)
    infos = {n.node_id: NodeInfo(n.node_id, f"127.0.0.1:{n.plane.port}") for n in nodes.values()}
    for node in nodes.values():
        node.view.node_infos = dict(infos)
        node.view.changed()
    await until(lambda: all(link.connected for n in nodes.values() for link in n.plane.links.values()))
    yield nodes
    for node in nodes.values():
        await node.plane.stop()
        if node.broker.storage is not None:
            node.broker.storage.close()


def topic_on(broker: Broker, stream: str, shard: int, prefix: str) -> str:
    """A topic of `stream` that hashes to `shard`."""
    for index in range(1000):
        topic = f"{prefix}/{index}"
        if broker.stream_for_topic(topic).shard_for(topic, None).index == shard:
            return topic
    raise AssertionError("no topic found")


async def routes_seen(by: Node, of: Node, count: int) -> None:
    await until(lambda: len(by.plane.remote.routes_of(of.node_id)) == count)


async def test_publish_for_a_remote_shard_is_stored_by_its_owner_and_reaches_its_subscriber(cluster):
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 2, "orders")
    on_b = b.subscribe("orders/#")
    await routes_seen(a, b, 1)
    message = Message(topic, b"hello", qos=1)
    pending = a.broker.publish(message)
    assert pending is not None, "a publish for b's shard must wait for b's answer"
    await asyncio.wait_for(pending, 5)
    assert message.offset == 0
    assert [m.payload for m in on_b.got] == [b"hello"]
    assert on_b.got[0].stream == "orders" and on_b.got[0].shard == 2
    assert a.plane.stats.forwarded == 1 and b.plane.stats.forwarded_in == 1


async def test_owner_pushes_each_message_once_to_each_interested_node(cluster):
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 0, "orders")
    first, second = b.subscribe("orders/#"), b.subscribe("orders/+")
    here = a.subscribe("orders/#")
    await routes_seen(a, b, 2)
    for index in range(50):
        assert a.broker.publish(Message(topic, str(index).encode())) is None
    await until(lambda: len(first.got) == 50 and len(second.got) == 50)
    expected = [str(i).encode() for i in range(50)]
    assert [m.payload for m in first.got] == expected, "per-shard order is kept"
    assert [m.payload for m in second.got] == expected
    assert [m.payload for m in here.got] == expected
    assert a.plane.stats.pushed == 50, "one push per message to node b, however many subscribers"


async def test_messages_forwarded_from_a_node_reach_subscribers_on_the_same_node(cluster):
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 3, "orders")
    on_a = a.subscribe("orders/#")
    await routes_seen(b, a, 1)
    pending = [a.broker.publish(Message(topic, str(i).encode(), qos=1)) for i in range(20)]
    await asyncio.wait_for(asyncio.gather(*pending), 5)  # type: ignore[arg-type]
    await until(lambda: len(on_a.got) == 20)
    assert [m.payload for m in on_a.got] == [str(i).encode() for i in range(20)]
    assert [m.offset for m in on_a.got] == list(range(20))


async def test_forward_to_a_reliable_shard_is_answered_once_the_owner_journal_holds_it(cluster):
    a, b = cluster["a"], cluster["b"]
    message = Message("ledger/x", b"entry", qos=1)
    pending = a.broker.publish(message)
    assert pending is not None
    await asyncio.wait_for(pending, 5)
    log = b.broker.stream("ledger").shards[0].log
    assert log is not None and log.commit_waiter() is None, "answered only when durable"
    [record] = log.read(0)
    assert message.offset == record.offset == 0
    assert a.broker.stream("ledger").shards[0].log.next_offset == 0, "a stores nothing"  # type: ignore[union-attr]


async def test_unsubscribing_stops_the_pushes(cluster):
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 0, "orders")
    on_b = b.subscribe("orders/#", name="s")
    await routes_seen(a, b, 1)
    b.broker.remove_subscription("s")
    await routes_seen(a, b, 0)
    a.broker.publish(Message(topic, b"x"))
    assert a.plane.stats.pushed == 0 and on_b.got == []


async def test_shared_subscription_spreads_across_nodes_without_duplicates(cluster):
    a, b = cluster["a"], cluster["b"]
    group = "$share/workers/orders/#"
    on_a = a.subscribe("orders/#", name=group, shared=True)
    on_b = b.subscribe("orders/#", name=group, shared=True)
    await routes_seen(a, b, 1)
    await routes_seen(b, a, 1)
    pending = []
    for index in range(200):
        result = a.broker.publish(Message(f"orders/{index}", str(index).encode(), qos=1))
        if result is not None:
            pending.append(result)
    await asyncio.wait_for(asyncio.gather(*pending), 5)
    await until(lambda: len(on_a.got) + len(on_b.got) >= 200)
    got = sorted(int(m.payload) for m in on_a.got + on_b.got)
    assert got == list(range(200)), "every message exactly once across the group"
    assert on_a.got and on_b.got, "both nodes' members take a share"


async def test_publish_refused_with_a_retryable_error_when_the_owner_disagrees(cluster, monkeypatch):
    from shardgate.cluster import forwarding

    monkeypatch.setattr(forwarding, "VIEW_CATCH_UP_S", 0.2)
    monkeypatch.setattr(forwarding, "FORWARD_HOLD_S", 0.3)  # (held for a new leader until then)
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 2, "orders")
    # b handed orders/2 over to a, and a never hears of it
    b.view.assignments[("orders", 2)] = ShardAssignment("orders", 2, "a", 2)
    pending = a.broker.publish(Message(topic, b"x", qos=1))
    assert pending is not None
    with pytest.raises(ShardUnavailable, match="moved and this node has not learned where yet"):
        await asyncio.wait_for(pending, 5)


async def test_a_sender_behind_the_owner_waits_for_its_view_then_follows_the_shard(cluster):
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 2, "orders")
    here = a.subscribe("orders/#")
    moved = ShardAssignment("orders", 2, "a", 2)
    b.view.assignments[("orders", 2)] = moved  # b knows first; a's watch is slower
    pending = a.broker.publish(Message(topic, b"late view", qos=1))
    assert pending is not None
    await until(lambda: a.plane.forwarding._epoch_waiters)  # refused by b, waiting for a's view
    a.view.assignments[("orders", 2)] = moved
    a.view.changed()
    await asyncio.wait_for(pending, 5)
    assert [m.payload for m in here.got] == [b"late view"]
    assert a.plane.stats.forward_failures == 0


async def test_an_owner_behind_the_sender_waits_for_its_view_instead_of_refusing(cluster):
    """The controller writes a new shard map and acts on it at once; the new owner learns it
    from its etcd watch a little later. A forward arriving in between is stored once the
    owner's view catches up, not refused (the race seen right after a cluster starts)."""
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 0, "orders")  # a owns orders/0 at epoch 1
    on_b = b.subscribe("orders/#")
    await routes_seen(a, b, 1)
    moved = ShardAssignment("orders", 0, "b", 2)
    a.view.assignments[("orders", 0)] = moved  # a (the controller) moved it to b
    pending = a.broker.publish(Message(topic, b"early", qos=1))
    assert pending is not None, "forwarded to b"
    await until(lambda: b.plane.forwarding._epoch_waiters)  # b holds it: its view is behind
    assert not pending.done()
    b.view.assignments[("orders", 0)] = moved
    b.view.changed()
    await asyncio.wait_for(pending, 5)
    assert [m.payload for m in on_b.got] == [b"early"]
    assert a.plane.stats.forward_failures == 0


async def test_publish_to_an_unassigned_shard_is_refused_at_once(cluster):
    a = cluster["a"]
    del a.view.assignments[("orders", 2)]
    pending = a.broker.publish(Message(topic_on(a.broker, "orders", 2, "orders"), b"x"))
    assert pending is not None and pending.done()
    with pytest.raises(ShardUnavailable, match="no node owns orders/2"):
        pending.result()


async def test_forwards_in_flight_fail_retryably_when_the_owner_goes_away(cluster, monkeypatch):
    from shardgate.cluster import forwarding

    # (held for the shard's next leader first: `test_forward_hold.py`)
    monkeypatch.setattr(forwarding, "FORWARD_HOLD_S", 0.3)
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 2, "orders")
    await b.plane.stop()
    pending = [a.broker.publish(Message(topic, b"x", qos=1)) for _ in range(3)]
    for future in pending:
        with pytest.raises(ShardUnavailable):
            await asyncio.wait_for(future, 5)  # type: ignore[arg-type]
    assert a.plane.stats.forward_failures >= 3


async def test_routes_of_a_node_that_leaves_the_view_are_forgotten(cluster):
    a, b = cluster["a"], cluster["b"]
    b.subscribe("orders/#")
    await routes_seen(a, b, 1)
    del a.view.node_infos["b"]
    a.view.changed()
    assert a.plane.remote.routes_of("b") == frozenset()
    assert "b" not in a.plane.links


async def test_metrics_count_forwarded_messages_once_and_their_latency(cluster):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.registry import Collector

    from shardgate.cluster.metrics import data_plane_metrics

    a = cluster["a"]
    pending = a.broker.publish(Message(topic_on(a.broker, "orders", 2, "orders"), b"x", qos=1))
    await asyncio.wait_for(pending, 5)  # type: ignore[arg-type]

    class Plane(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            return data_plane_metrics(a.plane)

    registry = CollectorRegistry()
    registry.register(Plane())
    text = generate_latest(registry).decode()
    assert 'shardgate_cluster_forwarded_messages_total{direction="out"} 1.0' in text
    assert "shardgate_cluster_forward_latency_seconds_count 1.0" in text
    assert 'shardgate_cluster_link_up{peer="b"} 1.0' in text
    # counted as received once, by the node the client published to
    assert (a.broker.stats.messages_in, cluster["b"].broker.stats.messages_in) == (1, 0)


async def test_system_topics_stay_on_their_node(cluster):
    a, b = cluster["a"], cluster["b"]
    a.broker.create_stream(StreamConfig("sys"))
    a.broker.add_route(RoutingRule("$SYS/#", "sys"))
    b.subscribe("$SYS/#")
    await routes_seen(a, b, 1)
    here = a.subscribe("$SYS/#")
    assert a.broker.publish(Message("$SYS/broker/uptime", b"1")) is None, "stored here, unplaced"
    assert len(here.got) == 1 and a.plane.stats.pushed == 0


async def test_properties_cross_nodes_intact_on_both_paths(cluster):
    a, b = cluster["a"], cluster["b"]
    on_b = b.subscribe("orders/#")
    await routes_seen(a, b, 1)
    for shard in (0, 2):  # stored by a and pushed; forwarded to b
        message = Message(
            topic_on(a.broker, "orders", shard, "orders"), b"{}", qos=1, key=None,
            headers=[("tenant", "acme")], content_type="application/json", reply_to="replies",
            correlation_data=b"c1", expires_at_ms=4_102_444_800_000, producer_protocol="amqp",
        )
        pending = a.broker.publish(message)
        if pending is not None:
            await asyncio.wait_for(pending, 5)
    await until(lambda: len(on_b.got) == 2)
    for got in on_b.got:
        assert got.headers == [("tenant", "acme")] and got.content_type == "application/json"
        assert (got.reply_to, got.correlation_data) == ("replies", b"c1")
        assert got.expires_at_ms == 4_102_444_800_000 and got.producer_protocol == "amqp"


async def test_a_refused_forward_follows_the_shard_to_its_new_owner(cluster):
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 2, "orders")
    here = a.subscribe("orders/#")
    # b handed orders/2 to a; a learns of it while its forward is on the way to b
    moved = ShardAssignment("orders", 2, "a", 2)
    b.view.assignments[("orders", 2)] = moved
    message = Message(topic, b"moved", qos=1)
    pending = a.broker.publish(message)
    assert pending is not None
    a.view.assignments[("orders", 2)] = moved
    await asyncio.wait_for(pending, 5)
    assert [m.payload for m in here.got] == [b"moved"]
    assert message.offset == 0 and a.plane.stats.forward_failures == 0


async def test_retained_messages_reach_every_node_and_their_clearing_too(cluster):
    a, b = cluster["a"], cluster["b"]
    for shard in (0, 2):  # stored by a, and forwarded to b
        topic = topic_on(a.broker, "orders", shard, "orders")
        pending = a.broker.publish(Message(topic, b"last", retain=True, qos=1))
        if pending is not None:
            await asyncio.wait_for(pending, 5)
        await until(lambda topic=topic: all(n.broker.retained.get(topic) is not None for n in (a, b)))
        assert b.broker.retained.get(topic).payload == b"last"  # type: ignore[union-attr]
        pending = a.broker.publish(Message(topic, b"", retain=True, qos=1))
        if pending is not None:
            await asyncio.wait_for(pending, 5)
        await until(lambda topic=topic: all(n.broker.retained.get(topic) is None for n in (a, b)))


async def test_a_node_that_dials_in_gets_the_retained_messages_of_the_shards_a_peer_owns(cluster):
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 0, "orders")
    await b.plane.stop()
    a.broker.publish(Message(topic, b"while away", retain=True))
    assert b.broker.retained.get(topic) is None
    await b.plane.start()
    await until(lambda: b.broker.retained.get(topic) is not None)


async def test_forwards_past_the_link_bound_are_refused_retryably_not_queued(cluster, monkeypatch):
    from shardgate.cluster import peer_link

    a = cluster["a"]
    monkeypatch.setattr(peer_link, "MAX_FORWARDS_IN_FLIGHT", 3)
    topic = topic_on(a.broker, "orders", 2, "orders")
    pending = [a.broker.publish(Message(topic, str(i).encode(), qos=1)) for i in range(5)]
    refused = [f for f in pending if f is not None and f.done()]
    assert len(refused) == 2
    for future in refused:
        with pytest.raises(ShardUnavailable, match="too many publishes waiting"):
            future.result()
    await asyncio.wait_for(asyncio.gather(*pending[:3]), 5)  # type: ignore[arg-type]
    # the bound is on what waits: once answered, the link takes more
    assert await asyncio.wait_for(a.broker.publish(Message(topic, b"more", qos=1)), 5) is None  # type: ignore[arg-type]


async def test_a_share_group_spreads_by_members_not_by_nodes(cluster):
    a, b = cluster["a"], cluster["b"]
    group = "$share/workers/orders/#"
    on_a = a.subscribe("orders/#", name=group, shared=True)
    on_b = [b.subscribe("orders/#", name=group, shared=True) for _ in range(3)]
    await until(lambda: a.plane.remote.routes_of("b") == {Route("orders/#", group, 3)})
    topic = topic_on(a.broker, "orders", 0, "orders")
    for index in range(400):
        a.broker.publish(Message(topic, str(index).encode()))
    await until(lambda: len(on_a.got) + sum(len(r.got) for r in on_b) == 400)
    assert len(on_a.got) == 100, "one member of four: a quarter of the messages"


async def test_durable_cursors_made_before_the_shard_map_replay_from_what_the_node_receives(cluster):
    from shardgate.cluster.received import ReceivedLog

    a, b = cluster["a"], cluster["b"]
    moved = ShardAssignment("ledger", 0, "a", 2)  # a leads ledger/0; b keeps an (empty) journal
    # b restarted: its durable subscription came back before it knew the shard map
    b.broker.placement = None
    sub = b.broker.durable_subscription("keeper", initial_position="earliest")
    b.broker.add_filter(sub, "ledger/#")
    b.broker.placement = b.plane
    assert not isinstance(sub.cursors[("ledger", 0)].log, ReceivedLog)
    for node in (a, b):
        node.view.assignments[("ledger", 0)] = moved
        node.view.changed()
    assert isinstance(sub.cursors[("ledger", 0)].log, ReceivedLog)
    await routes_seen(a, b, 1)
    await asyncio.wait_for(a.broker.publish(Message("ledger/x", b"kept", qos=1)), 5)  # type: ignore[arg-type]
    await until(lambda: len(b.plane.received_log("ledger", 0)) == 1)
    consumer = Recorder("late")
    b.broker.attach(sub, consumer)  # the client comes back: replayed from what b received
    await until(lambda: [m.payload for m in consumer.got] == [b"kept"])


class RawLink:
    """A hand-made peer on a node's cluster port: frames written and replies read as bytes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.frames = FrameReader()
        self.replies: list[bytes] = []

    @classmethod
    async def open(cls, node: Node, as_node: str) -> RawLink:
        """A link to `node` from `as_node`, which proves itself (registered in `node`'s view
        first if it is not there: a node id etcd does not know is refused)."""
        if as_node not in node.view.node_infos:
            node.view.node_infos[as_node] = NodeInfo(as_node, "127.0.0.1:9")
        reader, writer = await asyncio.open_connection("127.0.0.1", node.plane.port)
        handshake = DialerHandshake(NodeCredentials(as_node), node.node_id)
        writer.write(LINK_MAGIC + handshake.hello())
        link = cls(reader, writer)
        link.frames.limit = HANDSHAKE_MAX_BYTES
        writer.write(handshake.answer(await link.read_raw()))
        handshake.accepted(await link.read_raw())
        link.frames.limit = MAX_FRAME_BYTES
        return link

    async def read_raw(self) -> bytes:
        while not self.replies:
            data = await asyncio.wait_for(self.reader.read(65536), 5)
            assert data, "the node closed the link"
            self.replies += self.frames.feed(data, 1)
        return self.replies.pop(0)

    def write(self, frame: pb.PeerFrame) -> None:
        self.writer.write(frame_bytes(frame))

    async def read(self) -> pb.PeerReply:
        while not self.replies:
            data = await asyncio.wait_for(self.reader.read(65536), 5)
            assert data, "the node closed the link"
            self.replies += self.frames.feed(data)
        return pb.PeerReply.FromString(self.replies.pop(0))

    def close(self) -> None:
        self.writer.close()


async def test_malformed_frames_from_a_peer_are_refused_per_message_and_the_link_lives(cluster):
    b = cluster["b"]
    link = await RawLink.open(b, "intruder")
    link.write(pb.PeerFrame(sequence=1, from_node="intruder", forwards=[
        pb.Forward(stream="orders", shard=2, record=b"\x07garbage"),
        pb.Forward(stream="orders", shard=2, topic=topic_on(b.broker, "orders", 2, "orders"), payload=b"ok"),
    ], pushes=[pb.Push(stream="orders", shard=0, offset=1, record=b"\x00")]))
    reply = await link.read()
    assert [o.code for o in reply.outcomes] == [pb.REJECTED, pb.STORED]
    assert "malformed" in reply.outcomes[0].reason
    link.write(pb.PeerFrame(sequence=2, forwards=[
        pb.Forward(stream="orders", shard=2, topic=topic_on(b.broker, "orders", 2, "orders"), payload=b"again"),
    ]))
    assert (await link.read()).outcomes[0].code == pb.STORED
    link.close()


async def test_bytes_that_are_not_frames_end_that_link_only(cluster):
    a, b = cluster["a"], cluster["b"]
    link = await RawLink.open(b, "c")
    link.writer.write(b"\xff\xff\xff\xff not a frame")
    assert await asyncio.wait_for(link.reader.read(), 5) == b"", "the node ends that connection"
    link.close()
    # the real peers' links still work
    on_b = b.subscribe("orders/#")
    await routes_seen(a, b, 1)
    topic = topic_on(a.broker, "orders", 2, "orders")
    await asyncio.wait_for(a.broker.publish(Message(topic, b"still", qos=1)), 5)
    assert [m.payload for m in on_b.got] == [b"still"]


async def test_the_cluster_port_still_serves_grpc_calls_of_registered_nodes_only(cluster):
    """The shared-state gRPC calls reach the node on the same port as the links, when they
    come from a node of the view that proves the cluster secret; others are UNAUTHENTICATED."""
    import grpc

    from shardgate.cluster.link_auth import cluster_channel

    b = cluster["b"]
    calls = []

    def hello(request: bytes, context) -> bytes:
        calls.append(request)
        return b"hi " + request

    b.plane.add_service(grpc.method_handlers_generic_handler(
        "test.Echo", {"Say": grpc.unary_unary_rpc_method_handler(hello)}))
    address = f"127.0.0.1:{b.plane.port}"
    async with cluster_channel(address, NodeCredentials("a"), []) as channel:
        say = channel.unary_unary("/test.Echo/Say")
        assert await asyncio.wait_for(say(b"there"), 5) == b"hi there"
    for channel in (grpc.aio.insecure_channel(address),  # no credentials
                    cluster_channel(address, NodeCredentials("a", secret=b"x" * 16), []),  # another secret
                    cluster_channel(address, NodeCredentials("stranger"), [])):  # not in the view
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(channel.unary_unary("/test.Echo/Say")(b"sneaky"), 5)
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert calls == [b"there"]


async def test_a_frame_sent_again_on_a_new_stream_of_its_session_is_applied_once(cluster):
    b = cluster["b"]
    on_b = b.subscribe("orders/#")
    topic = topic_on(b.broker, "orders", 2, "orders")  # b owns orders/2
    frame = pb.PeerFrame(sequence=1, forwards=[
        pb.Forward(stream="orders", shard=2, epoch=1, topic=topic, payload=b"once")])

    async def send(session: int) -> pb.PeerReply:
        """A new connection of `session` (as after a break) carrying frame 1 again."""
        link = await RawLink.open(b, "c")
        link.write(pb.PeerFrame(sequence=0, from_node="c", session=session))
        link.write(frame)
        reply = await link.read()
        link.close()
        return reply

    for _ in range(2):
        reply = await send(session=7)
        assert reply.sequence == 1 and [o.code for o in reply.outcomes] == [pb.STORED]
        assert reply.outcomes[0].offset == 0, "answered again with the first outcome"
    assert [m.payload for m in on_b.got] == [b"once"]
    await send(session=8)  # a new session: the sender restarted, its frame 1 is new
    assert [m.payload for m in on_b.got] == [b"once", b"once"]


async def test_routes_say_whether_the_subscription_is_durable(cluster):
    a, b = cluster["a"], cluster["b"]
    b.subscribe("orders/live/#")
    kept = b.broker.durable_subscription("kept")
    b.broker.add_filter(kept, "orders/kept/#")
    await routes_seen(a, b, 2)
    assert a.plane.remote.routes_of("b") == {
        Route("orders/live/#"), Route("orders/kept/#", durable=True)}
    assert a.plane.wanted_elsewhere("orders/live/1") and not a.plane.wanted_durably_elsewhere("orders/live/1")
    assert a.plane.wanted_durably_elsewhere("orders/kept/1")


async def test_a_transient_message_is_journaled_by_its_owner_only_for_a_durable_subscription_elsewhere(cluster):
    """b owns the journaled ledger/0. A transient message (AMQP delivery mode 1) that only a
    live subscription on a wants is delivered without being journaled; once a durable
    subscription on a wants it too, it is journaled (the durable cursor needs its offset)."""
    a, b = cluster["a"], cluster["b"]
    log = b.broker.streams["ledger"].shards[0]
    live = a.subscribe("ledger/#")
    await routes_seen(b, a, 1)
    b.broker.publish(Message("ledger/x", b"passing", transient=True))
    await until(lambda: [m.payload for m in live.got] == [b"passing"])
    assert log.next_offset == 0, "not journaled: nobody replays it"

    kept = a.broker.durable_subscription("kept")
    a.broker.add_filter(kept, "ledger/#")
    await routes_seen(b, a, 2)
    stored = b.broker.publish(Message("ledger/x", b"kept", transient=True))
    assert stored is not None
    await asyncio.wait_for(stored, 5)
    assert log.next_offset == 1, "journaled for the durable subscription on a"
    await until(lambda: [m.payload for m in live.got] == [b"passing", b"kept"])


async def test_a_packed_batch_is_stored_in_one_pass_with_its_offsets_and_bad_records_refused_alone(cluster):
    """A `ForwardBatch` as a peer writes it: every message's record behind its length. The owner
    answers with each message's offset; a record that does not decode is refused by its index,
    and one for a shard this node does not own is refused as NOT_OWNER, the others stored."""
    b = cluster["b"]
    on_b = b.subscribe("orders/#")
    topic = topic_on(b.broker, "orders", 2, "orders")  # b owns orders/2
    good = [Message(topic, f"m{i}".encode(), qos=1) for i in range(3)]
    records = pack_records(good[:2]) + struct.pack("<I", 3) + b"\x07xx" + pack_records(good[2:])
    link = await RawLink.open(b, "c")
    link.write(pb.PeerFrame(sequence=0, from_node="c", session=1, heartbeat_ms=60_000))
    assert (await link.read()).heartbeat, "the hello is answered at once"
    link.write(pb.PeerFrame(sequence=1, batches=[
        pb.ForwardBatch(stream="orders", shard=2, epoch=1, records=records),
        pb.ForwardBatch(stream="orders", shard=0, epoch=1, records=pack_records(
            [Message(topic_on(b.broker, "orders", 0, "orders"), b"a's", qos=1)])),
    ]))
    reply = await link.read()
    assert reply.sequence == 1 and len(reply.batches) == 2
    stored, not_owned = reply.batches
    assert [(o.index, o.code) for o in stored.refused] == [(2, pb.REJECTED)]
    assert "malformed" in stored.refused[0].reason
    assert [stored.offsets[i] for i in (0, 1, 3)] == [0, 1, 2]
    assert [(o.index, o.code) for o in not_owned.refused] == [(0, pb.NOT_OWNER)]
    assert [m.payload for m in on_b.got] == [b"m0", b"m1", b"m2"]
    link.close()


async def test_an_unacknowledged_batch_is_answered_without_offsets(cluster):
    b = cluster["b"]
    on_b = b.subscribe("orders/#")
    topic = topic_on(b.broker, "orders", 2, "orders")
    link = await RawLink.open(b, "c")
    link.write(pb.PeerFrame(sequence=0, from_node="c", session=2))
    link.write(pb.PeerFrame(sequence=1, batches=[pb.ForwardBatch(
        stream="orders", shard=2, epoch=1, unacknowledged=True,
        records=pack_records([Message(topic, b"q0-1"), Message(topic, b"q0-2")]))]))
    reply = await link.read()
    assert reply.sequence == 1 and not reply.batches[0].offsets and not reply.batches[0].refused
    assert [m.payload for m in on_b.got] == [b"q0-1", b"q0-2"]
    link.close()


async def test_qos0_publishes_of_one_write_share_a_future_and_qos1_get_their_offsets(cluster):
    a, b = cluster["a"], cluster["b"]
    on_b = b.subscribe("orders/#")
    topic = topic_on(a.broker, "orders", 2, "orders")  # b owns it: a forwards
    messages = [Message(topic, f"{qos}-{i}".encode(), qos=qos) for i in range(3) for qos in (0, 1)]
    outcomes = a.broker.publish_many(messages)
    assert all(isinstance(outcome, asyncio.Future) for outcome in outcomes)
    assert len({id(outcomes[i]) for i in (0, 2, 4)}) == 1, "the QoS 0 ones share one future"
    assert len({id(outcomes[i]) for i in (1, 3, 5)}) == 3
    await asyncio.wait_for(asyncio.gather(*outcomes), 5)
    assert [messages[i].offset for i in (1, 3, 5)] == [1, 3, 5]
    assert [m.payload for m in on_b.got] == [m.payload for m in messages], "in order"


async def test_a_silent_peer_fails_the_link_and_its_waiting_forwards_retryably(cluster, monkeypatch):
    """A peer that accepts the connection and reads but never answers (as a frozen process's
    kernel does): the forwards waiting for it fail with the retryable error after the link
    timeout (and the hold for a next leader, `test_forward_hold.py`), and the link is
    redialed."""
    from shardgate.cluster import forwarding

    monkeypatch.setattr(forwarding, "FORWARD_HOLD_S", 0.3)
    a = cluster["a"]
    silent = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    a.plane.link_timeout_s = 0.3
    a.view.node_infos["b"] = NodeInfo("b", f"127.0.0.1:{port}")
    a.view.changed()
    topic = topic_on(a.broker, "orders", 2, "orders")
    started = asyncio.get_running_loop().time()
    future = a.broker.publish(Message(topic, b"lost?", qos=1))
    assert future is not None
    with pytest.raises(ShardUnavailable, match="retry|unreachable"):
        await asyncio.wait_for(future, 5)
    assert asyncio.get_running_loop().time() - started < 3
    assert not a.plane.links["b"].connected
    silent.close()


async def test_pushes_an_owner_dropped_are_read_from_its_journal_by_the_peers_durable_cursors(cluster):
    """An owner that could not push to a peer (unreachable: frozen, away) says so on its next
    frame; the peer's durable cursors on its shards read its journal again from their
    positions, so nothing stored meanwhile is skipped (the randomized fault run, seed 2)."""
    a, b = cluster["a"], cluster["b"]
    a.owner_reads.reads = JournalOf(b.broker)
    keeper = a.broker.durable_subscription("keeper")
    a.broker.add_filter(keeper, "ledger/#")
    consumer = Recorder("keeper")
    a.broker.attach(keeper, consumer)
    await routes_seen(b, a, 1)

    async def publish(start: int) -> None:
        for index in range(start, start + 5):
            pending = b.broker.publish(Message("ledger/x", str(index).encode(), qos=1))
            if pending is not None:
                await asyncio.wait_for(pending, 5)

    await publish(0)
    await until(lambda: len(consumer.got) == 5)
    link = b.plane.links["a"]
    link.reachable = False  # as while a is frozen: b drops what it would push to a
    await publish(5)
    assert link.reachable is False and b.plane.stats.pushes_dropped >= 5
    link.reachable = True
    await publish(10)
    await until(lambda: len({m.payload for m in consumer.got}) == 15)
    assert [m.payload for m in consumer.got] == [str(i).encode() for i in range(15)]


async def test_only_a_link_session_that_replaces_an_earlier_one_rereads_the_owners_journal(cluster):
    """A peer's new link session (it restarted, or dropped its link while this node was out of
    its view) sends the durable cursors following its pushes to its journal; the first session
    a peer opens to this process does not (cursors restored at start resume from their saved
    floors: re-reading from their clamped positions delivered everything again, seed 6)."""
    a, b = cluster["a"], cluster["b"]
    a.owner_reads.reads = journal = JournalOf(b.broker)
    reads = journal.asked
    keeper = a.broker.durable_subscription("keeper")
    a.broker.add_filter(keeper, "ledger/#")
    consumer = Recorder("keeper")
    a.broker.attach(keeper, consumer)
    await routes_seen(b, a, 1)
    pending = b.broker.publish(Message("ledger/x", b"0", qos=1))
    if pending is not None:
        await asyncio.wait_for(pending, 5)
    await until(lambda: len(consumer.got) == 1)
    session = a.plane.inboxes._inboxes["b"].session
    del a.plane.inboxes._inboxes["b"]  # as in a process that never saw b's link
    a.plane.inboxes.link_opened("b", session, lambda reply: None)
    assert reads == []
    a.plane.inboxes.link_opened("b", session + 1, lambda reply: None)  # b's link session replaced
    assert reads == [("ledger", 0, 1)]


async def test_what_an_owner_stores_before_a_restarted_peers_routes_arrive_reaches_it_after(cluster):
    """A peer's new link session (it restarted) voids the routes of its old one. What the
    owner stores until the new session's route set arrives is held, then pushed to the peer
    before anything stored later: nothing acknowledged meanwhile is routed to no one."""
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 0, "orders")  # a owns orders/0

    async def publish(payload: bytes) -> None:
        pending = a.broker.publish(Message(topic, payload, qos=1))
        if pending is not None:
            await asyncio.wait_for(pending, 5)

    link = await RawLink.open(a, "b")
    link.write(pb.PeerFrame(sequence=0, from_node="b", session=424242))  # b, restarted
    await until(lambda: a.plane.inboxes._inboxes["b"].session == 424242)
    on_b = b.subscribe("orders/#")  # (told over b's old link, which a no longer reads)
    await publish(b"meanwhile")
    link.write(pb.PeerFrame(sequence=1, routes=route_update(RouteDelta([Route("orders/#")], []), reset=True)))
    assert (await link.read()).sequence == 1
    await publish(b"after")
    await until(lambda: len(on_b.got) == 2)
    assert [m.payload for m in on_b.got] == [b"meanwhile", b"after"]
    assert a.plane.unrouted_held() == 0
    link.close()


async def test_a_restored_cursor_waits_for_its_placement_and_then_resumes_at_its_saved_floor(cluster):
    """A node restarts with a durable subscription (an AMQP queue: its consumer, the queue,
    takes messages at once) whose cursor on a shard another node owns was saved at offset 1.
    Pushes arrive before the start has placed the cursor: it neither hands them out nor goes
    live on them (it did, then replayed from its floor: those pushes came twice, after what was
    stored during the stop). Once placed, it reads the owner's journal from its saved floor:
    what was stored during the stop, then what came after the restart, once each, in order."""
    from types import SimpleNamespace

    from shardgate.core.durable import encode_cursor_state

    from shardgate.cluster.session_cursors import CursorPlacer
    from shardgate.cluster.shard_reader import OwnerLogs, serve_read
    from shardgate.cluster.state_rpc import StateRpc

    a, b = cluster["a"], cluster["b"]
    rpcs = []
    for node in (a, b):
        rpc = StateRpc(node.view)
        rpc.on_read = lambda request, node=node: serve_read(node.broker, node.plane, request)
        node.plane.add_service(rpc.handler())
        node.owner_reads.reads = OwnerLogs(rpc)
        rpcs.append(rpc)
    moved = ShardAssignment("ledger", 0, "a", 2)  # a owns ledger/0; b keeps an empty journal of it
    for node in (a, b):
        node.view.assignments[("ledger", 0)] = moved
        node.view.changed()
    # stored on a while b's queue was acknowledged up to offset 1 and b was stopping
    for payload in (b"acked", b"stored-during-stop-1", b"stored-during-stop-2"):
        await asyncio.wait_for(a.broker.publish(Message("ledger/x", payload, qos=1)), 5)  # type: ignore[arg-type]
    # b restarts: its subscription is restored before it knows the shard map
    b.broker.placement = None
    b.broker.restored_cursors_wait = True
    sub = b.broker.durable_subscription("keeper")
    b.broker.add_filter(sub, "ledger/#")
    saved = encode_cursor_state(1, [])
    sub.restore_cursor("ledger", 0, saved)
    cursor = sub.cursors[("ledger", 0)]
    assert not cursor.placed and cursor.position == 1  # kept as saved, not clamped to b's empty log
    queue = Recorder("queue")
    b.broker.attach(sub, queue)
    b.broker.placement = b.plane
    b.view.changed()
    await routes_seen(a, b, 1)
    await asyncio.wait_for(a.broker.publish(Message("ledger/x", b"after-restart", qos=1)), 5)  # type: ignore[arg-type]
    await until(lambda: b.plane.received_log("ledger", 0).next_offset == 4)  # pushed to b
    sub._pump()  # as the loop would replay it: a cursor not placed yet hands out nothing
    assert queue.got == [] and not cursor.live
    # then the start places the restored cursors: on the owner's journal from the saved floor
    placer = CursorPlacer(SimpleNamespace(node_id="b", view=b.view), b.broker, b.plane, rpcs[1])  # type: ignore[arg-type]
    assert placer.replay_restored() == 1
    assert not b.broker.restored_cursors_wait
    await until(lambda: len(queue.got) >= 3)
    await asyncio.wait_for(a.broker.publish(Message("ledger/x", b"later", qos=1)), 5)  # type: ignore[arg-type]
    await until(lambda: len(queue.got) >= 4)
    assert [m.payload for m in queue.got] == [b"stored-during-stop-1", b"stored-during-stop-2",
                                              b"after-restart", b"later"]
    for rpc in rpcs:
        await rpc.close()


async def test_a_cursor_whose_owner_stays_away_warns_once_until_a_read_succeeds(cluster, monkeypatch, caplog):
    """Each retry of a read from an owner that is away is logged at debug after the first
    warning (a fault run logged about 1,000 such lines): one warning per outage."""
    import logging

    from shardgate.cluster import shard_reader
    from shardgate.cluster.state_rpc import StateRpc

    monkeypatch.setattr(shard_reader, "RETRY_MIN_S", 0.001)
    monkeypatch.setattr(shard_reader, "RETRY_MAX_S", 0.004)
    b = cluster["b"]
    b.view.assignments[("ledger", 0)] = ShardAssignment("ledger", 0, "gone", 2)  # not a live node
    rpc = StateRpc(b.view)
    reader = shard_reader.OwnerLog(rpc, b.plane, "ledger", 0, 0, lambda: ["ledger/#"])
    caplog.set_level(logging.DEBUG, logger=shard_reader.__name__)
    for _ in range(5):
        reader.commit_waiter()
        waiter = reader.commit_waiter()
        assert waiter is not None
        await asyncio.wait_for(waiter, 5)
    failures = [r for r in caplog.records if "from its owner failed" in r.getMessage()]
    assert len(failures) == 5
    assert [r.levelno for r in failures].count(logging.WARNING) == 1
    await rpc.close()


async def test_a_peer_whose_port_refuses_every_dial_is_reported_gone_once(cluster):
    """A refused dial means nothing listens there any more (a frozen process's kernel still
    accepts): past `PEER_GONE_AFTER_S` of refusals the plane's `PeerWatch` hears of it once,
    as the view showed the peer when the refusals began (its registration's lease: the node
    ends that lease, not a later process's)."""
    a, b = cluster["a"], cluster["b"]
    seen = NodeInfo("b", f"127.0.0.1:{b.plane.port}", lease=7)
    a.view.node_infos["b"] = seen
    a.view.changed()
    await b.plane.stop()
    await until(lambda: a.peers.gone, timeout=10)
    link = a.plane.links["b"]
    await until(lambda: link._failed_dials >= 6, timeout=10)  # refused on and on: told once
    assert len(a.peers.gone) == 1
    assert a.peers.gone[0] is seen and a.peers.gone[0].lease == 7
    assert a.plane.links["b"]._refused_since is not None


class SettlingReplicas(NoReplicas):
    """The plane's replicas: the shards in `settling` are named this node's in the view, their
    replicated log not leading yet."""

    def __init__(self) -> None:
        self.settling_shards: set[tuple[str, int]] = set()

    def settling(self, stream: str, shard: int) -> bool:
        return (stream, shard) in self.settling_shards


async def test_a_publish_to_a_shard_whose_leadership_is_still_coming_here_waits_for_it(tmp_path):
    """A client of the node the view names a shard's new leader, publishing before that
    node's replicated log leads, sees a pause, not a refusal (as a client of another node,
    whose forwarded publish is held, does)."""
    broker = make_broker(tmp_path / "a")
    view = StaticClusterView("a", {}, {("ledger", 0): ShardAssignment("ledger", 0, "a", 2)})
    replicas = SettlingReplicas()
    replicas.settling_shards.add(("ledger", 0))
    plane = DataPlane(broker, view, owner_reads=OwnerReadsOfTest(), peers=GoneRecorder(),
                      replicas=replicas)
    await plane.start()
    try:
        subscriber = Node("a", broker, view, plane, OwnerReadsOfTest(), GoneRecorder()).subscribe("ledger/#")
        first, second = Message("ledger/x", b"1", qos=1), Message("ledger/x", b"2", qos=1)
        waiting = [broker.publish(first), *broker.publish_many([second])]
        assert all(isinstance(outcome, asyncio.Future) for outcome in waiting), waiting
        await until(lambda: plane.forwarding.held.count == 2)
        assert not any(outcome.done() for outcome in waiting)  # type: ignore[union-attr]
        assert broker.streams["ledger"].shards[0].next_offset == 0  # nothing stored yet
        replicas.settling_shards.clear()  # its log leads now
        await asyncio.wait_for(asyncio.gather(*waiting), 5)  # type: ignore[arg-type]
        assert (first.offset, second.offset) == (0, 1)
        await until(lambda: len(subscriber.got) == 2)
        assert [m.payload for m in subscriber.got] == [b"1", b"2"]
    finally:
        await plane.stop()
        broker.storage.close()  # type: ignore[union-attr]


async def test_an_owner_knows_how_far_it_dispatched_and_which_pushes_its_peers_answered(cluster):
    # (what a replicated shard's leader tells its followers: `dispatch_marks.py`)
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(b.broker, "ledger", 0, "ledger")
    on_a = a.subscribe("ledger/#")
    await routes_seen(b, a, 1)
    link = b.plane.links["a"]
    for index in range(20):
        pending = b.broker.publish(Message(topic, str(index).encode(), qos=1))
        if pending is not None:
            await asyncio.wait_for(pending, 5)
    await until(lambda: len(on_a.got) == 20)
    assert b.plane.fanout.dispatched[("ledger", 0)] == 20  # the offset after the last one
    await until(lambda: link.pushes_settled == link.pushes_queued == 20)
