"""In a cluster a persistent MQTT session's QoS 2 state is replicated before what reports it
goes out (`RemoteSessions.exactly_once`): a PUBREC once the message is committed and its packet
id replicated, a PUBCOMP once the released id is, a PUBREL to a subscriber once its release is;
a replication that fails closes the connection instead of answering. Driven with bytes, a
manual replicated future and the in-memory storage ports of `test_mqtt_qos2_state`."""

from __future__ import annotations

import asyncio

from shardgate.core.broker import Broker
from shardgate.core.edge import Edge
from shardgate.core.streams import StreamConfig
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode
from shardgate.protocols.mqtt.connection import MqttConnection
from shardgate.protocols.mqtt.service import MqttService
from shardgate.protocols.mqtt.session import MqttSession
from shardgate.protocols.mqtt.snapshot import SessionSnapshot
from shardgate.protocols.mqtt.snapshotting import capture
from shardgate.storage.memory import MemoryStorage

from tests.unit.test_mqtt_qos2_state import SavedPorts, Wire


class Replicating:
    """The cluster's side of `RemoteSessions`, as far as QoS 2 state goes: every change asked
    for in a turn shares one future, resolved (or failed) by the test; what was replicated is
    the session's snapshot when asked."""

    def __init__(self) -> None:
        self.batch: asyncio.Future[None] | None = None
        self.snapshots: list[SessionSnapshot] = []

    def find(self, client_id: str, clean_start: bool, username: str | None) -> None:
        return None

    def moved_on(self, client_id: str) -> bool:
        return False

    def saved(self, client_id: str, *, offline: bool) -> None:
        pass

    def forgotten(self, client_id: str) -> None:
        pass

    def exactly_once(self, session: MqttSession) -> asyncio.Future[None]:
        self.snapshots.append(capture(session, "n1"))
        if self.batch is None or self.batch.done():
            self.batch = asyncio.get_running_loop().create_future()
        return self.batch


async def _connected(client_id: str = "keeper") -> tuple[MqttService, MqttConnection, Wire, Replicating]:
    broker = Broker(storage=MemoryStorage(), default_stream=StreamConfig("default", mode="reliable"))
    service = MqttService(Edge(broker), store=SavedPorts(), scheduler=asyncio.get_running_loop())
    remote = Replicating()
    service.join_cluster(remote)
    wire = Wire()
    connection = MqttConnection(service, wire, "127.0.0.1:5000")
    connection.data_received(encode(p.Connect("MQTT", 4, False, 60, client_id), 4))
    for _ in range(3):
        await asyncio.sleep(0)
    assert wire.out.startswith(b"\x20")  # CONNACK
    wire.out.clear()
    return service, connection, wire, remote


async def _turns(count: int = 3) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def test_a_pubrec_waits_until_the_packet_id_is_replicated() -> None:
    _service, connection, wire, remote = await _connected()
    connection.data_received(encode(p.Publish("t/a", b"x", qos=2, packet_id=7), 4))
    await _turns()
    assert not wire.out, "PUBREC before the packet id was replicated"
    assert remote.snapshots and remote.snapshots[-1].qos2 == [7]
    assert remote.batch is not None
    remote.batch.set_result(None)
    await _turns()
    assert wire.out == encode(p.Pubrec(7), 4)


async def test_a_retransmitted_publish_is_answered_once_its_id_is_replicated() -> None:
    _service, connection, wire, remote = await _connected()
    connection.data_received(encode(p.Publish("t/a", b"x", qos=2, packet_id=7), 4))
    await _turns()
    assert remote.batch is not None
    remote.batch.set_result(None)
    await _turns()
    wire.out.clear()
    connection.data_received(encode(p.Publish("t/a", b"x", qos=2, dup=True, packet_id=7), 4))
    await _turns()
    assert not wire.out
    remote.batch.set_result(None)
    await _turns()
    assert wire.out == encode(p.Pubrec(7), 4)


async def test_a_pubcomp_waits_until_the_released_id_is_replicated() -> None:
    _service, connection, wire, remote = await _connected()
    connection.data_received(encode(p.Publish("t/a", b"x", qos=2, packet_id=7), 4))
    await _turns()
    assert remote.batch is not None
    remote.batch.set_result(None)
    await _turns()
    wire.out.clear()
    connection.data_received(encode(p.Pubrel(7), 4))
    await _turns()
    assert not wire.out
    assert remote.snapshots[-1].qos2 == []
    remote.batch.set_result(None)
    await _turns()
    assert wire.out == encode(p.Pubcomp(7), 4)


async def test_a_failed_replication_closes_the_connection_without_the_pubrec() -> None:
    _service, connection, wire, remote = await _connected()
    connection.data_received(encode(p.Publish("t/a", b"x", qos=2, packet_id=7), 4))
    await _turns()
    assert remote.batch is not None
    remote.batch.set_exception(RuntimeError("no leader"))
    await _turns()
    assert encode(p.Pubrec(7), 4) not in wire.out
    assert connection.state.name == "CLOSED"


def test_an_id_whose_message_waits_for_its_commit_is_not_in_a_snapshot() -> None:
    session = MqttSession.__new__(MqttSession)
    session.inbound_qos2 = {1, 2}
    session.qos2_committing = {2}
    assert sorted(session.inbound_qos2 - session.qos2_committing) == [1]


def test_of_two_snapshots_the_higher_generation_is_newer_whatever_its_clock() -> None:
    older = SessionSnapshot(client_id="c", taken_ms=2_000, generation=1)
    moved = SessionSnapshot(client_id="c", taken_ms=1_000, generation=2)
    later = SessionSnapshot(client_id="c", taken_ms=3_000, generation=1)
    assert moved.newer_than(older) and not older.newer_than(moved)
    assert later.newer_than(older) and not older.newer_than(later)
    assert SessionSnapshot.decode(moved.encode()).generation == 2
    assert SessionSnapshot.decode(SessionSnapshot(client_id="c").encode()).generation == 0
