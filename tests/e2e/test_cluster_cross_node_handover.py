"""A persistent session whose node stops gracefully (SIGTERM) resumes on another node where its
client left it, found by the fault run (`bench/cluster_chaos.py`, seed 7): the client
reconnects elsewhere within milliseconds, while its old node is still stopping; the new node
read the session's snapshot before the old node wrote its last one, and the old node's
cluster port was closed before it answered the handover, so the session resumed from the
snapshot of its previous connect and thousands of acknowledged messages came again. Real etcd,
two nodes, paho MQTT 5."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.e2e.cluster_fixtures import EtcdServer, protocol_node, settled_nodes, topics_of
from tests.mqtt_clients import V5, Paho

# Reliable: the shard keeps what the session acknowledged, on the node that stays.
WORK = '[[streams]]\nname = "work"\nmode = "reliable"\npartitions = 2\nroutes = ["work/#"]\n'
COUNT = 40


def test_a_session_whose_node_stops_resumes_elsewhere_without_its_acknowledged_messages(
        etcd: EtcdServer, tmp_path: Path) -> None:
    nodes = [protocol_node(tmp_path, name, etcd.url, WORK).start() for name in ("n1", "n2")]
    with settled_nodes(nodes) as placed:
        # n2: the node that owns the topic's shard and stays; n1: the session's node, stopped
        owner_id = placed[0].status()["placement"]["work"][0][0]
        n2 = next(node for node in placed if node.node_id == owner_id)
        n1 = next(node for node in placed if node is not n2)
        topic = topics_of(n2.status(), "work", "work/job", owner=n2.node_id)[0]
        subscriber = Paho(n1.mqtt_port, "resumer", V5, clean=True, session_expiry=3600)
        subscriber.subscribe("work/#", 1)  # the session's snapshot is written now
        publisher = Paho(n2.mqtt_port, "producer", V5)
        for index in range(COUNT):
            publisher.publish(topic, f"m{index}", qos=1)
        got = [m.payload.decode() for m in subscriber.expect_n(COUNT, timeout=30)]
        assert got == [f"m{index}" for index in range(COUNT)]
        # acknowledged (paho answers each PUBACK as it takes the message); n1 stops gracefully
        # and the client reconnects to n2 as soon as its connection ends
        assert n1.proc is not None
        n1.proc.send_signal(signal.SIGTERM)
        subscriber.disconnects.get(timeout=30)
        resumed = Paho(n2.mqtt_port, "resumer", V5, clean=False, session_expiry=3600, connect=False)
        flags, _reason, _props = resumed.connect()
        subscriber.client.loop_stop()  # (paho waits a second before it would reconnect)
        assert flags.session_present
        resumed.expect_none(within=3)  # nothing it acknowledged comes again
        publisher.publish(topic, "after", qos=1)
        assert resumed.expect(timeout=20).payload == b"after"  # and the session is the same
        assert n1.proc.wait(30) == 0
        resumed.disconnect()
        publisher.disconnect()
