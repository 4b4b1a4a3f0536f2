"""MQTT persistent sessions resume on any node of a cluster with what was published while their
client was away: a real etcd, `shardgate serve --cluster` processes and paho clients.

The messages go to a reliable stream of six shards spread over the three nodes, so a resumed
session replays shards it now owns, shards another node owns (read from that node's journal)
and shards the node it left owns.

The tests that neither stop a node nor change it share three nodes (`trio`: one start for the
module), each with a stream, topics and client ids of its own.
"""

from __future__ import annotations

import base64
import json
import urllib.request
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from shardgate.client import SyncClient
from shardgate.protocols.mqtt import packets as p

from tests.conftest import BrokerProcess, wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer, ready_shared, shared_cluster
from tests.mqtt_clients import V5, V311, Paho, RawClient

Cluster = Callable[..., list[ClusterNodeProcess]]

TOPICS = [f"away/device-{index}" for index in range(12)]


@pytest.fixture(scope="module")
def module_trio(module_etcd: EtcdServer, tmp_path_factory: pytest.TempPathFactory,
                ) -> Iterator[list[ClusterNodeProcess]]:
    directory = tmp_path_factory.mktemp("sessions")
    with shared_cluster([ClusterNodeProcess(directory / name, name, module_etcd.url)
                         for name in ("n1", "n2", "n3")]) as nodes:
        yield nodes


@pytest.fixture
def trio(module_trio: list[ClusterNodeProcess]) -> list[ClusterNodeProcess]:
    """Three nodes (as `cluster(3)` starts them) shared by the module's tests that leave them
    as they found them; each test publishes to a stream of its own (`spread_stream(name=)`)."""
    return ready_shared(module_trio)


def topics_under(stream: str) -> list[str]:
    """The twelve topics of TOPICS, under the stream `stream`'s own prefix."""
    return [topic.replace("away/", f"{stream}/", 1) for topic in TOPICS]


def spread_stream(nodes: list[ClusterNodeProcess], replicas: int | None = None,
                  name: str = "away") -> None:
    """The reliable stream `away` (or `name`, routed `name/#`; six shards), created once every
    node is up so that its shards are led by all of them (a reliable shard stays where it was
    placed); `replicas` copies of each (the cluster's default without it)."""
    with SyncClient(nodes[0].grpc_url) as client:
        client.admin.create_stream(name, mode="reliable", partitions=6, routes=[f"{name}/#"],
                                   replicas=replicas)
    for node in nodes:
        wait_for(lambda node=node: len(node.status()["placement"].get(name, [])) == 6, timeout=20)
    assert len(shards_per_node(nodes[0], name)) == len(nodes)


def shards_per_node(node: ClusterNodeProcess, stream: str = "away") -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for owner, _epoch in node.status()["placement"][stream]:
        counts[owner] += 1
    return counts


def publish_round(publisher: Paho, count: int, qos: int, tag: str,
                  topics: list[str] = TOPICS) -> dict[str, list[bytes]]:
    """`count` messages per topic (of `topics`), acknowledged; what each topic was sent, in
    order."""
    sent: dict[str, list[bytes]] = defaultdict(list)
    for sequence in range(count):
        for topic in topics:
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
        trio: list[ClusterNodeProcess], qos: int, protocol: int) -> None:
    n1, n2, n3 = trio
    client_id = f"roamer-{qos}-{protocol}"
    spread_stream([n1, n2, n3], name=client_id)
    topics = topics_under(client_id)
    away = Paho(n1.mqtt_port, client_id, protocol, clean=False, session_expiry=3600)
    granted = away.subscribe(f"{client_id}/#", qos=qos)[0]
    assert getattr(granted, "value", granted) == qos
    away.disconnect()

    publisher = Paho(n3.mqtt_port, f"publisher-{client_id}", V5)
    sent = publish_round(publisher, 5, qos, "away", topics)

    back = Paho(n2.mqtt_port, client_id, protocol, clean=False, session_expiry=3600, connect=False)
    flags, _rc, _props = back.connect()
    assert flags.session_present
    got = received_by_topic(back, sum(len(v) for v in sent.values()))
    assert got == sent  # every message, in order per topic (so per shard)
    back.expect_none(within=0.5)

    # the subscription came along: live messages reach the client on its new node
    live = publish_round(publisher, 2, qos, "live", topics)
    assert received_by_topic(back, sum(len(v) for v in live.values())) == live
    back.expect_none(within=0.5)
    back.disconnect()
    publisher.disconnect()


