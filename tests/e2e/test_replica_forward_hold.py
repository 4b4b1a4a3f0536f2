"""Clients of other nodes see a pause, not an error, while a replicated shard fails over: an
MQTT 3.1.1 publisher (paho-mqtt) connected to a node that does not lead the shard keeps its
connection and gets a PUBACK for every QoS 1 message across a SIGKILL of the leader (the
forwarding node holds the publishes it could not hand over and sends them to the new leader,
`forwarding.HeldForwards`), each stored once (`forward_ids.py`). MQTT 3.1.1 has no negative PUBACK: before, each refused forward
closed the connection. Three nodes and a real etcd on loopback."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer, read_back, topics_of
from tests.e2e.test_replica_failover import SAFE, STREAM, epoch_in_etcd, fully_replicated


class Paho311Publisher:
    """paho-mqtt 3.1.1, clean session, QoS 1, one message at a time in a thread, round robin
    over `topics`; keeps the acknowledged payloads and every disconnect it saw. It stops at a
    publish not acknowledged within `ack_timeout_s`."""

    def __init__(self, port: int, name: str, topics: list[str], ack_timeout_s: float = 30) -> None:
        import paho.mqtt.client as mqtt

        self.name, self.topics, self.ack_timeout_s = name, topics, ack_timeout_s
        self.acknowledged: list[str] = []
        self.disconnects: list[str] = []
        self.failure: str | None = None
        self._stop = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name,
                                  protocol=mqtt.MQTTv311)
        self.client.on_disconnect = lambda *args: (
            None if self._stop.is_set() else self.disconnects.append(repr(args[3])))
        connected = threading.Event()
        self.client.on_connect = lambda *args: connected.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert connected.wait(30), "not connected"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sequence = 0
        while not self._stop.is_set():
            payload = f"{self.name}-{sequence}"
            info = self.client.publish(self.topics[sequence % len(self.topics)], payload, qos=1)
            sequence += 1
            try:
                info.wait_for_publish(self.ack_timeout_s)
            except (RuntimeError, ValueError) as exc:
                self.failure = f"{payload}: {exc!r}"
                return
            if not info.is_published():
                self.failure = f"{payload}: no PUBACK within {self.ack_timeout_s:g} s"
                return
            self.acknowledged.append(payload)

    def count(self) -> int:
        return len(self.acknowledged)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.ack_timeout_s + 10)
        self.client.loop_stop()
        self.client.disconnect()


@pytest.mark.timeout(400)
def test_a_311_publisher_on_another_node_keeps_its_connection_and_every_puback_across_a_leader_kill(
        cluster: Callable[..., list[ClusterNodeProcess]], etcd: EtcdServer) -> None:
    nodes = {node.node_id: node for node in cluster(3, lease_ttl_s=5, extra_config=SAFE)}
    placed = wait_for(lambda: fully_replicated(nodes["n1"]), timeout=60, interval=0.1)
    leader = nodes[placed["leader"]]
    other = next(node for name, node in nodes.items() if name != leader.node_id)
    topics = topics_of(other.status(), STREAM, f"{STREAM}/p")
    publisher = Paho311Publisher(other.mqtt_port, "held-311", topics)
    try:
        wait_for(lambda: publisher.count() >= 50 or publisher.failure, timeout=60)
        leader.kill()
        killed_at, before = time.monotonic(), publisher.count()
        wait_for(lambda: publisher.count() >= before + 100 or publisher.failure, timeout=90,
                 interval=0.01)
        paused_s = time.monotonic() - killed_at
    finally:
        publisher.stop()
    assert publisher.failure is None, publisher.failure
    assert publisher.disconnects == [], "the 3.1.1 connection was closed during the failover"
    new_leader, epoch = epoch_in_etcd(etcd)
    assert new_leader != leader.node_id and epoch > placed["leader_epoch"]
    acknowledged = set(publisher.acknowledged)
    got = asyncio.run(read_back(other.grpc_url, [f"{STREAM}/#"], acknowledged, timeout=60))
    missing = acknowledged - set(got)
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:5]}"
    # the publish in flight at the kill, stored by the old leader (and replicated) before its
    # answer was lost, is sent again and found in the new leader's log: stored once
    twice = {payload: count for payload, count in got.items() if count > 1}
    assert not twice, f"stored more than once: {sorted(twice.items())[:5]}"
    print(f"100 PUBACKs after the kill within {paused_s:.2f} s, no disconnect")
