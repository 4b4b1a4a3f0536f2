"""Deliveries are counted for every protocol (MQTT, AMQP, gRPC) in the broker's totals, the
admin API, `$SYS/broker/messages/sent` and Prometheus; `$SYS` updates are not counted."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable

import pika
from prometheus_client.parser import text_string_to_metric_families
from shardgate.client import SyncClient

from shardgate.config import StreamEntry
from tests.conftest import ThreadedBroker, free_port, wait_for
from tests.mqtt_clients import V311, Paho


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def info(url: str) -> dict:
    with urllib.request.urlopen(url + "/api/info", timeout=10) as response:
        return json.loads(response.read())


def test_deliveries_of_every_protocol_are_counted(broker_factory: Callable[..., ThreadedBroker]) -> None:
    broker = broker_factory(
        streams=[StreamEntry("telemetry", mode="non-reliable")], archive={"enabled": False},
        listeners={"http_port": free_port(), "grpc_port": free_port(), "amqp_port": free_port()},
    )
    url = f"http://127.0.0.1:{broker.app.port('http')}"
    mqtt_sub = Paho(broker.mqtt_port, "counter-sub", V311)
    mqtt_sub.subscribe("telemetry/#", 1)
    connection = pika.BlockingConnection(pika.URLParameters(
        f"amqp://guest:guest@127.0.0.1:{broker.app.port('amqp')}/"))
    channel = connection.channel()
    queue = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(queue, "amq.topic", "telemetry.#")
    with SyncClient(f"127.0.0.1:{broker.app.port('grpc')}") as client:
        consumer = client.consumer("counted", ["telemetry/#"])
        consumer.subscribe()
        before = info(url)
        assert client.producer().send("telemetry/t1", b"12345").stream == "telemetry"
        received = consumer.receive(10)
        received.ack()
        assert mqtt_sub.expect().payload == b"12345"
        method, _, body = wait_for(lambda: (lambda got: got if got[0] else None)(
            channel.basic_get(queue, auto_ack=True)))
        assert body == b"12345"
        after = info(url)
        scraped = metrics(url)
    connection.close()
    assert after["messages_out"] - before["messages_out"] == 3
    for protocol in ("mqtt", "amqp", "grpc"):
        assert scraped[("shardgate_protocol_messages_sent_total", (("protocol", protocol),))] == 1
        assert scraped[("shardgate_protocol_bytes_sent_total", (("protocol", protocol),))] == 5
    assert scraped[("shardgate_stream_messages_sent_total", (("stream", "telemetry"),))] == 3
    assert scraped[("shardgate_messages_sent_total", ())] == 3

    # $SYS/broker/messages/sent reports the same total; $SYS updates themselves count neither way.
    watcher = Paho(broker.mqtt_port, "sys-watch", V311)
    watcher.subscribe("$SYS/broker/messages/#", 0)
    totals: dict[str, str] = {}

    def sys_reports_three() -> bool:
        message = watcher.expect()
        totals[message.topic] = message.payload.decode()
        return totals.get("$SYS/broker/messages/sent") == "3" and "$SYS/broker/messages/received" in totals

    wait_for(sys_reports_three, timeout=20)
    assert totals["$SYS/broker/messages/received"] == "1"
    final = info(url)
    assert final["messages_in"] == 1 and final["messages_out"] == 3
    watcher.disconnect()
    mqtt_sub.disconnect()