def test_taking_over_a_connected_session_resends_its_unacknowledged_messages_with_dup(
        trio: list[ClusterNodeProcess]) -> None:
    """The client is still connected to n1 with QoS 1 messages it has not acknowledged when it
    connects to n2: n1 ends that connection with 0x8E, and n2 sends the same messages again,
    under the same packet ids, marked DUP, then the rest of the backlog."""
    n1, n2, n3 = trio
    spread_stream([n1, n2, n3], name="slow-reader")
    expiry = p.Properties(session_expiry_interval=3600, receive_maximum=4)
    old = RawClient(n1.mqtt_port, version=5)
    assert old.connect("slow-reader", clean=False, properties=expiry).reason_code == 0
    old.send(p.Subscribe(1, [p.SubscriptionRequest("slow-reader/#", 1)]))
    assert isinstance(old.receive(), p.Suback)
    publisher = Paho(n3.mqtt_port, "publisher-slow-reader", V5)
    sent = publish_round(publisher, 2, 1, "held", topics_under("slow-reader"))
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


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_session_whose_node_died_resumes_elsewhere_with_every_acknowledged_message_once(
        cluster: Cluster, etcd: EtcdServer, replicas: int) -> None:
    """n1 dies holding an offline session; the session resumes on n2. With 3 replicas n1's
    shards fail over, so every message published before the death is there at once, and
    nothing comes again when n1 returns. With one copy per shard, what n1's shards held
    comes when n1 returns with its journal."""
    n1, n2, n3 = cluster(3)
    spread_stream([n1, n2, n3], replicas)
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
    now = TOPICS if replicas > 1 else alive  # n1's shards' copies on n2 and n3, or none
    expected_now = {topic: before[topic] + during[topic] for topic in now}
    assert received_by_topic(back, sum(len(v) for v in expected_now.values())) == expected_now
    back.expect_none(within=0.5)

    # n1 returns with its journal: what only it held for the session arrives on n2, and n1
    # drops its own stale copy of the session (etcd says n2 holds it now)
    n1.start()
    held = {topic: before[topic] for topic in TOPICS if topic not in now}
    if held:
        assert received_by_topic(back, sum(len(v) for v in held.values())) == held
    else:
        # n1 caught up again: it follows each of its shards' new leaders, in sync
        def n1_in_sync() -> bool:
            isrs = [entry["isr"] for name, entry in n2.status()["replicated_shards"].items()
                    if name.startswith("away/")]
            return len(isrs) == 6 and all("n1" in isr for isr in isrs)

        # 12 s alone; CI runs four workers on two cores beside three brokers and etcd per
        # test, where one run took more than 40 s: a liveness wait, not a speed promise
        wait_for(n1_in_sync, timeout=90)
    back.expect_none(within=1.0)
    assert (etcd_get(etcd, "/shardgate/test.state/sessions/orphan") or {}).get("node") == "n2"
    back.disconnect()
    publisher.disconnect()


SNAPSHOTS = "/shardgate/test.state/sessions/"
SWEEP_FAST = "session_sweep_s = 0.3\n"


def snapshot_of(etcd: EtcdServer, client_id: str) -> dict | None:
    return etcd_get(etcd, SNAPSHOTS + client_id)


def leave_offline_session(node: ClusterNodeProcess, etcd: EtcdServer, client_id: str,
                          protocol: int = V5, expiry: int = 3600, stream: str = "away") -> None:
    """A persistent session subscribed to away/# (`stream`/#), offline on `node`, its snapshot
    in etcd."""
    client = Paho(node.mqtt_port, client_id, protocol, clean=False, session_expiry=expiry)
    client.subscribe(f"{stream}/#", qos=1)
    client.disconnect()
    wait_for(lambda: (snapshot_of(etcd, client_id) or {}).get("node") == node.node_id
             and not snapshot_of(etcd, client_id).get("online"), timeout=20)


