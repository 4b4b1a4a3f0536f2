"""gRPC and MQTT on one core: a message keeps its headers, content type and correlation across."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from shardgate.client import Client

from tests.conftest import ThreadedBroker, free_port
from tests.mqtt_clients import V5, V311, Paho, publish_props

TIMEOUT = 5.0


@pytest.fixture
def grpc_broker(broker_factory: Callable[..., ThreadedBroker]) -> ThreadedBroker:
    return broker_factory(listeners={"grpc_port": free_port()})


@pytest.fixture
async def client(grpc_broker: ThreadedBroker) -> AsyncIterator[Client]:
    async with Client(f"127.0.0.1:{grpc_broker.app.port('grpc')}") as client:
        yield client


async def test_grpc_publish_reaches_mqtt5_wildcard_subscriber(
    client: Client, grpc_broker: ThreadedBroker
) -> None:
    subscriber = await asyncio.to_thread(Paho, grpc_broker.mqtt_port, "sub5", V5)
    await asyncio.to_thread(subscriber.subscribe, "sensors/+", 1)
    await client.producer("gw").send(
        "sensors/t1", b"21.5", headers=[("unit", "C"), ("site", "lab")],
        content_type="text/plain", correlation_data=b"req-7", reply_to="replies/gw",
    )
    message = await asyncio.to_thread(subscriber.expect)
    assert message.topic == "sensors/t1" and message.payload == b"21.5"
    props = message.properties
    assert props.UserProperty == [("unit", "C"), ("site", "lab")]
    assert props.ContentType == "text/plain"
    assert props.CorrelationData == b"req-7"
    assert props.ResponseTopic == "replies/gw"
    await asyncio.to_thread(subscriber.disconnect)


async def test_grpc_publish_reaches_mqtt311_subscriber(
    client: Client, grpc_broker: ThreadedBroker
) -> None:
    subscriber = await asyncio.to_thread(Paho, grpc_broker.mqtt_port, "sub311", V311)
    await asyncio.to_thread(subscriber.subscribe, "plant/#", 0)
    await client.producer().publish("plant/line1/state", b"running")
    message = await asyncio.to_thread(subscriber.expect)
    assert (message.topic, message.payload) == ("plant/line1/state", b"running")
    await asyncio.to_thread(subscriber.disconnect)


async def test_mqtt_publish_reaches_grpc_consumer_with_properties(
    client: Client, grpc_broker: ThreadedBroker
) -> None:
    consumer = await client.consumer("bridge", ["devices/#"]).subscribe()
    publisher = await asyncio.to_thread(Paho, grpc_broker.mqtt_port, "dev-1", V5)
    props = publish_props(UserProperty=[("fw", "1.2"), ("fw", "1.3")], ContentType="application/json",
                          CorrelationData=b"\x00\x01", ResponseTopic="devices/dev-1/reply")
    await asyncio.to_thread(publisher.publish, "devices/dev-1/temp", b'{"t": 20}', 1, False, props)
    message = await consumer.receive(TIMEOUT)
    message.ack()
    assert message.topic == "devices/dev-1/temp" and message.json() == {"t": 20}
    assert message.headers == [("fw", "1.2"), ("fw", "1.3")]
    assert message.content_type == "application/json"
    assert message.correlation_data == b"\x00\x01"
    assert message.reply_to == "devices/dev-1/reply"
    assert (message.producer_protocol, message.producer_id) == ("mqtt", "dev-1")
    await asyncio.to_thread(publisher.disconnect)


async def test_mqtt_clients_are_listed_beside_grpc_ones(
    client: Client, grpc_broker: ThreadedBroker
) -> None:
    device = await asyncio.to_thread(Paho, grpc_broker.mqtt_port, "listed-device", V5)
    clients = await client.admin.list_clients()
    mqtt = [c for c in clients if c.protocol == "mqtt"]
    assert [c.client_id for c in mqtt] == ["listed-device"] and mqtt[0].detail == "mqtt 5.0"
    await asyncio.to_thread(device.disconnect)


async def test_list_clients_shows_every_protocol_from_one_registry(
    broker_factory: Callable[..., ThreadedBroker],
) -> None:
    import aio_pika

    node = broker_factory(listeners={"grpc_port": free_port(), "amqp_port": free_port()})
    amqp = await aio_pika.connect(
        f"amqp://guest:guest@127.0.0.1:{node.app.port('amqp')}/", client_properties={"connection_name": "billing"}
    )
    device = await asyncio.to_thread(Paho, node.mqtt_port, "listed-too", V311)
    try:
        async with Client(f"127.0.0.1:{node.app.port('grpc')}") as client:
            consumer = await client.consumer("everyone", ["x/#"], name="watcher").subscribe()
            clients = await client.admin.list_clients()
            by_protocol = {c.protocol: c for c in clients}
            assert set(by_protocol) == {"mqtt", "amqp", "grpc"}
            assert by_protocol["amqp"].detail == "amqp 0-9-1 billing"
            assert by_protocol["mqtt"].client_id == "listed-too"
            assert "consumer of everyone" in by_protocol["grpc"].detail
            await consumer.close()
    finally:
        await asyncio.to_thread(device.disconnect)
        await amqp.close()
