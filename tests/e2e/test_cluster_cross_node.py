"""Any node serves any client: `shardgate serve --cluster` processes on a real etcd, a client
publishing on one node and a subscriber on another, for every protocol (paho MQTT 3.1.1/5.0 at
QoS 0/1/2, aio-pika, the gRPC SDK) and for shared subscriptions spread across nodes.

Which node owns a shard is the controller's choice; the tests publish to topics of every shard
of a partitioned stream, so both data paths run: a publish forwarded to the shard's owner, and
a stored message pushed by the owner to the subscriber's node.

The tests that leave the cluster as they found them share one cluster of three nodes (the
`shared` fixture: one start for the module); each names its clients, topics and subscriptions
uniquely, and ends with its clients' routes gone from every node. The tests that kill, freeze
or cut a node start their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import socket
import struct
import threading
import time
import urllib.request
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aio_pika
import pytest
from shardgate.client import Client
from shardgate.protocols.mqtt import packets as p

from tests.conftest import free_port, wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    EtcdServer,
    linked,
    ready_shared,
    settled,
    shared_cluster,
)
from tests.mqtt_clients import V5, V311, Paho, RawClient

Cluster = Callable[..., list[ClusterNodeProcess]]

STREAMS = """
[[streams]]
name = "fast"
mode = "non-reliable"
partitions = 4
routes = ["fast/#"]

[[streams]]
name = "safe"
mode = "reliable"
partitions = 4
routes = ["safe/#"]
"""
# Enough distinct topics to land on every shard of a 4-shard stream (crc32 of the topic).
TOPICS = 12


@pytest.fixture(scope="module")
def every_protocol_cluster(module_etcd: EtcdServer, tmp_path_factory: pytest.TempPathFactory,
                           ) -> Iterator[list[ClusterNodeProcess]]:
    """Three nodes with their AMQP and gRPC listeners on too (the `cluster` fixture's nodes
    serve MQTT and HTTP only), shared by the module's tests that leave them as they found
    them."""
    directory = tmp_path_factory.mktemp("cross-node")
    with shared_cluster([ClusterNodeProcess(
        directory / f"n{index}", f"n{index}", module_etcd.url, extra_config=STREAMS,
        extra_args=["--amqp-port", str(free_port()), "--grpc-port", str(free_port())],
    ) for index in range(1, 4)]) as nodes:
        yield nodes


@dataclass
class Shared:
    """The module's shared nodes for one test, and the MQTT clients it opened there."""

    nodes: list[ClusterNodeProcess]
    test: str
    clients: list[Paho] = field(default_factory=list)

    def mqtt(self, node: ClusterNodeProcess, name: str, version: int = V5) -> Paho:
        """A paho client on `node`, its client id unique to this test, disconnected at its end."""
        client = Paho(node.mqtt_port, f"{self.test}-{name}", version)
        self.clients.append(client)
        return client


@pytest.fixture
def shared(every_protocol_cluster: list[ClusterNodeProcess], request: pytest.FixtureRequest,
           ) -> Iterator[Shared]:
    """The shared cluster, settled; at the test's end its clients are gone and every node's
    view of its peers' routes is as it was at the start (so the next test starts from the
    same routes, and `routes_reach` counts from there)."""
    nodes = ready_shared(every_protocol_cluster)
    routes = peer_routes(nodes)
    test = Shared(nodes, request.node.name.removeprefix("test_")[:24])
    yield test
    for client in test.clients:
        with contextlib.suppress(Exception):
            client.disconnect()
    wait_for(lambda: peer_routes(nodes) == routes, timeout=30, interval=0.05)


def retained_total(node: ClusterNodeProcess, prefix: str) -> int:
    """How many retained messages `node` holds under `prefix` (its admin API)."""
    url = f"http://127.0.0.1:{node.ports['http']}/api/retained?prefix={prefix}"
    with urllib.request.urlopen(url, timeout=5) as response:
        return int(json.loads(response.read())["total"])


