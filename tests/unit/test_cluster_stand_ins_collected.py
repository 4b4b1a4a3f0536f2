"""A node's graceful stop waits (bounded) until the new nodes of the sessions it handed over
have collected what their stand-ins took (`SessionRelease.collected_within`): it wakes when
the last stand-in is collected or dropped, not at a poll. A persistent session driven with
bytes (the in-memory ports of `test_mqtt_qos2_state`), handed over to node b; the data plane
and the node are stand-ins (no pushes to wait for)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from shardgate.core.broker import Broker
from shardgate.core.edge import Edge
from shardgate.core.streams import StreamConfig
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode
from shardgate.protocols.mqtt.connection import MqttConnection
from shardgate.protocols.mqtt.service import MqttService
from shardgate.storage.memory import MemoryStorage

from shardgate.cluster.session_release import SessionRelease
from tests.unit.test_mqtt_qos2_state import SavedPorts, Wire


async def _handed_over(client_ids: list[str]) -> SessionRelease:
    broker = Broker(storage=MemoryStorage(), default_stream=StreamConfig("default", mode="reliable"))
    service = MqttService(Edge(broker), store=SavedPorts(), scheduler=asyncio.get_running_loop())
    for client_id in client_ids:
        connection = MqttConnection(service, Wire(), "127.0.0.1:5000")
        connection.data_received(encode(p.Connect("MQTT", 4, False, 60, client_id), 4))
        connection.data_received(encode(p.Subscribe(1, [p.SubscriptionRequest("t/#", 1)]), 4))
    for _ in range(5):
        await asyncio.sleep(0)
    plane = SimpleNamespace(pushes_flushed=lambda timeout_s: None)
    release = SessionRelease(SimpleNamespace(node_id="a"), service, broker, plane, set())  # type: ignore[arg-type]
    assert await release.collected_within(0)  # none yet
    for client_id in client_ids:
        answer = await release.release({"client_id": client_id, "to": "b"})
        assert answer["stand_in"]
    return release


async def test_the_wait_ends_when_the_last_stand_in_is_collected() -> None:
    release = await _handed_over(["c1", "c2"])
    waiting = asyncio.ensure_future(release.collected_within(60))
    await release.collect("c1", "b")
    await asyncio.sleep(0)
    assert not waiting.done()  # c2's new node has not collected yet
    await release.collect("c2", "b")
    assert await asyncio.wait_for(waiting, 5)  # long before its 60 s


async def test_a_dropped_stand_in_ends_the_wait_too_and_an_uncollected_one_times_out() -> None:
    release = await _handed_over(["c1", "c2"])
    await release.collect("c1", "b")
    assert not await release.collected_within(0.01)
    release.drop_stand_in("c2")  # its time is up
    assert await release.collected_within(5)