@pytest.mark.parametrize("protocol", [pytest.param(V5, id="5.0"), pytest.param(V311, id="3.1.1")])
def test_a_clean_start_on_another_node_ends_the_old_session_everywhere(
        trio: list[ClusterNodeProcess], module_etcd: EtcdServer, protocol: int) -> None:
    """Clean session (3.1.1) / clean start without expiry (5.0) on n2 discards the session n1
    held: its snapshot leaves etcd, and a later resume on n3 finds no session and gets nothing
    of what the old session's subscription would have matched."""
    n1, n2, n3 = trio
    etcd = module_etcd
    client_id = f"fresh-start-{protocol}"
    spread_stream([n1, n2, n3], name=client_id)
    leave_offline_session(n1, etcd, client_id, protocol, stream=client_id)

    clean = Paho(n2.mqtt_port, client_id, protocol, clean=True)
    clean.disconnect()
    wait_for(lambda: snapshot_of(etcd, client_id) is None, timeout=20)

    publisher = Paho(n3.mqtt_port, f"publisher-{client_id}", V5)
    publish_round(publisher, 1, 1, "after", topics_under(client_id))
    later = Paho(n3.mqtt_port, client_id, protocol, clean=False, session_expiry=3600, connect=False)
    flags, _rc, _props = later.connect()
    assert not flags.session_present
    later.expect_none(within=0.5)
    later.disconnect()
    publisher.disconnect()


def test_a_clean_start_while_the_holder_is_dead_voids_its_snapshot(
        cluster: Cluster, etcd: EtcdServer) -> None:
    """The node holding the offline session died: a clean start on n2 still voids the snapshot,
    so neither n3 nor n1 when it returns resumes the old session."""
    n1, n2, n3 = cluster(3)
    spread_stream([n1, n2, n3])
    leave_offline_session(n1, etcd, "restart-clean")
    n1.kill()
    wait_for(lambda: {e["node_id"] for e in n2.status()["nodes"]} == {"n2", "n3"}, timeout=20)

    clean = Paho(n2.mqtt_port, "restart-clean", V5, clean=True, session_expiry=0)
    clean.disconnect()
    wait_for(lambda: snapshot_of(etcd, "restart-clean") is None, timeout=20)

    later = Paho(n3.mqtt_port, "restart-clean", V5, clean=False, session_expiry=3600, connect=False)
    flags, _rc, _props = later.connect()
    assert not flags.session_present
    later.disconnect()
    wait_for(lambda: (snapshot_of(etcd, "restart-clean") or {}).get("node") == "n3", timeout=20)
    # n1 comes back with the old session in its own store: it drops it (etcd says n3's)
    n1.start()
    wait_for(lambda: {e["node_id"] for e in n1.status()["nodes"]} == {"n1", "n2", "n3"}, timeout=30)
    again = Paho(n1.mqtt_port, "restart-clean", V5, clean=False, session_expiry=3600, connect=False)
    flags, _rc, _props = again.connect()
    assert flags.session_present  # n3's session (no subscription), taken over
    publisher = Paho(n2.mqtt_port, "publisher", V5)
    publish_round(publisher, 1, 1, "unwanted")
    again.expect_none(within=0.5)  # the old session's away/# did not come back
    again.disconnect()
    publisher.disconnect()


def test_expired_sessions_snapshots_leave_etcd_also_when_their_node_died(
        cluster: Cluster, etcd: EtcdServer) -> None:
    """Session expiry holds cluster-wide: n1 dies holding an offline session with a 2 s
    expiry; the controller removes its snapshot once it expired, and resuming it elsewhere
    finds no session. A session with a long expiry on the same dead node still resumes,
    also one whose client was connected when n1 died."""
    n1, n2, n3 = cluster(3, extra_config=SWEEP_FAST)
    spread_stream([n1, n2, n3])
    leave_offline_session(n1, etcd, "short-lived", expiry=2)
    leave_offline_session(n1, etcd, "long-lived", expiry=3600)
    connected = Paho(n1.mqtt_port, "connected", V5, clean=False, session_expiry=3600)
    connected.subscribe("away/#", qos=1)
    wait_for(lambda: (snapshot_of(etcd, "connected") or {}).get("online") is True, timeout=20)
    n1.kill()

    wait_for(lambda: snapshot_of(etcd, "short-lived") is None, timeout=30)
    assert snapshot_of(etcd, "long-lived") is not None
    assert snapshot_of(etcd, "connected") is not None
    gone = Paho(n2.mqtt_port, "short-lived", V5, clean=False, session_expiry=3600, connect=False)
    assert not gone.connect()[0].session_present
    gone.disconnect()

    for client_id in ("long-lived", "connected"):
        back = Paho(n3.mqtt_port, client_id, V5, clean=False, session_expiry=3600, connect=False)
        assert back.connect()[0].session_present
        publisher = Paho(n2.mqtt_port, "publisher", V5)
        alive = next(t for t, o in owners(n2).items() if o != "n1")
        publisher.publish(alive, b"still-subscribed", qos=1)
        assert [m.payload for m in back.expect_n(1, timeout=20)] == [b"still-subscribed"]
        back.disconnect()
        publisher.disconnect()


