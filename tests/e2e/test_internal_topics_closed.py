"""No client subscribes under `$internal/`, on any protocol, even on an open broker.

The broker keeps its own state there: AMQP topology on every node, and in a cluster the
snapshots of persistent MQTT sessions and the states of durable queues, with the messages they
hold (`shardgate/cluster/state_log.py`). A leading wildcard never matches a `$` topic, but a
filter naming `$internal/` itself would; the front door refuses it as it refuses a filter the
ACL denies: SUBACK 0x87 (0x80 in MQTT 3.1.1), gRPC PERMISSION_DENIED, AMQP 403."""

from __future__ import annotations

import aio_pika
import aiormq
import pytest
from shardgate.client import Client, PermissionDenied

from tests.conftest import ThreadedBroker, free_port
from tests.mqtt_clients import V5, V311, Paho

NOT_AUTHORIZED_V5 = 0x87
FAILURE_V311 = 0x80


def reason_codes(granted: list) -> list[int]:
    return [getattr(code, "value", code) for code in granted]


@pytest.fixture
def open_broker(broker_factory) -> ThreadedBroker:
    return broker_factory(listeners={"amqp_port": free_port(), "grpc_port": free_port()})


def test_mqtt_subscriptions_under_internal_are_not_authorized(open_broker: ThreadedBroker) -> None:
    v5 = Paho(open_broker.mqtt_port, "snoop5", V5)
    codes = reason_codes(v5.subscribe([("$internal/#", 1), ("$internal/mqtt-session/+", 1), ("ok/#", 1)]))
    assert codes == [NOT_AUTHORIZED_V5, NOT_AUTHORIZED_V5, 1]
    v311 = Paho(open_broker.mqtt_port, "snoop311", V311)
    assert reason_codes(v311.subscribe([("$internal/amqp/topology/#", 0), ("ok/#", 0)])) == [FAILURE_V311, 0]
    for client in (v5, v311):
        client.disconnect()


async def test_grpc_consumers_under_internal_are_permission_denied(open_broker: ThreadedBroker) -> None:
    async with Client(f"127.0.0.1:{open_broker.app.port('grpc')}") as client:
        with pytest.raises(PermissionDenied) as refused:
            await client.consumer("snoop", ["$internal/#"]).subscribe()
        assert "$internal/#" in refused.value.details
        allowed = await client.consumer("fine", ["ok/#"]).subscribe()
        await allowed.close()


async def test_amqp_bindings_under_internal_are_access_refused(open_broker: ThreadedBroker) -> None:
    url = f"amqp://guest:guest@127.0.0.1:{open_broker.app.port('amqp')}/"
    async with await aio_pika.connect(url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("snoop", auto_delete=True)
        topic = await channel.get_exchange("amq.topic")
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
            await queue.bind(topic, "$internal.#")
        channel = await conn.channel()
        queue = await channel.declare_queue("fine", auto_delete=True)
        await queue.bind(await channel.get_exchange("amq.topic"), "ok.#")
