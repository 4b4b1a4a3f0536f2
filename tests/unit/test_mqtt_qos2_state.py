"""The QoS 2 inbound state of a persistent MQTT session goes to the storage port in one batch
per event-loop turn, not as one synchronous write per PUBLISH; the MQTT layer holds no
metadata store."""

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
        self.qos2_batches: list[list[tuple[str, int, bool]]] = []
        self.qos2: dict[str, set[int]] = {}

    def save_session(self, client_id: str, expiry_interval: int, disconnected_ms: int | None,
                     data: bytes) -> None:
        pass

    def forget_session(self, client_id: str) -> None:
        self.qos2.pop(client_id, None)

    def load_sessions(self) -> list[object]:
        return []

    def save_qos2(self, changes: Sequence[tuple[str, int, bool]]) -> None:
        self.qos2_batches.append(list(changes))
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


async def test_qos2_state_of_a_persistent_session_is_written_once_per_loop_turn() -> None:
    broker = Broker(storage=MemoryStorage(), default_stream=StreamConfig("default", mode="reliable"))
    ports = SavedPorts()
    service = MqttService(Edge(broker), store=ports, scheduler=asyncio.get_running_loop())
    connection = MqttConnection(service, Wire(), "127.0.0.1:5000")
    connect = p.Connect("MQTT", 4, False, 60, "keeper")  # clean session off: persistent
    publishes = b"".join(
        encode(p.Publish(f"t/{pid}", b"x", qos=2, packet_id=pid), 4) for pid in (1, 2, 3)
    )
    connection.data_received(encode(connect, 4) + publishes)
    assert ports.qos2_batches == []  # nothing written synchronously on the PUBLISH path
    await asyncio.sleep(0)  # one loop turn
    assert ports.qos2_batches == [[("keeper", 1, True), ("keeper", 2, True), ("keeper", 3, True)]]

    connection.data_received(encode(p.Pubrel(1), 4) + encode(p.Pubrel(2), 4))
    await asyncio.sleep(0)
    assert ports.qos2_batches[1:] == [[("keeper", 1, False), ("keeper", 2, False)]]
    assert ports.qos2_inbound("keeper") == {3}