# small journal segments, no archive: what retention deletes is gone
SMALL_JOURNAL = "\n[archive]\nenabled = false\n\n[journal]\nsegment_bytes = 1024\nretention_bytes = 1\n"


def api(node: ClusterNodeProcess, path: str) -> object:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.ports['http']}{path}", timeout=5) as response:
        return json.loads(response.read())


def topic_on(node: ClusterNodeProcess, stream: str, owner: str) -> tuple[str, int]:
    """A topic `stream/t<n>` whose shard `owner` owns, and that shard."""
    placement = node.status()["placement"][stream]
    for number in range(1000):
        topic = f"{stream}/t{number}"
        shard = zlib.crc32(topic.encode()) % len(placement)
        if placement[shard][0] == owner:
            return topic, shard
    raise AssertionError(f"no shard of {stream} on {owner}")


def create_spread(through: ClusterNodeProcess, nodes: list[ClusterNodeProcess], name: str,
                  replicas: int | None = None) -> None:
    with SyncClient(through.grpc_url) as client:
        client.admin.create_stream(name, mode="reliable", partitions=6, routes=[f"{name}/#"],
                                   replicas=replicas)
    for node in nodes:
        wait_for(lambda node=node: len(node.status()["placement"].get(name, [])) == 6, timeout=20)


def low_watermark(node: ClusterNodeProcess, stream: str, shard: int) -> int:
    for entry in api(node, "/api/streams"):  # type: ignore[union-attr]
        if entry["name"] == stream:
            return int(entry["shards"][shard].get("low_watermark", 0))
    raise AssertionError(f"{stream} not on {node.node_id}")


def test_the_owners_retention_keeps_what_a_session_on_another_node_has_not_read(
        cluster: Cluster, etcd: EtcdServer) -> None:
    """A persistent session offline on n2 subscribes to a shard n1 owns; n1's retention
    (1 byte per shard, small segments, no archive) runs after the messages came; the session
    resumes on n3, which reads the backlog from n1's journal: every message is there."""
    n1, n2, n3 = cluster(3, extra_config=SMALL_JOURNAL)
    create_spread(n1, [n1, n2, n3], "kept")
    topic, shard = topic_on(n1, "kept", "n1")

    keeper = Paho(n2.mqtt_port, "keeper", V5, clean=False, session_expiry=3600)
    keeper.subscribe("kept/#", qos=1)
    keeper.disconnect()
    # n1 knows what n2's cursor needs of its shard before anything is published
    wait_for(lambda: n1.status()["cursor_floors"].get(f"kept/{shard}") == 0, timeout=20)
    # a stream created after: the offline session has no cursor there, nothing keeps its journal
    create_spread(n1, [n1, n2, n3], "spare")
    spare_topic, spare_shard = topic_on(n1, "spare", "n1")

    publisher = Paho(n3.mqtt_port, "publisher", V5)
    sent = [f"kept-{number:04d}-{'x' * 40}".encode() for number in range(150)]
    for payload in sent:
        publisher.publish(topic, payload, qos=1)
    # a retention pass on n1 after those: it deletes the segments of a shard nobody reads
    spare = Paho(n1.mqtt_port, "spare-publisher", V5)
    for number in range(60):
        spare.publish(spare_topic, f"spare-{number}-{'y' * 40}".encode(), qos=1)
    wait_for(lambda: low_watermark(n1, "spare", spare_shard) > 0, timeout=40)
    assert low_watermark(n1, "kept", shard) == 0

    back = Paho(n3.mqtt_port, "keeper", V5, clean=False, session_expiry=3600, connect=False)
    assert back.connect()[0].session_present
    assert [m.payload for m in back.expect_n(len(sent), timeout=30)] == sent
    back.expect_none(within=0.5)
    back.disconnect()
    # once the session has it all, n1 may let it go
    wait_for(lambda: n1.status()["cursor_floors"].get(f"kept/{shard}", len(sent)) >= len(sent), timeout=20)
    publisher.disconnect()
    spare.disconnect()


