"""The schema registry through the real interfaces: `shardgate schemas register|list|show` (a
real CLI process over gRPC), the SDK, the configuration; a payload the stream's schema does not
accept is refused by every protocol (MQTT 5 PUBACK 0x99, an AMQP publisher confirm nack, gRPC
INVALID_ARGUMENT), counted (CLI, Prometheus) and logged a few times, not once per message;
registered versions survive a restart."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import aio_pika
import fastavro
import pytest
from shardgate.client import Client, FailedPrecondition, InvalidArgument
from shardgate.protocols.mqtt import packets as p

from shardgate.config import StreamEntry
from tests.conftest import ThreadedBroker, free_port, make_config
from tests.mqtt_clients import RawClient

READING = {"type": "object", "properties": {"device": {"type": "string"},
                                            "temp": {"type": "number"}},
           "required": ["device", "temp"]}
AVRO = {"type": "record", "name": "Reading", "fields": [
    {"name": "device", "type": "string"}, {"name": "temp", "type": "double"}]}


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    return subprocess.run([sys.executable, "-m", "shardgate", *args, "--url", url],
                          capture_output=True, text=True, timeout=60, env=env)


def start(data: Path, **sections: object) -> ThreadedBroker:
    config = make_config(data, listeners={"grpc_port": free_port(), "amqp_port": free_port(),
                                          "http_port": free_port()},
                         streams=[StreamEntry("sensors", routes=["sensors/#"])], **sections)
    return ThreadedBroker(config).start()


async def test_registered_schema_refuses_bad_payloads_on_every_protocol(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broker = start(tmp_path / "data")
    url = f"127.0.0.1:{broker.app.port('grpc')}"
    try:
        schema_file = tmp_path / "reading.json"
        schema_file.write_text(json.dumps(READING))
        registered = cli(url, "schemas", "register", "sensors", str(schema_file), "--type", "json")
        assert registered.returncode == 0, registered.stderr
        assert "stream sensors: schema version 1 (json, compatibility backward)" in registered.stdout

        # MQTT 5: PUBACK 0x99 (payload format invalid) with the reason; a good one is stored.
        raw = RawClient(broker.mqtt_port, 5)
        raw.connect("meter")
        raw.send(p.Publish("sensors/d1", b'{"device": "d1", "temp": 21.5}', 1, packet_id=1))
        assert raw.receive().reason_code == 0
        with caplog.at_level(logging.WARNING):
            for packet_id in range(2, 202):
                raw.send(p.Publish("sensors/d1", b'{"device": "d1", "temp": "hot"}', 1,
                                   packet_id=packet_id))
            acks = [raw.receive() for _ in range(200)]
        assert {ack.reason_code for ack in acks} == {0x99}
        assert "temp must be number" in acks[0].properties.reason_string
        refusals = [r for r in caplog.records if "temp must be number" in r.getMessage()]
        assert 1 <= len(refusals) <= 2, "refusals are logged rate-limited, not one per message"

        # AMQP: the publisher confirm is a nack.
        connection = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{broker.app.port('amqp')}/")
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange("amq.topic")
            queue = await channel.declare_queue("readings", durable=True)
            await queue.bind("amq.topic", "sensors.#")
            persistent = aio_pika.DeliveryMode.PERSISTENT
            await exchange.publish(aio_pika.Message(b'{"device": "d2", "temp": 3}',
                                                    delivery_mode=persistent), "sensors.d2")
            with pytest.raises(aio_pika.exceptions.DeliveryError, match="Nack"):
                await exchange.publish(aio_pika.Message(b'{"device": "d2"}',
                                                        delivery_mode=persistent), "sensors.d2")

        # gRPC: INVALID_ARGUMENT; the SDK sees the versions and the count.
        async with Client(url) as client:
            with pytest.raises(InvalidArgument, match="device"):
                await client.producer().send("sensors/d3", b'{"temp": 1}')
            await client.producer().send("sensors/d3", b'{"device": "d3", "temp": 1}')
            [latest] = await client.admin.list_schemas()
            assert (latest.stream, latest.version, latest.rejected) == ("sensors", 1, 202)
            # a version that breaks backward compatibility is refused with the reason
            required = {**READING, "required": ["device", "temp", "site"],
                        "properties": {**READING["properties"], "site": {"type": "string"}}}
            with pytest.raises(FailedPrecondition, match="site: required now"):
                await client.admin.register_schema("sensors", required)
            widened = {**READING, "properties": {**READING["properties"],
                                                 "site": {"type": "string"}}}
            assert (await client.admin.register_schema("sensors", widened)).version == 2

        listed = cli(url, "schemas", "list")
        assert listed.stdout.splitlines()[1].split() == ["sensors", "2", "json", "backward", "202"]
        shown = json.loads(cli(url, "schemas", "show", "sensors", "--json").stdout)
        assert [v["version"] for v in shown] == [1, 2]
        metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{broker.app.port('http')}/metrics", timeout=10).read().decode()
        assert 'shardgate_schema_rejected_total{stream="sensors"} 202.0' in metrics
        unknown = cli(url, "schemas", "register", "nosuch", str(schema_file))
        assert unknown.returncode == 1 and "nosuch" in unknown.stderr
        assert "Traceback" not in unknown.stderr
    finally:
        broker.stop()

    # The versions come back after a restart, and still refuse.
    again = start(tmp_path / "data")
    try:
        async with Client(f"127.0.0.1:{again.app.port('grpc')}") as client:
            assert [v.version for v in await client.admin.schemas("sensors")] == [1, 2]
            with pytest.raises(InvalidArgument):
                await client.producer().send("sensors/d1", b"[]")
    finally:
        again.stop()


async def test_avro_schema_from_the_configuration(tmp_path: Path) -> None:
    schema_file = tmp_path / "reading.avsc"
    schema_file.write_text(json.dumps(AVRO))
    config = make_config(tmp_path / "data", listeners={"grpc_port": free_port()}, streams=[
        StreamEntry("readings", routes=["readings/#"], schema_file=str(schema_file),
                    schema_type="avro")])
    broker = ThreadedBroker(config).start()
    try:
        datum = io.BytesIO()
        fastavro.schemaless_writer(datum, fastavro.parse_schema(AVRO), {"device": "d", "temp": 1.5})
        async with Client(f"127.0.0.1:{broker.app.port('grpc')}") as client:
            receipt = await client.producer().send("readings/d", datum.getvalue())
            assert receipt.stream == "readings"
            with pytest.raises(InvalidArgument, match="Avro"):
                await client.producer().send("readings/d", b'{"device": "d"}')
            [version] = await client.admin.schemas("readings")
            assert (version.type, version.version) == ("avro", 1)
    finally:
        broker.stop()
