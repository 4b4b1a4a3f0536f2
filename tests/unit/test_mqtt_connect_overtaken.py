"""A CONNECT whose session is being brought from another node, overtaken meanwhile by a later
CONNECT for the same client on a third node (that node's claim came after this one's, and
it took the session from here: `MqttService.release_for_takeover`), is refused, retryably
(CONNACK 0x88 / 3.1.1 code 3), instead of opening a new, empty session beside the one that
moved on. Driven with bytes and a `RemoteSessions` whose fetch the test completes."""

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
from shardgate.storage.memory import MemoryStorage

from tests.unit.test_mqtt_qos2_state import SavedPorts, Wire


class Fetching:
    """The cluster's side of `RemoteSessions`: a CONNECT's session fetch ends when the test
    says so."""

    def __init__(self) -> None:
        self.fetches: list[asyncio.Future[None]] = []
        # client ids whose session another node took over while this one was away
        self.moved: set[str] = set()

    def find(self, client_id: str, clean_start: bool, username: str | None) -> asyncio.Future[None]:
        fetch = asyncio.get_running_loop().create_future()
        self.fetches.append(fetch)
        return fetch

    def moved_on(self, client_id: str) -> bool:
        return client_id in self.moved

    def saved(self, client_id: str, *, offline: bool) -> None:
        pass

    def forgotten(self, client_id: str) -> None:
        pass

    def exactly_once(self, session: MqttSession) -> asyncio.Future[None]:
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def _turns(count: int = 3) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def _waiting(version: int) -> tuple[MqttService, MqttConnection, Wire, Fetching]:
    broker = Broker(storage=MemoryStorage(), default_stream=StreamConfig("default", mode="reliable"))
    service = MqttService(Edge(broker), store=SavedPorts(), scheduler=asyncio.get_running_loop())
    remote = Fetching()
    service.join_cluster(remote)
    wire = Wire()
    connection = MqttConnection(service, wire, "127.0.0.1:5000")
    properties = p.Properties()
    if version == 5:
        properties.session_expiry_interval = 3600
    connection.data_received(encode(
        p.Connect("MQTT", version, False, 60, "roamer", properties=properties), version))
    await _turns()
    assert remote.fetches and not wire.out  # the CONNACK waits for the session
    return service, connection, wire, remote


async def test_a_connect_overtaken_while_its_session_comes_is_refused_not_given_an_empty_session() -> None:
    for version, refused in ((5, p.ReasonCode.SERVER_UNAVAILABLE), (4, p.ConnackCode311.SERVER_UNAVAILABLE)):
        service, connection, wire, remote = await _waiting(version)
        # the session came here, then a later CONNECT on n3 claimed it and took it from here
        # before this CONNECT was answered
        assert service.release_for_takeover("roamer", "n3", clean_start=False) is None
        remote.fetches[0].set_result(None)
        await _turns()
        assert wire.out[0] == 0x20 and wire.out[3] == int(refused), bytes(wire.out)
        assert "roamer" not in service.sessions  # no empty session left here beside n3's
        assert not service._awaiting_session


async def test_a_connect_whose_session_comes_undisturbed_opens_it() -> None:
    service, connection, wire, remote = await _waiting(5)
    remote.fetches[0].set_result(None)
    await _turns()
    assert wire.out[0] == 0x20 and wire.out[3] == 0, bytes(wire.out)
    assert "roamer" in service.sessions
    assert not service._awaiting_session
    # a takeover from another node after the CONNACK ends the connection, as before
    assert service.release_for_takeover("roamer", "n3", clean_start=False) is not None
    assert not service._awaiting_session


async def test_a_connect_for_a_session_held_here_asks_the_cluster_only_when_it_moved_on() -> None:
    """A session held here offline is resumed here at once; once another node took it over
    while this one was away (`RemoteSessions.moved_on`), the CONNECT waits for it to come from
    there instead of resuming the copy left here."""
    service, connection, wire, remote = await _waiting(5)
    remote.fetches[0].set_result(None)
    await _turns()
    connection.data_received(encode(p.Disconnect(), 5))
    await _turns()
    assert "roamer" in service.sessions and service.sessions["roamer"].connection is None
    for moved, fetches in ((False, 1), (True, 2)):
        if moved:
            remote.moved.add("roamer")
        wire = Wire()
        again = MqttConnection(service, wire, "127.0.0.1:5001")
        again.data_received(encode(p.Connect("MQTT", 5, False, 60, "roamer",
                                             properties=p.Properties(session_expiry_interval=3600)), 5))
        await _turns()
        assert len(remote.fetches) == fetches
        if not moved:
            assert wire.out[0] == 0x20 and wire.out[3] == 0, bytes(wire.out)  # resumed here
            again.data_received(encode(p.Disconnect(), 5))
            await _turns()
        else:
            assert not wire.out  # the CONNACK waits for the session from its new node
            remote.fetches[-1].set_result(None)
            await _turns()
            assert wire.out[0] == 0x20 and wire.out[3] == 0, bytes(wire.out)
