"""One read budget per event-loop turn (`protocols/read_budget.py`), shared by the MQTT and AMQP
listeners: once a turn's reads, every protocol's together, have used it, a read waits for a
later turn (its socket paused), handled oldest first within the next turn's budget, nothing
lost or reordered; a connection still in its opening handshake never waits; the AMQP memory
alarm's pause outlasts a turn."""

from __future__ import annotations

from typing import Any

from pamqp import body as pbody
from pamqp import commands, frame, header
from shardgate.core.broker import Broker
from shardgate.core.edge import Edge
from shardgate.core.streams import StreamConfig
from shardgate.protocols.amqp.connection import PROTOCOL_HEADER, State
from shardgate.protocols.amqp.server import AmqpProtocol
from shardgate.protocols.amqp.service import AmqpService
from shardgate.protocols.amqp.settings import AmqpSettings
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import PacketParser, encode
from shardgate.protocols.mqtt.connection import MqttConnection
from shardgate.protocols.mqtt.service import MqttService
from shardgate.protocols.mqtt.settings import MqttSettings
from shardgate.protocols.read_budget import ReadBudget

from tests.manual_clock import ManualClock

BUDGET_S = 0.005


class Clock:
    """The budget's clock: it moves only when a test says a read took time."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def budget_of(budget_s: float = BUDGET_S) -> tuple[ReadBudget, ManualClock, Clock]:
    turns, clock = ManualClock(), Clock()
    return ReadBudget(budget_s, call_soon=turns.call_soon, clock=clock), turns, clock


# ---------------------------------------------------------------------------- the budget alone
def test_a_turn_spends_its_budget_from_its_first_read() -> None:
    budget, turns, clock = budget_of()
    assert not budget.spent()  # the turn's first read starts its clock
    clock.now += 0.004
    assert not budget.spent()
    clock.now += 0.002
    assert budget.spent()
    turns.run_soon()  # the next turn
    assert not budget.spent()


def test_reads_left_for_later_are_handled_oldest_first_within_one_budget() -> None:
    budget, turns, clock = budget_of()
    handled: list[str] = []

    def slow(name: str) -> Any:
        def handle() -> None:
            handled.append(name)
            clock.now += 0.003  # each takes 3 ms
        return handle

    budget.spent()
    clock.now += 0.006
    assert budget.spent()
    for name in "abcd":
        budget.defer(slow(name))
    assert budget.waiting == 4 and handled == []
    turns._soon, soon = [], list(turns._soon)
    for callback, args in soon:  # exactly one turn: a, then b takes the budget past 5 ms
        callback(*args)
    assert handled == ["a", "b"] and budget.waiting == 2
    assert budget.spent()  # the reads of this turn's poll share what it left: none
    turns.run_soon()
    assert handled == ["a", "b", "c", "d"] and budget.waiting == 0
    assert not budget.spent()  # a new turn


def test_no_limit_and_a_negative_budget() -> None:
    unlimited, _, clock = budget_of(0.0)
    unlimited.spent()
    clock.now += 10.0
    assert not unlimited.spent()
    every_other, turns, _ = budget_of(-1.0)
    assert not every_other.spent()  # a turn's first read is always handled
    assert every_other.spent()
    handled: list[int] = []
    for n in range(3):
        every_other.defer(lambda n=n: handled.append(n))
    turns._soon, soon = [], list(turns._soon)
    for callback, args in soon:
        callback(*args)
    assert handled == [0]  # one per turn
    turns.run_soon()
    assert handled == [0, 1, 2]


# ---------------------------------------------------------------------------- MQTT and AMQP
class MqttWire:
    """An MQTT connection's link: what the broker wrote, and whether its socket is read."""

    def __init__(self) -> None:
        self.parser = PacketParser()
        self.parser.version = 5
        self.out = bytearray()
        self.reading = True

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        pass

    def buffered(self) -> int:
        return 0

    def throttle(self, seconds: float) -> None:
        self.reading = False

    def resume(self) -> None:
        self.reading = True

    def read(self) -> list[p.Packet]:
        data, self.out = bytes(self.out), bytearray()
        return self.parser.feed(data)


class Transport:
    """What the AMQP protocol uses of an asyncio transport."""

    def __init__(self) -> None:
        self.reading = True
        self.written = bytearray()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 5672) if name == "peername" else default

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        pass


def amqp_frames(*values: Any, channel: int = 1) -> bytes:
    return b"".join(frame.marshal(value, channel) for value in values)


def amqp_publish(key: str, body: bytes) -> bytes:
    return amqp_frames(
        commands.Basic.Publish(exchange="amq.topic", routing_key=key),
        header.ContentHeader(0, len(body), commands.Basic.Properties()),
        pbody.ContentBody(body),
    )


