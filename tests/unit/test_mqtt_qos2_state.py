"""The QoS 2 inbound state of a persistent MQTT session goes to the storage port, and the
changes of one read are committed together (one group commit) before any acknowledgement goes
out, not as one synchronous commit per PUBLISH; the MQTT layer holds no metadata store."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from shardgate.core.broker import Broker
from shardgate.core.edge import Edge
from shardgate.core.streams import StreamConfig
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode
from shardgate.protocols.mqtt.connection import MqttConnection
from shardgate.protocols.mqtt.service import MqttService
from shardgate.storage.memory import MemoryStorage


class SavedPorts:
    """An in-memory implementation of the MQTT layer's storage ports."""

    def __init__(self) -> None:
        self.commits: list[list[tuple[str, int, bool]]] = []  # what each commit made durable
        self.qos2: dict[str, set[int]] = {}
        self._grouping = False
        self._group: list[tuple[str, int, bool]] = []

    def save_session(self, client_id: str, expiry_interval: int, disconnected_ms: int | None,
                     data: bytes) -> None:
        pass

    def forget_session(self, client_id: str) -> None:
        self.qos2.pop(client_id, None)

    def load_sessions(self) -> list[object]:
        return []

    def group_writes(self, on: bool) -> None:
        self._grouping = on

    @property
    def group_pending(self) -> bool:
        return bool(self._group)

    def commit_group(self) -> None:
        if self._group:
            self.commits.append(self._group)
            self._group = []

    @property
    def write_count(self) -> int:
        return sum(len(changes) for changes in self.commits) + len(self._group)

    def durable_waiter(self) -> None:
        return None  # durable once committed

    def save_qos2(self, changes: Sequence[tuple[str, int, bool]]) -> None:
        self._group.extend(changes)
        if not self._grouping:
            self.commit_group()
        for client_id, packet_id, present in changes:
            ids = self.qos2.setdefault(client_id, set())
            if present:
                ids.add(packet_id)
            else:
                ids.discard(packet_id)

    def qos2_inbound(self, client_id: str) -> set[int]:
        return set(self.qos2.get(client_id, ()))

    def save_cursor(self, subscription: str, stream: str, shard: int, floor: int, state: bytes) -> None:
        pass

    def flush(self) -> None:
        pass

    def load_cursors(self, subscription: str) -> list[object]:
        return []


class Wire:
    """The connection's transport: keeps what the broker wrote."""

    def __init__(self) -> None:
        self.out = bytearray()

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        pass

    def buffered(self) -> int:
        return 0

    def throttle(self, seconds: float) -> None:
        pass


async def test_qos2_state_of_one_read_is_committed_once_before_the_pubrecs() -> None:
    broker = Broker(storage=MemoryStorage(), default_stream=StreamConfig("default", mode="reliable"))
    ports = SavedPorts()
    service = MqttService(Edge(broker), store=ports, scheduler=asyncio.get_running_loop())
    wire = Wire()
    connection = MqttConnection(service, wire, "127.0.0.1:5000")
    connect = p.Connect("MQTT", 4, False, 60, "keeper")  # clean session off: persistent
    connection.data_received(encode(connect, 4))
    await asyncio.sleep(0)  # one loop turn: the CONNACK is written
    wire.out.clear()
    publishes = b"".join(
        encode(p.Publish(f"t/{pid}", b"x", qos=2, packet_id=pid), 4) for pid in (1, 2, 3)
    )
    connection.data_received(publishes)
    assert ports.commits == [] and not wire.out  # nothing committed or sent mid-read
    await asyncio.sleep(0)
    assert ports.commits == [[("keeper", 1, True), ("keeper", 2, True), ("keeper", 3, True)]]
    assert wire.out == b"".join(encode(p.Pubrec(pid), 4) for pid in (1, 2, 3))

    connection.data_received(encode(p.Pubrel(1), 4) + encode(p.Pubrel(2), 4))
    await asyncio.sleep(0)
    assert ports.commits[1:] == [[("keeper", 1, False), ("keeper", 2, False)]]
    assert ports.qos2_inbound("keeper") == {3}