def metric(of: ClusterNodeProcess, name: str, **labels: str) -> float:
    """The value of the series `name` with `labels` (among others, as `node`) on node `of`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{of.ports['http']}/metrics", timeout=5) as response:
        text = response.read().decode()
    for match in re.finditer(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(key) == value for key, value in labels.items()):
            return float(match.group(2))
    return 0.0


def peer_routes(nodes: list[ClusterNodeProcess]) -> dict[tuple[str, str], float]:
    """(node, peer) -> how many topic filters of the peer's clients the node knows."""
    return {(node.node_id, peer.node_id): metric(node, "shardgate_cluster_peer_routes",
                                                 peer=peer.node_id)
            for node in nodes for peer in nodes if peer is not node}


def routes_reach(nodes: list[ClusterNodeProcess], of: ClusterNodeProcess, count: int = 1,
                 since: dict[tuple[str, str], float] | None = None) -> None:
    """Wait until every other node knows `count` topic filters of node `of`'s clients (more
    than it knew at `since`, a `peer_routes` reading, when given)."""
    wait_for(lambda: all(
        metric(node, "shardgate_cluster_peer_routes", peer=of.node_id)
        >= count + (since or {}).get((node.node_id, of.node_id), 0)
        for node in nodes if node is not of
    ), timeout=15)


def metric_sum(nodes: list[ClusterNodeProcess], name: str, **labels: str) -> float:
    return sum(metric(node, name, **labels) for node in nodes)


def drain(client: Paho, timeout: float = 1.0) -> list[bytes]:
    got = []
    while True:
        try:
            got.append(client.expect(timeout=timeout).payload)
        except queue.Empty:
            return got


def test_mqtt_publish_on_one_node_reaches_a_subscriber_on_another_at_every_qos(shared: Shared) -> None:
    n1, n2, n3 = shared.nodes
    paths = ("shardgate_cluster_forwarded_messages_total", "shardgate_cluster_pushed_messages_total")
    before = [metric_sum(shared.nodes, name, direction="out") for name in paths]
    for version in (V311, V5):
        for qos in (0, 1, 2):
            tag = f"v{version}q{qos}"
            routes = peer_routes(shared.nodes)
            sub = shared.mqtt(n2, f"sub-{tag}", version)
            sub.subscribe(f"fast/{tag}/#", qos)
            sub.subscribe(f"safe/{tag}/#", qos)
            routes_reach([n1, n2, n3], n2, 2, since=routes)
            pub = shared.mqtt(n1, f"pub-{tag}", version)
            sent = [f"{stream}/{tag}/{i}" for stream in ("fast", "safe") for i in range(TOPICS)]
            for topic in sent:
                pub.publish(topic, topic, qos)  # QoS 1/2: returns once acknowledged
            received = sub.expect_n(len(sent))
            assert sorted(m.payload.decode() for m in received) == sorted(sent), tag
            assert all(m.qos == qos for m in received)
            sub.expect_none()
            pub.disconnect()
            sub.disconnect()
            # (gone from every node before the next round counts its routes)
            wait_for(lambda routes=routes: peer_routes(shared.nodes) == routes, timeout=30)
    forwarded, pushed = (metric_sum(shared.nodes, name, direction="out") - was
                         for name, was in zip(paths, before, strict=True))
    assert forwarded and pushed, "both data paths ran"


def test_shared_subscription_spreads_across_nodes_each_message_once(shared: Shared) -> None:
    nodes = shared.nodes
    routes = peer_routes(nodes)
    members = [shared.mqtt(node, f"worker-{node.node_id}") for node in nodes]
    for member in members:
        member.subscribe("$share/workers/fast/jobs/#", 1)
    for node in nodes:
        routes_reach(nodes, node, since=routes)
    pub = shared.mqtt(nodes[0], "pub")
    for index in range(60):
        pub.publish(f"fast/jobs/{index}", str(index), 1)
    wait_for(lambda: sum(member.messages.qsize() for member in members) >= 60, timeout=30)
    shares = [drain(member, timeout=0.3) for member in members]
    assert sorted(int(p) for share in shares for p in share) == list(range(60))
    assert sum(1 for share in shares if share) >= 2, f"spread: {[len(s) for s in shares]}"


