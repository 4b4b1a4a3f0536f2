"""Interoperability with other MQTT clients: mosquitto_pub/mosquitto_sub and amqtt."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import pytest

from tests.mqtt_clients import V5, V311, Paho

needs_mosquitto = pytest.mark.skipif(
    shutil.which("mosquitto_pub") is None, reason="mosquitto-clients not installed"
)


@needs_mosquitto
@pytest.mark.parametrize("version", ["mqttv311", "mqttv5"])
def test_mosquitto_sub_receives_mosquitto_pub(broker, version):
    port = str(broker.mqtt_port)
    sub = subprocess.Popen(
        ["mosquitto_sub", "-h", "127.0.0.1", "-p", port, "-V", version, "-t", "cli/#", "-q", "1",
         "-C", "3", "-v", "-W", "20"],
        stdout=subprocess.PIPE, text=True,
    )
    watcher = Paho(broker.mqtt_port, "watcher", V311)
    watcher.subscribe("$SYS/broker/subscriptions/count", 0)
    from tests.conftest import wait_for

    wait_for(lambda: broker.call(lambda: "cli/#" in str(broker.app.broker.subscriptions)), 10)
    for index in range(3):
        subprocess.run(
            ["mosquitto_pub", "-h", "127.0.0.1", "-p", port, "-V", version, "-t", f"cli/{index}",
             "-m", f"hello {index}", "-q", "1"],
            check=True, timeout=20,
        )
    out, _ = sub.communicate(timeout=20)
    assert out.splitlines() == [f"cli/{i} hello {i}" for i in range(3)]


@needs_mosquitto
def test_mosquitto_pub_retained_and_paho_v5_reads(broker):
    subprocess.run(
        ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(broker.mqtt_port), "-V", "mqttv5", "-t", "keep",
         "-m", "v", "-r", "-q", "2", "-D", "publish", "user-property", "k", "v"],
        check=True, timeout=20,
    )
    client = Paho(broker.mqtt_port, "reader", V5)
    client.subscribe("keep", 2)
    message = client.expect()
    assert message.payload == b"v" and message.retain
    assert message.properties.UserProperty == [("k", "v")]


async def test_amqtt_client_roundtrip(broker):
    from amqtt.client import MQTTClient

    url = f"mqtt://127.0.0.1:{broker.mqtt_port}/"
    sub = MQTTClient(client_id="amqtt-sub")
    await sub.connect(url)
    await sub.subscribe([("amqtt/#", 1)])
    pub = MQTTClient(client_id="amqtt-pub")
    await pub.connect(url)
    for qos in (0, 1, 2):
        await pub.publish(f"amqtt/{qos}", f"q{qos}".encode(), qos=qos)
    got = []
    for _ in range(3):
        message = await asyncio.wait_for(sub.deliver_message(), 10)
        got.append((message.topic, bytes(message.data)))
    assert sorted(got) == [("amqtt/0", b"q0"), ("amqtt/1", b"q1"), ("amqtt/2", b"q2")]
    await pub.disconnect()
    await sub.disconnect()
