"""Messages a persistent session had been sent and had not acknowledged come again after its
node restarts, marked DUP [MQTT-3.3.1-1]: on one node stopped with SIGTERM or SIGKILL, and on
a cluster node whose session reads other nodes' shards. Raw MQTT 5 clients, so that the test
decides what is acknowledged and sees the DUP flag as sent."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest
from shardgate.protocols.mqtt import packets as p

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import wait_settled
from tests.e2e.test_cluster_state_sessions import Cluster, create_spread, topic_on
from tests.mqtt_clients import V5, Paho, RawClient

SESSION = p.Properties(session_expiry_interval=3600, receive_maximum=2)


def subscribe_unacked(port: int, client_id: str, topic_filter: str) -> RawClient:
    reader = RawClient(port, version=5)
    assert reader.connect(client_id, clean=False, properties=SESSION).reason_code == 0
    reader.send(p.Subscribe(1, [p.SubscriptionRequest(topic_filter, 1)]))
    assert isinstance(reader.receive(), p.Suback)
    return reader


def saved_unacked(data_dir: Path, subscription: str) -> int:
    """How many offsets the broker's store says `subscription` was sent and has not acked."""
    from shardgate.core.durable import decode_cursor_state
    with contextlib.closing(sqlite3.connect(f"file:{data_dir / 'metadata.db'}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT acked FROM cursors WHERE subscription = ?", (subscription,)).fetchall()
    return sum(len(decode_cursor_state(acked)[1]) for (acked,) in rows if acked)


def receive_all(reader: RawClient, count: int) -> list[p.Publish]:
    """`count` PUBLISH packets, each acknowledged once received."""
    got = []
    for _ in range(count):
        packet = reader.receive(timeout=30)
        assert isinstance(packet, p.Publish), packet
        got.append(packet)
        reader.send(p.Puback(packet.packet_id))
    return got


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_unacknowledged_messages_come_again_with_dup_after_a_restart(broker_process, stop: str) -> None:
    broker = broker_process().start()
    reader = subscribe_unacked(broker.mqtt_port, "dup-reader", "dup/#")
    publisher = Paho(broker.mqtt_port, "dup-publisher", V5)
    for index in range(4):
        publisher.publish(f"dup/{index}", f"m{index}", 1)
    publisher.disconnect()
    sent = [reader.receive(timeout=10) for _ in range(2)]  # its receive maximum: no more
    assert [(m.payload, m.dup) for m in sent] == [(b"m0", False), (b"m1", False)]
    # the broker knows it sent them (its cursors are saved in batches, every 200 ms): only
    # then is a resend known to be one
    wait_for(lambda: saved_unacked(broker.data_dir, "mqtt:dup-reader") == 2, timeout=10, interval=0.05)
    if stop == "sigterm":
        broker.terminate()
    else:
        broker.kill()
    reader.close()
    broker.start()
    back = RawClient(broker.mqtt_port, version=5)
    assert back.connect("dup-reader", clean=False, properties=SESSION).session_present
    again = receive_all(back, 4)
    assert [(m.payload, m.dup) for m in again] == [
        (b"m0", True), (b"m1", True), (b"m2", False), (b"m3", False)]
    back.close()


def test_a_restarted_cluster_nodes_session_resends_with_dup_what_it_read_from_another_owner(
        cluster: Cluster) -> None:
    """The session is on n2; its messages are on a shard n1 owns. n2 is SIGKILLed and
    restarted: the session reads its backlog from n1's journal again, and what it had been
    sent and had not acknowledged comes marked DUP, the rest not."""
    n1, n2 = cluster(2)
    create_spread(n1, [n1, n2], "owned")
    topic, _shard = topic_on(n1, "owned", "n1")
    reader = subscribe_unacked(n2.mqtt_port, "remote-reader", "owned/#")
    publisher = Paho(n1.mqtt_port, "remote-publisher", V5)
    for index in range(4):
        publisher.publish(topic, f"m{index}", 1)
    publisher.disconnect()
    sent = [reader.receive(timeout=20) for _ in range(2)]
    assert [(m.payload, m.dup) for m in sent] == [(b"m0", False), (b"m1", False)]
    wait_for(lambda: saved_unacked(n2.data_dir, "mqtt:remote-reader") == 2, timeout=10, interval=0.05)
    n2.kill()
    reader.close()
    n2.start()
    wait_settled([n1, n2])
    back = RawClient(n2.mqtt_port, version=5)
    assert back.connect("remote-reader", clean=False, properties=SESSION).session_present
    again = receive_all(back, 4)
    assert [(m.payload, m.dup) for m in again] == [
        (b"m0", True), (b"m1", True), (b"m2", False), (b"m3", False)]
    back.close()