async def test_amqp_publisher_confirmed_on_one_node_reaches_a_queue_on_another(shared: Shared) -> None:
    n1, n2, _n3 = shared.nodes
    routes = await asyncio.to_thread(peer_routes, shared.nodes)
    received: asyncio.Queue[bytes] = asyncio.Queue()
    async with await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{n2.ports['amqp']}/") as c2, \
            await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{n1.ports['amqp']}/") as c1:
        channel = await c2.channel()
        queue_ = await channel.declare_queue("", exclusive=True)
        await queue_.bind("amq.topic", "safe.orders.#")

        async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received.put_nowait(message.body)

        await queue_.consume(take, no_ack=True)
        await asyncio.to_thread(routes_reach, shared.nodes, n2, 2, routes)
        out = await c1.channel(publisher_confirms=True)
        exchange = await out.get_exchange("amq.topic")
        keys = [f"safe.orders.{i}" for i in range(TOPICS)]
        for key in keys:
            await exchange.publish(aio_pika.Message(key.encode()), key)  # raises unless acked
        got = [await asyncio.wait_for(received.get(), 5) for _ in keys]
        assert sorted(got) == sorted(key.encode() for key in keys)


async def test_grpc_sdk_publish_on_one_node_reaches_a_consumer_on_another(shared: Shared) -> None:
    n1, n2, _n3 = shared.nodes
    routes = await asyncio.to_thread(peer_routes, shared.nodes)
    async with Client(f"127.0.0.1:{n2.ports['grpc']}") as c2, Client(f"127.0.0.1:{n1.ports['grpc']}") as c1:
        consumer = c2.consumer("cross", ["safe/grpc/#"])
        await consumer.subscribe()
        await asyncio.to_thread(routes_reach, shared.nodes, n2, 1, routes)
        producer = c1.producer()
        topics = [f"safe/grpc/{i}" for i in range(TOPICS)]
        receipts = [await producer.send(topic, topic) for topic in topics]
        assert all(r.stream == "safe" and r.offset >= 0 for r in receipts)
        got = [(await consumer.receive(5)).text() for _ in topics]
        assert sorted(got) == sorted(topics)


def test_retained_message_set_on_one_node_is_read_on_another(shared: Shared) -> None:
    n1, n2, _n3 = shared.nodes
    pub = shared.mqtt(n1, "pub")
    topics = [f"fast/status/{i}" for i in range(TOPICS)]
    for topic in topics:
        pub.publish(topic, topic, 1, retain=True)
    # the retained messages reach n2 shortly after each PUBACK: a subscriber may have to wait
    # (counted under the topics' prefix: the node also retains its own $SYS topics)
    wait_for(lambda: retained_total(n2, "fast/status/") >= len(topics), timeout=15)
    late = shared.mqtt(n2, "late", V311)
    late.subscribe("fast/status/#", 1)
    got = late.expect_n(len(topics))
    assert sorted(m.payload.decode() for m in got) == sorted(topics)
    assert all(m.retain for m in got)


def test_publishes_to_a_killed_node_are_held_until_its_shards_move(cluster: Cluster) -> None:
    """A client of n1 publishing to a shard of n2 when n2 is killed sees a pause, not an
    error: n1 holds the publish (`forwarding.HeldForwards`, up to `forward_hold_s`, 10 s) until
    the controller moves the shard (n2's lease, 3 s here, ran out), then it is acknowledged
    and delivered. (Refused retryably after the hold: `test_cluster_data_path.py`, and the
    frozen owner below.)"""
    n1, n2 = cluster(2, extra_config=STREAMS)
    fast = n1.status()["placement"]["fast"]
    shard = next(index for index, (owner, _epoch) in enumerate(fast) if owner == "n2")
    topic = next(t for t in (f"fast/kill/{i}" for i in range(200)) if zlib.crc32(t.encode()) % 4 == shard)
    sub = Paho(n1.mqtt_port, "sub", V5)
    sub.subscribe("fast/kill/#", 1)
    raw = RawClient(n1.mqtt_port, version=5)
    raw.connect("pub")

    def publish(packet_id: int) -> p.Puback:
        raw.send(p.Publish(topic, str(packet_id).encode(), 1, packet_id=packet_id))
        puback = raw.receive(timeout=30)
        assert isinstance(puback, p.Puback), puback
        return puback

    assert publish(1).reason_code == 0, "n2 owns the shard and stores it"
    assert sub.expect().payload == b"1"
    n2.kill()
    # held by n1 (n2's link is down, then no live node leads the shard) and acknowledged once
    # the shard moved to n1: no refusal
    for packet_id in (2, 3):
        puback = publish(packet_id)
        assert puback.reason_code == 0, puback
        assert sub.expect().payload == str(packet_id).encode()
    assert n1.status()["placement"]["fast"][shard][0] == "n1", "served by n1 now"
    raw.close()


