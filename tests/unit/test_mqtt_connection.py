"""`MqttConnection` and `MqttService` driven with bytes alone: no socket, no event loop. A
manual clock stands in for time and timers (keepalive), a `Wire` keeps what the broker wrote."""

from __future__ import annotations

import pytest
from shardgate.core.broker import Broker
from shardgate.core.edge import Edge
from shardgate.core.streams import StreamConfig
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import PacketParser, encode
from shardgate.protocols.mqtt.connection import MqttConnection, State
from shardgate.protocols.mqtt.service import MqttService
from shardgate.protocols.mqtt.settings import MqttSettings

from tests.manual_clock import ManualClock

RC = p.ReasonCode


class Wire:
    """The transport as the connection sees it; `read` decodes what the broker sent."""

    def __init__(self, version: int) -> None:
        self.parser = PacketParser()
        self.parser.version = version
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def buffered(self) -> int:
        return 0

    def throttle(self, seconds: float) -> None:
        pass

    def read(self) -> list[p.Packet]:
        data, self.out = bytes(self.out), bytearray()
        return self.parser.feed(data)


class Node:
    """An MQTT service on a non-reliable core, with a manual clock."""

    def __init__(self, **settings: object) -> None:
        self.clock = ManualClock()
        broker = Broker(default_stream=StreamConfig("default", mode="non-reliable"))
        self.service = MqttService(Edge(broker), MqttSettings(sys_interval=0, **settings),
                                   scheduler=self.clock)
        self.service.start()

    def connect(self, client_id: str, version: int = 5, *, keep_alive: int = 60,
                clean: bool = True, expiry: int | None = None) -> tuple[MqttConnection, Wire]:
        wire = Wire(version)
        connection = MqttConnection(self.service, wire, f"127.0.0.1:{len(self.service.connections) + 1}")
        self.service.connection_made(connection)
        props = p.Properties()
        props.session_expiry_interval = expiry
        connect = p.Connect("MQTT", version, clean, keep_alive, client_id, properties=props)
        self.send(connection, connect, version)
        return connection, wire

    def send(self, connection: MqttConnection, packet: p.Packet, version: int = 5) -> None:
        connection.data_received(encode(packet, version))
        self.clock.run_soon()  # output is written once per turn


def test_connect_gets_connack_without_an_event_loop() -> None:
    node = Node()
    connection, wire = node.connect("dev-1")
    (connack,) = wire.read()
    assert isinstance(connack, p.Connack)
    assert (connack.reason_code, connack.session_present) == (RC.SUCCESS, False)
    assert connection.state is State.CONNECTED and connection.principal.client_id == "dev-1"


def test_first_packet_other_than_connect_closes_the_connection() -> None:
    node = Node()
    wire = Wire(4)
    connection = MqttConnection(node.service, wire, "127.0.0.1:1")
    connection.data_received(encode(p.Pingreq(), 4))
    assert wire.closed and connection.state is State.CLOSED


@pytest.mark.parametrize("version", [4, 5])
def test_qos1_publish_is_acked_and_delivered_until_the_subscriber_acks(version: int) -> None:
    node = Node()
    sub, sub_wire = node.connect("sub", version)
    pub, pub_wire = node.connect("pub", version)
    sub_wire.read(), pub_wire.read()
    node.send(sub, p.Subscribe(1, [p.SubscriptionRequest("t/#", 1)]), version)
    assert isinstance(sub_wire.read()[0], p.Suback)

    node.send(pub, p.Publish("t/1", b"hello", qos=1, packet_id=7), version)
    (puback,) = pub_wire.read()
    assert isinstance(puback, p.Puback) and puback.packet_id == 7
    (delivered,) = sub_wire.read()
    assert isinstance(delivered, p.Publish)
    assert (delivered.topic, delivered.payload, delivered.qos) == ("t/1", b"hello", 1)
    session = node.service.sessions["sub"]
    assert delivered.packet_id in session.inflight
    node.send(sub, p.Puback(delivered.packet_id), version)
    assert not session.inflight


