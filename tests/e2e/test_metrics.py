"""Prometheus `/metrics` end to end: scraped over real HTTP and parsed with prometheus-client."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardgate.admin_http import start_http_server
from shardgate.config import StreamEntry
from tests.conftest import ThreadedBroker, free_port, wait_for
from tests.mqtt_clients import Paho

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def serve_admin(broker: ThreadedBroker) -> Iterator[str]:
    """The node's admin URL: its own HTTP listener once wired, else one started here."""
    if "http" in broker.app.listeners:
        yield f"http://127.0.0.1:{broker.app.port('http')}"
        return
    server = broker.call(start_http_server(broker.app, "127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        broker.call(server.wait_closed())


def scrape(url: str) -> tuple[str, Samples]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        content_type = response.headers["Content-Type"]
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return content_type, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def start_node(factory: Callable[..., ThreadedBroker], **sections: Any) -> ThreadedBroker:
    sections.setdefault("listeners", {"http_port": free_port(), "grpc_port": free_port()})
    return factory(**sections)


@pytest.fixture
def node(broker_factory: Callable[..., ThreadedBroker]) -> Iterator[tuple[ThreadedBroker, str]]:
    broker = start_node(broker_factory, streams=[StreamEntry("telemetry", partitions=2)],
                        listeners={"http_port": free_port(), "grpc_port": free_port(),
                                   "amqp_port": free_port()},
                        archive={"enabled": False})
    for url in serve_admin(broker):
        yield broker, url


def test_metrics_are_prometheus_text_with_the_shardgate_prefix(node: tuple[ThreadedBroker, str]) -> None:
    _, url = node
    content_type, samples = scrape(url)
    assert content_type.startswith("text/plain") and "version=" in content_type
    assert samples
    assert all(name.startswith("shardgate_") for name, _ in samples)
    assert value(samples, "shardgate_uptime_seconds") >= 0
    assert value(samples, "shardgate_start_time_seconds") > 1.6e9
    assert value(samples, "shardgate_connections", protocol="mqtt") == 0
    assert value(samples, "shardgate_process_open_fds") > 0


def test_traffic_moves_connection_message_and_offset_metrics(node: tuple[ThreadedBroker, str]) -> None:
    broker, url = node
    _, before = scrape(url)
    subscriber = Paho(broker.mqtt_port, "metrics-sub")
    publisher = Paho(broker.mqtt_port, "metrics-pub")
    try:
        subscriber.subscribe("telemetry/#", qos=1)
        for i in range(4):
            publisher.publish(f"telemetry/{i}", b"abcdefgh", qos=1)
        for _ in range(4):
            subscriber.expect()
        publisher.publish("state/lamp", b"on", qos=1, retain=True)
        _, after = scrape(url)
    finally:
        subscriber.client.disconnect()
        publisher.client.disconnect()
    assert value(after, "shardgate_connections", protocol="mqtt") == 2
    received = "shardgate_messages_received_total"
    assert value(after, received) >= value(before, received) + 5
    assert value(after, "shardgate_bytes_received_total") >= value(before, "shardgate_bytes_received_total") + 34
    assert value(after, "shardgate_messages_sent_total") >= value(before, "shardgate_messages_sent_total") + 4
    assert value(after, "shardgate_bytes_sent_total") >= 32
    assert value(after, "shardgate_messages_dropped_total") >= 0
    offsets = sum(value(after, "shardgate_stream_offset", stream="telemetry", shard=str(i)) for i in (0, 1))
    assert offsets == 4
    assert value(after, "shardgate_stream_low_watermark", stream="telemetry", shard="0") == 0
    assert value(after, "shardgate_retained_messages") >= 1
    assert value(after, "shardgate_sessions", state="connected") == 2
    assert value(after, "shardgate_journal_records_total") >= 5
    assert value(after, "shardgate_journal_fsyncs_total") >= 1
    assert value(after, "shardgate_subscription_consumers", subscription="mqtt:metrics-sub") == 1


def test_subscription_lag_and_inflight_of_an_offline_session(node: tuple[ThreadedBroker, str]) -> None:
    broker, url = node
    subscriber = Paho(broker.mqtt_port, "offline-sub", session_expiry=600)
    subscriber.subscribe("telemetry/#", qos=1)
    subscriber.client.disconnect()
    subscriber.client.loop_stop()
    publisher = Paho(broker.mqtt_port, "lag-pub")
    try:
        for _ in range(7):
            publisher.publish("telemetry/z", b"m", qos=1)
    finally:
        publisher.client.disconnect()

    def lag() -> Samples | None:
        _, samples = scrape(url)
        key = ("shardgate_subscription_lag", (("subscription", "mqtt:offline-sub"),))
        return samples if samples.get(key) == 7 else None

    samples = wait_for(lag)
    assert value(samples, "shardgate_subscription_inflight", subscription="mqtt:offline-sub") == 0
    assert value(samples, "shardgate_sessions", state="disconnected") == 1


def test_two_brokers_in_one_process_keep_separate_registries(
    broker_factory: Callable[..., ThreadedBroker],
) -> None:
    first = start_node(broker_factory)
    second = start_node(broker_factory)
    for first_url in serve_admin(first):
        for second_url in serve_admin(second):
            client = Paho(first.mqtt_port, "only-on-first")
            try:
                _, on_first = scrape(first_url)
                _, on_second = scrape(second_url)
            finally:
                client.client.disconnect()
            assert value(on_first, "shardgate_connections", protocol="mqtt") == 1
            assert value(on_second, "shardgate_connections", protocol="mqtt") == 0


def test_archive_status_numbers_become_gauges(node: tuple[ThreadedBroker, str]) -> None:
    broker, url = node

    class Archiver:
        def status(self) -> dict[str, Any]:
            return {"lag_records": 42, "files written": 3, "running": True, "url": "file:///x"}

    broker.app.archiver = Archiver()
    try:
        _, samples = scrape(url)
    finally:
        broker.app.archiver = None
    assert value(samples, "shardgate_archive_lag_records") == 42
    assert value(samples, "shardgate_archive_files_written") == 3
    assert not [name for name, _ in samples if name in ("shardgate_archive_running", "shardgate_archive_url")]


def test_amqp_queue_depth_and_connection_are_counted(node: tuple[ThreadedBroker, str]) -> None:
    broker, url = node
    connection = pika.BlockingConnection(
        pika.ConnectionParameters("127.0.0.1", broker.app.port("amqp")))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.queue_declare("work", durable=False)
        for _ in range(3):
            channel.basic_publish("", "work", b"job")
        _, samples = scrape(url)
        assert value(samples, "shardgate_connections", protocol="amqp") == 1
        assert value(samples, "shardgate_subscription_queued", subscription="amqp:/:work") == 3
    finally:
        connection.close()