def test_a_session_on_a_restarted_node_gets_what_the_owner_kept_while_it_was_down(
        cluster: Cluster, etcd: EtcdServer) -> None:
    """The node holding an offline session (n2) is killed; messages for it go to n1's shard
    and n1's retention runs while n2 is down (n2's last report of its cursors keeps them);
    n2 comes back, the client reconnects there and gets every message, from n1's journal."""
    n1, n2, n3 = cluster(3, extra_config=SMALL_JOURNAL)
    create_spread(n1, [n1, n2, n3], "kept")
    topic, shard = topic_on(n1, "kept", "n1")
    keeper = Paho(n2.mqtt_port, "keeper", V5, clean=False, session_expiry=3600)
    keeper.subscribe("kept/#", qos=1)
    publisher = Paho(n3.mqtt_port, "publisher", V5)
    early = [f"early-{number}".encode() for number in range(5)]
    for payload in early:
        publisher.publish(topic, payload, qos=1)
    assert [m.payload for m in keeper.expect_n(len(early), timeout=20)] == early
    keeper.disconnect()
    # n1 knows the session has everything before offset 5 (n2 saved it before reporting)
    wait_for(lambda: n1.status()["cursor_floors"].get(f"kept/{shard}") == len(early), timeout=20)
    create_spread(n1, [n1, n2, n3], "spare")
    spare_topic, spare_shard = topic_on(n1, "spare", "n1")
    n2.kill()
    wait_for(lambda: {e["node_id"] for e in n1.status()["nodes"]} == {"n1", "n3"}, timeout=20)

    sent = [f"while-down-{number:04d}-{'x' * 40}".encode() for number in range(150)]
    for payload in sent:
        publisher.publish(topic, payload, qos=1)
    spare = Paho(n1.mqtt_port, "spare-publisher", V5)
    for number in range(60):
        spare.publish(spare_topic, f"spare-{number}-{'y' * 40}".encode(), qos=1)
    wait_for(lambda: low_watermark(n1, "spare", spare_shard) > 0, timeout=40)
    assert low_watermark(n1, "kept", shard) <= len(early)

    n2.start()
    wait_for(lambda: {e["node_id"] for e in n2.status()["nodes"]} == {"n1", "n2", "n3"}, timeout=30)
    back = Paho(n2.mqtt_port, "keeper", V5, clean=False, session_expiry=3600, connect=False)
    assert back.connect()[0].session_present
    # what it had before the restart does not come again; what came while it was down does
    assert [m.payload for m in back.expect_n(len(sent), timeout=30)] == sent
    back.expect_none(within=0.5)
    # and live messages after the backlog, once
    publisher.publish(topic, b"live", qos=1)
    assert [m.payload for m in back.expect_n(1, timeout=20)] == [b"live"]
    back.expect_none(within=0.5)
    back.disconnect()
    publisher.disconnect()
    spare.disconnect()


def test_a_single_nodes_persistent_sessions_join_the_cluster_with_it(
        cluster: Cluster, etcd: EtcdServer, tmp_path: Path) -> None:
    """A data directory that served as a single node starts as cluster node n1: its persistent
    sessions are kept (they never had snapshots in etcd) and can resume on n2."""
    single = BrokerProcess(tmp_path / "n1", ["--http-port", "0", "--grpc-port", "0"]).start()
    before = Paho(single.mqtt_port, "veteran", V5, clean=False, session_expiry=3600)
    before.subscribe("away/#", qos=1)
    before.disconnect()
    assert single.terminate() == 0

    n1, n2 = cluster(2)
    wait_for(lambda: (snapshot_of(etcd, "veteran") or {}).get("node") == "n1", timeout=20)
    back = Paho(n2.mqtt_port, "veteran", V5, clean=False, session_expiry=3600, connect=False)
    assert back.connect()[0].session_present
    publisher = Paho(n1.mqtt_port, "publisher", V5)
    publisher.publish("away/device-0", b"joined", qos=1)
    assert [m.payload for m in back.expect_n(1, timeout=20)] == [b"joined"]
    back.disconnect()
    publisher.disconnect()