class Broker2:
    """An MQTT service and an AMQP service on one core and one read budget."""

    def __init__(self, budget_s: float = BUDGET_S) -> None:
        self.budget, self.turns, self.clock = budget_of(budget_s)
        broker = Broker(default_stream=StreamConfig("default", mode="non-reliable"))
        edge = Edge(broker)
        self.mqtt = MqttService(edge, MqttSettings(sys_interval=0), scheduler=self.turns,
                                read_budget=self.budget)
        self.amqp = AmqpService(edge, AmqpSettings(), scheduler=self.turns, read_budget=self.budget)

    def mqtt_client(self, client_id: str) -> tuple[MqttConnection, MqttWire]:
        wire = MqttWire()
        connection = MqttConnection(self.mqtt, wire, f"127.0.0.1:{client_id}")
        self.mqtt.connection_made(connection)
        connection.data_received(encode(p.Connect("MQTT", 5, True, 60, client_id), 5))
        self.turns.run_soon()
        assert isinstance(wire.read()[0], p.Connack)
        return connection, wire

    def amqp_client(self) -> tuple[AmqpProtocol, Transport]:
        protocol, transport = AmqpProtocol(self.amqp), Transport()
        protocol.connection_made(transport)  # type: ignore[arg-type]
        protocol.data_received(PROTOCOL_HEADER)
        protocol.data_received(amqp_frames(commands.Connection.StartOk(
            mechanism="PLAIN", response="\0guest\0guest"), channel=0))
        protocol.data_received(amqp_frames(commands.Connection.TuneOk(
            channel_max=100, frame_max=131072, heartbeat=0), channel=0))
        protocol.data_received(amqp_frames(commands.Connection.Open(virtual_host="/"), channel=0))
        assert protocol.connection is not None and protocol.connection.state is State.OPEN
        protocol.data_received(amqp_frames(commands.Channel.Open()))
        self.turns.run_soon()
        return protocol, transport

    def turn_spent(self) -> None:
        """A read starts a turn and takes longer than its budget."""
        self.turns.run_soon()
        assert not self.budget.spent()
        self.clock.now += 2 * BUDGET_S


def received_topics(wire: MqttWire) -> list[str]:
    return [packet.topic for packet in wire.read() if isinstance(packet, p.Publish)]


def test_mqtt_and_amqp_reads_share_one_budget_and_keep_their_order() -> None:
    node = Broker2()
    subscriber, sub_wire = node.mqtt_client("sub")
    subscriber.data_received(encode(p.Subscribe(1, [p.SubscriptionRequest("t/#", 0)]), 5))
    node.turns.run_soon()
    sub_wire.read()
    publisher, pub_wire = node.mqtt_client("pub")
    amqp, transport = node.amqp_client()

    node.turn_spent()  # say an AMQP publisher's read took the turn's budget
    publisher.data_received(encode(p.Publish("t/m1", b"1", qos=1, packet_id=1), 5))
    amqp.data_received(amqp_publish("t.a1", b"2"))
    publisher.data_received(encode(p.Publish("t/m2", b"3", qos=1, packet_id=2), 5))
    # Nothing of it is handled this turn, and neither socket is read meanwhile.
    assert not pub_wire.reading and not transport.reading
    assert pub_wire.read() == [] and sub_wire.read() == []
    assert node.budget.waiting == 2

    node.turns.run_soon()  # the next turn handles them, oldest connection first
    assert received_topics(sub_wire) == ["t/m1", "t/m2", "t/a1"]
    assert [packet.packet_id for packet in pub_wire.read()] == [1, 2]  # PUBACKs
    assert pub_wire.reading and transport.reading


def test_a_client_opening_its_connection_never_waits_for_the_budget() -> None:
    node = Broker2(budget_s=-1.0)  # every read after a turn's first waits
    node.turn_spent()
    node.mqtt_client("late")  # CONNACK in the same turn
    node.turn_spent()
    protocol, transport = AmqpProtocol(node.amqp), Transport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    protocol.data_received(PROTOCOL_HEADER)
    protocol.data_received(amqp_frames(commands.Connection.StartOk(
        mechanism="PLAIN", response="\0guest\0guest"), channel=0))
    protocol.data_received(amqp_frames(commands.Connection.TuneOk(
        channel_max=100, frame_max=131072, heartbeat=0), channel=0))
    protocol.data_received(amqp_frames(commands.Connection.Open(virtual_host="/"), channel=0))
    assert protocol.connection is not None and protocol.connection.state is State.OPEN
    assert node.budget.waiting == 0 and transport.reading


def test_the_memory_alarm_keeps_its_pause_across_turns() -> None:
    node = Broker2()
    protocol, transport = node.amqp_client()
    node.turn_spent()
    protocol.data_received(amqp_publish("t.x", b"1"))
    assert not transport.reading and protocol.deferred is not None
    protocol.pause_reading()  # the connection holds its publisher (memory alarm)
    protocol.resume_reading()
    assert not transport.reading  # ... and the read still waits for its turn
    protocol.pause_reading()
    node.turns.run_soon()  # handled at its turn, but the alarm's pause holds
    assert protocol.deferred is None and not transport.reading
    protocol.resume_reading()  # the alarm cleared
    assert transport.reading
