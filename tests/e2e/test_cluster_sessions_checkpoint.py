"""A connected persistent session's acknowledgements reach etcd in checkpoints, so that a
holder killed while its client is connected does not send the session everything again: a real
etcd, two `shardgate serve --cluster` processes, a paho MQTT 5 client and SIGKILL."""

from __future__ import annotations

from collections.abc import Callable

from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.snapshot import SessionSnapshot

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer
from tests.e2e.test_cluster_state_sessions import create_spread, etcd_get, topic_on
from tests.mqtt_clients import V5, Paho, RawClient

Cluster = Callable[..., list[ClusterNodeProcess]]
SNAPSHOT = "/shardgate/test.state/sessions/"


def acknowledged_in_etcd(etcd: EtcdServer, client_id: str, stream: str, shard: int, count: int,
                         unacked_left: int = 0) -> bool:
    """Whether etcd's snapshot of `client_id` has, while connected, read `count` messages of the
    shard and has `unacked_left` of them unacknowledged."""
    state = etcd_get(etcd, SNAPSHOT + client_id) or {}
    if not state.get("online"):
        return False
    for cursor in SessionSnapshot.decode(state).cursors:
        if (cursor.stream, cursor.shard) == (stream, shard):
            return cursor.position >= count and len(cursor.unacked) == unacked_left
    return False


def test_a_session_whose_holder_is_killed_while_connected_resumes_from_its_last_checkpoint(
        cluster: Cluster, etcd: EtcdServer) -> None:
    n1, n2 = cluster(2)
    # one copy per shard: n2's shard takes publishes while n1 is dead (on two nodes a
    # replicated shard, both replicas needed in sync, refuses them meanwhile)
    create_spread(n1, [n1, n2], "ck", replicas=1)
    topic, shard = topic_on(n1, "ck", "n2")  # the shard outlives the session's holder
    session = Paho(n1.mqtt_port, "checkpointed", V5, clean=False, session_expiry=3600)
    session.subscribe("ck/#", qos=1)
    publisher = Paho(n2.mqtt_port, "ck-publisher", V5)
    before = [f"before-{number}".encode() for number in range(30)]
    for payload in before:
        publisher.publish(topic, payload, qos=1)
    assert [m.payload for m in session.expect_n(len(before), timeout=30)] == before
    # paho acknowledged them; the checkpoint (a few seconds at most) says so in etcd
    wait_for(lambda: acknowledged_in_etcd(etcd, "checkpointed", "ck", shard, len(before)), timeout=20)

    n1.kill()
    session.drop()
    wait_for(lambda: {e["node_id"] for e in n2.status()["nodes"]} == {"n2"}, timeout=20)
    back = Paho(n2.mqtt_port, "checkpointed", V5, clean=False, session_expiry=3600, connect=False)
    assert back.connect()[0].session_present
    # nothing was published after the checkpoint: nothing comes again
    back.expect_none(within=1.0)
    after = [f"after-{number}".encode() for number in range(10)]
    for payload in after:
        publisher.publish(topic, payload, qos=1)
    assert [m.payload for m in back.expect_n(len(after), timeout=30)] == after
    back.expect_none(within=0.5)
    back.disconnect()
    publisher.disconnect()


def test_a_checkpoint_keeps_what_the_client_has_not_acknowledged(
        cluster: Cluster, etcd: EtcdServer) -> None:
    """Ten messages in flight, six acknowledged when the checkpoint is taken: after the holder's
    SIGKILL the other node sends the four others again, and only those."""
    n1, n2 = cluster(2)
    create_spread(n1, [n1, n2], "ck")
    topic, shard = topic_on(n1, "ck", "n2")
    raw = RawClient(n1.mqtt_port, version=5)
    assert raw.connect("half-acked", clean=False,
                       properties=p.Properties(session_expiry_interval=3600)).reason_code == 0
    raw.send(p.Subscribe(1, [p.SubscriptionRequest("ck/#", 1)]))
    assert isinstance(raw.receive(), p.Suback)
    publisher = Paho(n2.mqtt_port, "ck-publisher", V5)
    sent = [f"m-{number}".encode() for number in range(10)]
    for payload in sent:
        publisher.publish(topic, payload, qos=1)
    got = [raw.receive() for _ in sent]
    assert [packet.payload for packet in got] == sent
    for packet in got[:6]:
        raw.send(p.Puback(packet.packet_id))
    wait_for(lambda: acknowledged_in_etcd(etcd, "half-acked", "ck", shard, len(sent), unacked_left=4),
             timeout=20)

    n1.kill()
    raw.close()
    wait_for(lambda: {e["node_id"] for e in n2.status()["nodes"]} == {"n2"}, timeout=20)
    back = Paho(n2.mqtt_port, "half-acked", V5, clean=False, session_expiry=3600, connect=False)
    assert back.connect()[0].session_present
    assert [m.payload for m in back.expect_n(4, timeout=30)] == sent[6:]
    back.expect_none(within=1.0)
    back.disconnect()
    publisher.disconnect()
