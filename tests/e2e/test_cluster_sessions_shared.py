"""MQTT shared subscription groups (`$share/group/filter`) of persistent sessions in a cluster,
with paho against real nodes: a member that comes back on another node keeps what its group
handed it and it had not acknowledged (in flight, resent with DUP; queued while it was away),
as on one node [MQTT-4.8.2], then receives the group's new messages there; and while the
group's only member moves back and forth under load, nothing acknowledged is lost."""

from __future__ import annotations

import json
import queue
import urllib.request
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, ContinuousPublisher
from tests.mqtt_clients import V5, Paho

Cluster = Callable[..., list[ClusterNodeProcess]]
GROUP_FILTER = "$share/workers/jobs/#"


class Member:
    """A persistent group member (session expiry 300 s) that acknowledges only when told."""

    def __init__(self, client_id: str) -> None:
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                                  protocol=mqtt.MQTTv5, manual_ack=True)
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.connacks: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.subacks: queue.Queue[Any] = queue.Queue()
        self.client.on_message = lambda c, u, m: self.messages.put(m)
        self.client.on_connect = lambda c, u, flags, rc, props: self.connacks.put((flags, rc))
        self.client.on_subscribe = lambda c, u, mid, codes, props: self.subacks.put(codes)

    def connect(self, port: int) -> bool:
        """Connect with clean start off; whether the broker had the session."""
        properties = Properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = 300
        self.client.connect("127.0.0.1", port, keepalive=30, clean_start=False, properties=properties)
        self.client.loop_start()
        flags, reason = self.connacks.get(timeout=20)
        assert reason == 0, reason
        return bool(flags.session_present)

    def subscribe(self) -> None:
        self.client.subscribe(GROUP_FILTER, options=mqtt.SubscribeOptions(qos=1))
        assert [code.value for code in self.subacks.get(timeout=20)] == [1]

    def take(self, count: int) -> list[mqtt.MQTTMessage]:
        return [self.messages.get(timeout=20) for _ in range(count)]

    def leave(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def session_on(node: ClusterNodeProcess, client_id: str) -> dict[str, Any] | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.ports['http']}/api/sessions", timeout=5) as reply:
        sessions = json.loads(reply.read())
    return next((entry for entry in sessions if entry["client_id"] == client_id), None)


def test_a_group_member_back_on_another_node_gets_what_it_had_not_acknowledged(cluster: Cluster) -> None:
    n1, n2 = cluster(2)
    member = Member("worker-1")
    assert not member.connect(n1.mqtt_port)
    member.subscribe()
    publisher = Paho(n2.mqtt_port, "dispatcher", V5)
    for number in range(1, 6):
        publisher.publish(f"jobs/{number}", f"job-{number}", qos=1)  # waits for PUBACK
    handed = member.take(5)
    assert sorted(m.payload for m in handed) == [f"job-{n}".encode() for n in range(1, 6)]
    acked = {m.payload for m in handed[:2]}
    for message in handed[:2]:
        member.client.ack(message.mid, message.qos)
    # the two acknowledgements reached n1 before the client leaves
    wait_for(lambda: (session_on(n1, "worker-1") or {}).get("inflight") == 3, timeout=20)
    member.leave()
    for number in range(6, 9):  # while the group's only member is away: queued for it on n1
        publisher.publish(f"jobs/{number}", f"job-{number}", qos=1)
    wait_for(lambda: (session_on(n1, "worker-1") or {}).get("queued") == 3, timeout=20)

    back = Member("worker-1")
    assert back.connect(n2.mqtt_port)  # the session (and its group) moved to n2
    again = back.take(6)
    unacked = [m for m in handed[2:]]
    assert [(m.payload, m.dup) for m in again[:3]] == [(m.payload, True) for m in unacked]
    assert [m.mid for m in again[:3]] == [m.mid for m in unacked]  # same packet ids
    assert [m.payload for m in again[3:]] == [f"job-{n}".encode() for n in range(6, 9)]
    assert not acked & {m.payload for m in again}  # acknowledged ones do not come again
    for message in again:
        back.client.ack(message.mid, message.qos)
    # the group's new messages reach it on n2, whichever node they are published on
    Paho(n1.mqtt_port, "dispatcher-2", V5).publish("jobs/9", "job-9", qos=1)
    publisher.publish("jobs/10", "job-10", qos=1)
    assert sorted(m.payload for m in back.take(2)) == [b"job-10", b"job-9"]
    assert session_on(n1, "worker-1") is None
    back.leave()


def test_a_group_member_moving_between_nodes_loses_nothing_acknowledged(cluster: Cluster) -> None:
    """The group's only member moves n1 -> n2 -> n1 -> n2 while publishers on both nodes keep
    publishing QoS 1: every message a PUBACK acknowledged reaches it (at least once)."""

    n1, n2 = cluster(2)
    received: queue.Queue[bytes] = queue.Queue()
    member = Member("mover")
    member.client.on_message = lambda c, u, m: (received.put(m.payload), c.ack(m.mid, m.qos))
    member.connect(n1.mqtt_port)
    member.subscribe()
    publishers = [ContinuousPublisher(node.mqtt_port, f"pub-{node.node_id}", [f"jobs/{node.node_id}/{i}" for i in range(8)],
                                      pause_s=0.002) for node in (n1, n2)]

    def published_some_more() -> None:
        target = sum(publisher.count() for publisher in publishers) + 20
        wait_for(lambda: sum(publisher.count() for publisher in publishers) >= target, timeout=30)

    try:
        for port in (n2.mqtt_port, n1.mqtt_port, n2.mqtt_port):
            published_some_more()
            member.leave()
            member = Member("mover")
            member.client.on_message = lambda c, u, m: (received.put(m.payload), c.ack(m.mid, m.qos))
            assert member.connect(port)
        published_some_more()
    finally:
        for publisher in publishers:
            publisher.stop()
    acknowledged = {payload for publisher in publishers for payload in publisher.acknowledged}
    assert len(acknowledged) >= 80
    got: set[str] = set()

    def all_arrived() -> bool:
        while not received.empty():
            got.add(received.get().decode())
        return acknowledged <= got

    try:
        wait_for(all_arrived, timeout=30)
    except AssertionError:
        missing = sorted(acknowledged - got, key=lambda p: (p.split("-")[1], int(p.split("-")[2])))
        raise AssertionError(f"{len(missing)} of {len(acknowledged)} acknowledged messages never "
                             f"reached the group: {missing[:20]}") from None
    finally:
        member.leave()
