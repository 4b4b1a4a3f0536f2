"""A subscription that asks for a start position replays what the streams hold (journal, then
the live tail), durable or not: through the CLI and the SDK."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from shardgate.client import Client, Position, SyncClient

from tests.conftest import ThreadedBroker, free_port


def shardgate(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    env["SHARDGATE_URL"] = url
    return subprocess.run([sys.executable, "-m", "shardgate", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_cli_sub_position_earliest_receives_earlier_messages(
    broker_factory: Callable[..., ThreadedBroker],
) -> None:
    broker = broker_factory(listeners={"grpc_port": free_port()})
    url = f"127.0.0.1:{broker.app.port('grpc')}"
    device = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    device.connect("127.0.0.1", broker.mqtt_port)
    device.loop_start()
    device.publish("sensors/t1", b"21.5", qos=1).wait_for_publish(10)
    device.loop_stop()
    device.disconnect()
    assert shardgate(url, "pub", "sensors/t2", "22.0", "--header", "unit=C").returncode == 0

    result = shardgate(url, "sub", "sensors/#", "--subscription", "audit", "--position",
                       "earliest", "--count", "2", "--json", "--timeout", "20")
    assert result.returncode == 0, result.stderr
    received = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(m["topic"], m["payload"]) for m in received] == [("sensors/t1", "21.5"),
                                                               ("sensors/t2", "22.0")]
    assert received[1]["headers"] == [["unit", "C"]]
    # non-durable: nothing is left behind once the command exits
    with SyncClient(url) as client:
        assert "audit" not in {s.name for s in client.admin.list_subscriptions()}


def test_cli_durable_subscription_resumes_where_it_stopped(
    broker_factory: Callable[..., ThreadedBroker],
) -> None:
    broker = broker_factory(listeners={"grpc_port": free_port()})
    url = f"127.0.0.1:{broker.app.port('grpc')}"
    for payload in ("a", "b", "c"):
        assert shardgate(url, "pub", "jobs/x", payload).returncode == 0
    first = shardgate(url, "sub", "jobs/#", "--subscription", "workers", "--durable",
                      "--position", "earliest", "--count", "2", "--timeout", "20")
    assert first.stdout.splitlines() == ["a", "b"], first.stderr
    with SyncClient(url) as client:
        kept = {s.name: s for s in client.admin.list_subscriptions()}
        assert kept["workers"].durable
    second = shardgate(url, "sub", "jobs/#", "--subscription", "workers", "--durable",
                       "--count", "1", "--timeout", "20")
    assert second.stdout.splitlines() == ["c"], second.stderr


def test_sdk_non_durable_consumer_from_earliest(broker_factory: Callable[..., ThreadedBroker]) -> None:
    broker = broker_factory(listeners={"grpc_port": free_port()})
    url = f"127.0.0.1:{broker.app.port('grpc')}"

    async def scenario() -> list[tuple[str, bytes]]:
        async with Client(url) as client:
            await client.producer().send("sensors/t1", b"21.5", headers={"unit": "C"})
            await client.producer().send("sensors/t2", b"22.0")
            got = []
            async for message in client.consumer("audit", ["sensors/#"], position=Position.earliest()):
                got.append((message.topic, message.payload))
                message.ack()
                if len(got) == 2:
                    break
            return got

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == [
        ("sensors/t1", b"21.5"), ("sensors/t2", b"22.0")]