class CuttableProxy:
    """A TCP relay on loopback in front of a node's cluster port. `cut()` kills every
    connection through it at once (both directions, mid-frame), as a network fault would; new
    connections are relayed again at once."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.relayed = 0  # bytes relayed towards the node
        self.cuts = 0
        self._lock = threading.Lock()
        self._open: list[tuple[socket.socket, socket.socket]] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, towards_node: bool) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
                if towards_node:
                    self.relayed += len(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            pairs, self._open = self._open, []
        for pair in pairs:
            for sock in pair:
                # RST, not FIN: the connection dies as a broken network leaves it
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # Wake the pump blocked reading it first: closed under a blocked recv, its file
                # descriptor could be reused by the next connection, whose bytes that pump
                # would then read and lose.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RD)
                sock.close()
        self.cuts += 1

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.cut()


def test_messages_in_flight_when_a_link_breaks_are_neither_lost_nor_duplicated(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    """n1's link to n2 runs through a relay that is cut again and again while a publisher on
    n1 sends to every shard (forwards to n2's shards, pushes of n1's to n2's subscriber):
    every acknowledged message reaches the subscriber on n2 once, none twice."""
    n2_cluster_port = free_port()
    proxy = CuttableProxy(n2_cluster_port)
    n1 = ClusterNodeProcess(tmp_path / "n1", "n1", etcd.url, extra_config=STREAMS).start()
    n2 = ClusterNodeProcess(
        tmp_path / "n2", "n2", etcd.url,
        extra_config=f'advertise_address = "127.0.0.1:{proxy.port}"\n{STREAMS}',
        extra_args=["--cluster-port", str(n2_cluster_port)],
    ).start()
    try:
        for node in (n1, n2):
            wait_for(lambda node=node: settled(node, {"n1", "n2"}), timeout=30, interval=0.05)
            wait_for(lambda node=node: linked(node) == {"n1", "n2"} - {node.node_id}, timeout=30)
        sub = Paho(n2.mqtt_port, "sub", V5)
        sub.subscribe("fast/cut/#", 1)
        sub.subscribe("safe/cut/#", 1)
        routes_reach([n1, n2], n2, 2)
        total, window = 3000, 50
        topics = [f"{stream}/cut/{i % TOPICS}" for i in range(total) for stream in ("fast", "safe")][:total]

        cutting = threading.Event()

        def cut_repeatedly() -> None:
            seen = proxy.relayed
            while not cutting.is_set() and proxy.cuts < 6:
                if proxy.relayed - seen > 30_000:  # mid-stream: data flowed since the last cut
                    proxy.cut()
                    seen = proxy.relayed
                time.sleep(0.005)

        cutter = threading.Thread(target=cut_repeatedly, daemon=True)
        raw = RawClient(n1.mqtt_port, version=5)
        raw.connect("pub")
        cutter.start()
        codes: dict[int, int] = {}
        for start in range(0, total, window):
            for index in range(start, min(start + window, total)):
                raw.send(p.Publish(topics[index], str(index).encode(), 1, packet_id=index % 60000 + 1))
            for _ in range(start, min(start + window, total)):
                puback = raw.receive()
                assert isinstance(puback, p.Puback), puback
                codes[puback.packet_id - 1] = puback.reason_code
        cutting.set()
        cutter.join(5)
        raw.close()
        assert proxy.cuts >= 3, f"the link broke {proxy.cuts} times only"
        acknowledged = {index for index, code in codes.items() if code == 0}
        assert len(acknowledged) == total, f"refused: {[c for c in codes.values() if c]}"
        got: list[int] = []
        deadline = time.monotonic() + 30
        while not acknowledged <= set(got) and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                got.append(int(sub.expect(timeout=1).payload))
        got += [int(payload) for payload in drain(sub, timeout=0.5)]
        missing = sorted(acknowledged - set(got))
        assert not missing, f"{len(missing)} acknowledged messages lost, first {missing[:10]}"
        duplicated = [index for index, count in Counter(got).items() if count > 1]
        assert not duplicated, f"{len(duplicated)} delivered twice, first {duplicated[:10]}"
    finally:
        proxy.close()
        for node in (n1, n2):
            if node.alive():
                node.kill()


def test_a_publish_on_another_node_right_after_suback_reaches_the_subscriber(shared: Shared) -> None:
    """No waiting for routes: the SUBACK itself means every node knows the subscription."""
    n1, n2, _n3 = shared.nodes
    sub = RawClient(n2.mqtt_port, version=5)
    sub.connect(f"{shared.test}-sub")
    pub = RawClient(n1.mqtt_port, version=5)
    pub.connect(f"{shared.test}-pub")
    placement = n1.status()["placement"]
    # topics of the shards n1 owns: stored there, and pushed to n2 only if n1 knows the route
    topics = [t for t in (f"{stream}/right-after/{i}" for i in range(200) for stream in ("fast", "safe"))
              if placement[t.split("/")[0]][zlib.crc32(t.encode()) % 4][0] == "n1"][:50]
    assert len(topics) == 50
    for index, topic in enumerate(topics, start=1):
        # two subscriptions in a row, as a client subscribing to several filters does: the
        # second's route update goes out after a short delay that batches route changes
        for packet_id, topic_filter in ((2 * index, f"other/{index}"), (2 * index + 1, topic)):
            sub.send(p.Subscribe(packet_id, [p.SubscriptionRequest(topic_filter, 0)]))
            suback = sub.receive()
            assert isinstance(suback, p.Suback) and suback.reason_codes == [0], suback
        pub.send(p.Publish(topic, str(index).encode(), 0))
        got = sub.receive(timeout=5)
        assert isinstance(got, p.Publish) and got.payload == str(index).encode(), (topic, got)
    sub.close()
    pub.close()


def test_suback_is_not_held_long_by_a_node_that_does_not_answer(cluster: Cluster) -> None:
    """A peer that is stopped (its link still open, nothing answered) delays a SUBACK by a
    bounded wait only; the subscription works on its own node meanwhile."""
    # `solo` keeps one copy of each shard: a replicated shard in a cluster of two has a copy
    # on n2 as well and, with both needed in sync, acknowledges nothing while n2 is stopped
    # (the replication tests cover that)
    solo = '\n[[streams]]\nname = "solo"\nmode = "reliable"\npartitions = 4\nroutes = ["solo/#"]\nreplicas = 1\n'
    n1, n2 = cluster(2, extra_config=STREAMS + solo)
    assert n2.proc is not None
    os.kill(n2.proc.pid, signal.SIGSTOP)
    try:
        sub = Paho(n1.mqtt_port, "sub", V5)
        assert sub.subscribe("+/stopped/#", 1)[0].value == 1  # the helper waits 10 s at most
        pub = Paho(n1.mqtt_port, "pub", V5)
        placement = n1.status()["placement"]
        topic = next(topic for topic in (f"{stream}/stopped/{i}" for i in range(50) for stream in ("fast", "solo"))
                     if placement[topic.split("/")[0]][zlib.crc32(topic.encode()) % 4][0] == "n1")
        pub.publish(topic, "here", 1)
        assert sub.expect().payload == b"here"
    finally:
        os.kill(n2.proc.pid, signal.SIGCONT)


def test_a_frozen_owner_is_given_up_on_after_the_link_timeout_and_used_again_once_it_answers(
    cluster: Cluster,
) -> None:
    """The owner of a shard is frozen (SIGSTOP) with a lease far longer than the freeze: its
    connections stay open and only its silence on the link tells, and no other node takes
    its shards. A publish forwarded to it is held for a next leader (`forward_hold_s`, 2 s
    here) after the link timeout and then answered with the retryable error, not at the
    lease's end; publishes for its shards are refused retryably while it is frozen; once it
    runs again its link comes back and the same publish is stored. (A frozen leader of a
    replicated shard, replaced when its lease runs out, has its held publishes go to the new
    leader: `test_replica_forward_hold.py`.)"""
    n1, n2 = cluster(2, lease_ttl_s=60,
                     extra_config="link_timeout_s = 1\nforward_hold_s = 2\n" + STREAMS)
    placement = n1.status()["placement"]
    topic = next(topic for topic in (f"{stream}/frozen/{i}" for i in range(50) for stream in ("fast", "safe"))
                 if placement[topic.split("/")[0]][zlib.crc32(topic.encode()) % 4][0] == "n2")
    raw = RawClient(n1.mqtt_port, version=5)
    raw.connect("pub")
    assert n2.proc is not None
    os.kill(n2.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        raw.send(p.Publish(topic, b"while frozen", 1, packet_id=1))
        puback = raw.receive(timeout=20)
        waited = time.monotonic() - started
        assert isinstance(puback, p.Puback) and puback.packet_id == 1, puback
        assert puback.reason_code == 0x80, puback
        assert "retry" in (puback.properties.reason_string or ""), puback.properties.reason_string
        assert waited < 20, "answered after the link timeout and the hold, long before the 60 s lease"
        wait_for(lambda: "n2" not in linked(n1), timeout=10, interval=0.05)
        raw.send(p.Publish(topic, b"still frozen", 1, packet_id=2))
        puback = raw.receive(timeout=10)
        assert isinstance(puback, p.Puback) and puback.reason_code == 0x80, puback
    finally:
        os.kill(n2.proc.pid, signal.SIGCONT)
    wait_for(lambda: "n2" in linked(n1), timeout=20, interval=0.05)
    raw.send(p.Publish(topic, b"after", 1, packet_id=3))
    puback = raw.receive(timeout=10)
    assert isinstance(puback, p.Puback) and puback.reason_code == 0, puback
    raw.close()
    sub = Paho(n2.mqtt_port, "reader", V5)
    assert sub.subscribe(topic, 1)[0].value == 1
    pub = Paho(n1.mqtt_port, "pub2", V5)
    pub.publish(topic, "through the link again", 1)
    assert sub.expect().payload == b"through the link again"


def test_metrics_carry_the_node_and_count_a_forwarded_publish_once(shared: Shared) -> None:
    """(Counted from the test's start: the cluster is the module's.)"""
    nodes = shared.nodes
    n1 = nodes[0]

    def counters() -> dict[str, float]:
        found = {f"{node.node_id} in": metric(node, "shardgate_cluster_forwarded_messages_total",
                                              direction="in", node=node.node_id) for node in nodes}
        found["n1 out"] = metric(n1, "shardgate_cluster_forwarded_messages_total",
                                 direction="out", node="n1")
        found |= {f"{node.node_id} received": metric(node, "shardgate_messages_received_total",
                                                     node=node.node_id) for node in nodes}
        found["n1 mqtt"] = metric(n1, "shardgate_protocol_messages_received_total",
                                  protocol="mqtt", node="n1")
        return found

    before = counters()
    pub = shared.mqtt(n1, "pub")
    topics = [f"{stream}/counted/{i}" for stream in ("fast", "safe") for i in range(TOPICS)]
    for topic in topics:
        pub.publish(topic, topic, 1)
    now = counters()
    added = {name: now[name] - before[name] for name in now}
    forwarded = added["n1 out"]
    assert forwarded and added["n2 in"] + added["n3 in"] == forwarded, "some went to the others' shards"
    received = {node.node_id: added[f"{node.node_id} received"] for node in nodes}
    assert received == {"n1": len(topics), "n2": 0, "n3": 0}, "counted by the node the client used, once"
    assert added["n1 mqtt"] == len(topics)


async def test_a_grpc_publish_on_another_node_right_after_subscribed_reaches_the_consumer(
    shared: Shared,
) -> None:
    n1, n2, _n3 = shared.nodes
    placement = n1.status()["placement"]
    topics = [t for t in (f"{stream}/grpc-after/{i}" for i in range(200) for stream in ("fast", "safe"))
              if placement[t.split("/")[0]][zlib.crc32(t.encode()) % 4][0] == "n1"][:15]
    assert len(topics) == 15
    async with Client(f"127.0.0.1:{n2.ports['grpc']}") as c2, Client(f"127.0.0.1:{n1.ports['grpc']}") as c1:
        producer = c1.producer()
        for index, topic in enumerate(topics):
            # two subscriptions in a row: the second's routes go out after the batching delay
            other = c2.consumer(f"other-{index}", [f"other/{index}"])
            await other.subscribe()
            consumer = c2.consumer(f"after-{index}", [topic])
            await consumer.subscribe()  # returns once the Subscribed answer came
            await producer.send(topic, str(index))
            assert (await consumer.receive(5)).text() == str(index), topic