def test_qos2_publish_is_received_once_even_when_retransmitted() -> None:
    node = Node()
    sub, sub_wire = node.connect("sub")
    pub, pub_wire = node.connect("pub")
    sub_wire.read(), pub_wire.read()
    node.send(sub, p.Subscribe(1, [p.SubscriptionRequest("t/#", 2)]))
    sub_wire.read()

    node.send(pub, p.Publish("t/2", b"once", qos=2, packet_id=9))
    assert [type(x) for x in pub_wire.read()] == [p.Pubrec]
    node.send(pub, p.Publish("t/2", b"once", qos=2, packet_id=9, dup=True))  # PUBREC lost
    assert [type(x) for x in pub_wire.read()] == [p.Pubrec]
    node.send(pub, p.Pubrel(9))
    (pubcomp,) = pub_wire.read()
    assert isinstance(pubcomp, p.Pubcomp) and pubcomp.packet_id == 9

    (delivered,) = sub_wire.read()  # one delivery only
    assert (delivered.payload, delivered.qos) == (b"once", 2)
    node.send(sub, p.Pubrec(delivered.packet_id))
    (pubrel,) = sub_wire.read()
    assert isinstance(pubrel, p.Pubrel) and pubrel.packet_id == delivered.packet_id
    node.send(sub, p.Pubcomp(delivered.packet_id))
    assert not node.service.sessions["sub"].inflight


def test_qos2_packet_ids_of_one_client_never_mark_another_clients_publish_as_a_retransmission() -> None:
    """Sessions and connections with no QoS 2 publish open share one empty set until their
    first (`NO_PACKET_IDS`): each must take its own, or one client's open packet id would
    swallow another's publish under the same id."""
    node = Node()
    sub, sub_wire = node.connect("sub")
    first, first_wire = node.connect("first")
    second, second_wire = node.connect("second")
    sub_wire.read(), first_wire.read(), second_wire.read()
    node.send(sub, p.Subscribe(1, [p.SubscriptionRequest("t/#", 1)]))
    sub_wire.read()

    node.send(first, p.Publish("t/a", b"from first", qos=2, packet_id=9))
    node.send(second, p.Publish("t/b", b"from second", qos=2, packet_id=9))
    assert [type(x) for x in first_wire.read()] == [p.Pubrec]
    assert [type(x) for x in second_wire.read()] == [p.Pubrec]
    assert sorted(x.payload for x in sub_wire.read()) == [b"from first", b"from second"]
    assert first.qos2_open == {9} and second.qos2_open == {9}
    assert first.qos2_open is not second.qos2_open

    node.send(first, p.Pubrel(9))
    assert [type(x) for x in first_wire.read()] == [p.Pubcomp]
    assert not first.qos2_open and second.qos2_open == {9}
    assert node.service.sessions["second"].inbound_qos2 == {9}
    late, late_wire = node.connect("late")
    late_wire.read()
    assert not late.qos2_open and not node.service.sessions["late"].inbound_qos2


def test_keepalive_timeout_on_the_manual_clock() -> None:
    node = Node()
    connection, wire = node.connect("sleepy", keep_alive=10)
    wire.read()
    node.clock.advance(14)  # within 1.5 x keep alive
    assert connection.state is State.CONNECTED
    node.send(connection, p.Pingreq())
    assert isinstance(wire.read()[0], p.Pingresp)
    node.clock.advance(14)  # the PINGREQ restarted the clock
    assert connection.state is State.CONNECTED
    node.clock.advance(2)  # 16 s of silence
    assert connection.state is State.CLOSED and wire.closed
    (disconnect,) = wire.read()
    assert isinstance(disconnect, p.Disconnect) and disconnect.reason_code == RC.KEEP_ALIVE_TIMEOUT


def test_takeover_disconnects_the_old_connection_and_keeps_the_session() -> None:
    node = Node()
    old, old_wire = node.connect("dev", clean=False, expiry=300)
    old_wire.read()
    node.send(old, p.Subscribe(1, [p.SubscriptionRequest("t/#", 1)]))
    old_wire.read()
    new, new_wire = node.connect("dev", clean=False, expiry=300)
    (disconnect,) = old_wire.read()
    assert isinstance(disconnect, p.Disconnect) and disconnect.reason_code == RC.SESSION_TAKEN_OVER
    assert old_wire.closed and old.state is State.CLOSED
    node.service.connection_gone(old)
    (connack,) = new_wire.read()
    assert connack.session_present is True
    session = node.service.sessions["dev"]
    assert session.connection is new and "t/#" in session.subscription.filters
