"""A persistent MQTT session's node restarting while another node, the owner of the shard the
session reads, goes on storing what a publisher sends, and the session's client reconnecting
as soon as the node listens: the session gets every acknowledged message once, in publish order
(real etcd, two `shardgate serve --cluster` nodes, raw MQTT 5 clients).

The session's cursor on the owner's shard is restored from the node's store at start, before
the node knows the shard map, and the owner's pushes reach the node as soon as their link is
up: the cursor must not hand them to the client, which is back before the node has joined,
before the start has placed it on the owner's journal at its saved floor (it did: they came
again after what was stored during the stop). And a session its node handed to another at
its graceful stop is no longer in the node's store: a CONNECT accepted before the node has
joined must wait for the join and take the session back, not open a new, empty one there
(`MqttService.hold_sessions_until`; it did: CONNACK said no session present, and everything
published while the node was down went to the session left on the other node). The durable
AMQP queue's case:
`test_cluster_amqp_home_restart_order.py`."""

from __future__ import annotations

import threading
import time

from shardgate.protocols.mqtt import packets as p

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ContinuousPublisher, wait_settled
from tests.e2e.test_cluster_state_sessions import Cluster, create_spread, topic_on
from tests.mqtt_clients import V5, Paho, RawClient

SESSION = p.Properties(session_expiry_interval=3600)


class EagerReader:
    """The session's client, reconnecting as soon as the node accepts connections (before
    the node has joined its cluster), acknowledging every message it is sent, in a thread."""

    def __init__(self, port: int, client_id: str) -> None:
        self.port = port
        self.client_id = client_id
        self.got: list[bytes] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    client = RawClient(self.port, version=5)
                except OSError:
                    time.sleep(0.005)  # not listening yet: the node is starting
                    continue
                break
            else:
                return
            assert client.connect(self.client_id, clean=False, properties=SESSION).session_present
            while not self._stop.is_set():
                try:
                    packet = client.receive(timeout=0.2)
                except AssertionError:
                    continue  # nothing within 0.2 s: look at the stop flag
                assert packet is not None, "the node closed the session's connection"
                if isinstance(packet, p.Publish):
                    self.got.append(packet.payload)
                    client.send(p.Puback(packet.packet_id))
            client.close()
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def stop(self) -> list[bytes]:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive()
        if self.error is not None:
            raise AssertionError(f"the reader failed: {self.error!r}") from self.error
        return self.got


def test_a_restarted_nodes_session_gets_every_message_once_in_order(cluster: Cluster) -> None:
    n1, n2 = cluster(2)
    # one copy per shard: n1's shard takes publishes while n2 is away (on two nodes a
    # replicated shard, both replicas needed in sync, refuses them meanwhile)
    create_spread(n1, [n1, n2], "ordered", replicas=1)
    topic, _shard = topic_on(n1, "ordered", "n1")  # n1 owns it: the session on n2 reads n1's
    keeper = Paho(n2.mqtt_port, "keeper", V5, clean=False, session_expiry=3600)
    keeper.subscribe("ordered/#", qos=1)
    keeper.disconnect()
    publisher = ContinuousPublisher(n1.mqtt_port, "pub", [topic])
    reader = None
    try:
        wait_for(lambda: publisher.count() >= 20, timeout=30, interval=0.02)
        assert n2.terminate() == 0
        stopped_at = publisher.count()
        wait_for(lambda: publisher.count() >= stopped_at + 20, timeout=30, interval=0.02)
        # the client is back as soon as n2 listens, while n1 goes on storing and pushing
        reader = EagerReader(n2.mqtt_port, "keeper")
        n2.start(n2.mqtt_port)
        wait_settled([n1, n2])
        started_at = publisher.count()
        wait_for(lambda: publisher.count() >= started_at + 50, timeout=30, interval=0.02)
    finally:
        publisher.stop()
    assert reader is not None
    assert not publisher.refused and not publisher.unanswered
    acknowledged = [payload.encode() for payload in publisher.acknowledged]
    wait_for(lambda: len(reader.got) >= len(acknowledged), timeout=60, interval=0.05)
    got = reader.stop()
    duplicates = len(got) - len(set(got))
    assert duplicates == 0, f"{duplicates} messages came twice"
    assert got == acknowledged
