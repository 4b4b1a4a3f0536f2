"""Prometheus `/metrics` end to end: scraped over real HTTP and parsed with prometheus-client."""

from __future__ import annotations

import base64
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families
from shardgate.client import SyncClient, Unauthenticated

from shardgate.bridges.bridge import BridgeSettings, start_bridges, stop_bridges
from shardgate.config import StreamEntry
from shardgate.security.auth import User, hash_password, install_security, save_users
from tests.conftest import ThreadedBroker, free_port, serve_admin, wait_for
from tests.mqtt_clients import V311, Paho

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, auth: tuple[str, str] | None = None) -> tuple[str, Samples]:
    request = urllib.request.Request(url + "/metrics")
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
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


def grows(before: Samples, after: Samples, name: str, by: float, **labels: str) -> bool:
    return value(after, name, **labels) >= value(before, name, **labels) + by


def test_messages_and_bytes_by_protocol_and_stream(node: tuple[ThreadedBroker, str]) -> None:
    broker, url = node
    _, before = scrape(url)
    publisher = Paho(broker.mqtt_port, "by-protocol-pub")
    try:
        for _ in range(3):
            publisher.publish("telemetry/mqtt", b"0123456789", qos=1)
    finally:
        publisher.client.disconnect()
    with SyncClient(f"127.0.0.1:{broker.app.port('grpc')}") as client:
        producer = client.producer()
        for _ in range(2):
            assert producer.send("telemetry/grpc", b"abcde").stream == "telemetry"
        producer.send("other/grpc", b"xyz")  # the default stream
    _, after = scrape(url)

    received, nbytes = "shardgate_protocol_messages_received_total", "shardgate_protocol_bytes_received_total"
    assert grows(before, after, received, 3, protocol="mqtt")
    assert grows(before, after, nbytes, 30, protocol="mqtt")
    assert value(after, received, protocol="grpc") - value(before, received, protocol="grpc") == 3
    assert value(after, nbytes, protocol="grpc") - value(before, nbytes, protocol="grpc") == 13
    assert value(after, received, protocol="amqp") == 0  # every running protocol has a series
    stream_received = "shardgate_stream_messages_received_total"
    assert value(after, stream_received, stream="telemetry") - value(before, stream_received, stream="telemetry") == 5
    assert value(after, "shardgate_stream_bytes_received_total", stream="telemetry") - value(
        before, "shardgate_stream_bytes_received_total", stream="telemetry") == 40
    assert grows(before, after, stream_received, 1, stream="default")
    protocols = {dict(labels).get("protocol") for name, labels in after
                 if name == "shardgate_protocol_messages_received_total"}
    assert sum(value(after, received, protocol=p) for p in protocols) == value(
        after, "shardgate_messages_received_total")
    # Deliveries by protocol and stream are counted as the protocols hand messages to clients.
    for protocol in ("mqtt", "amqp", "grpc"):
        assert value(after, "shardgate_protocol_messages_sent_total", protocol=protocol) >= 0
        assert value(after, "shardgate_protocol_bytes_sent_total", protocol=protocol) >= 0
    assert value(after, "shardgate_stream_messages_sent_total", stream="telemetry") >= 0
    assert value(after, "shardgate_stream_bytes_sent_total", stream="default") >= 0


def histogram(samples: Samples, name: str) -> tuple[float, float, dict[str, float]]:
    """count, sum and the cumulative buckets of a histogram."""
    buckets = {dict(labels)["le"]: v for (sample, labels), v in samples.items() if sample == f"{name}_bucket"}
    return value(samples, f"{name}_count"), value(samples, f"{name}_sum"), buckets


def test_publish_to_durable_and_fsync_latency_histograms(node: tuple[ThreadedBroker, str]) -> None:
    broker, url = node
    name = "shardgate_publish_durable_latency_seconds"
    _, before = scrape(url)
    before_count, before_sum, _ = histogram(before, name)
    publisher = Paho(broker.mqtt_port, "latency-pub")
    try:
        for i in range(5):
            publisher.publish(f"telemetry/{i}", b"x", qos=1)  # each PUBACK waits for its commit
    finally:
        publisher.client.disconnect()
    with SyncClient(f"127.0.0.1:{broker.app.port('grpc')}") as client:
        client.producer().send("telemetry/grpc", b"y")
    _, after = scrape(url)

    count, total, buckets = histogram(after, name)
    assert count >= before_count + 2  # at least one commit group per protocol's publishes
    assert 0 < total - before_sum < count * 10
    assert buckets["+Inf"] == count
    assert list(buckets.values()) == sorted(buckets.values())  # cumulative
    assert {"0.0001", "0.001", "0.01", "0.1", "1.0", "10.0"} <= set(buckets)

    count, total, buckets = histogram(after, "shardgate_journal_fsync_latency_seconds")
    assert count >= 1 and total > 0 and buckets["+Inf"] == count
    assert abs(count - value(after, "shardgate_journal_fsyncs_total")) <= 1  # one may be under way


def test_dropped_messages_by_reason(node: tuple[ThreadedBroker, str]) -> None:
    broker, url = node

    def orphan() -> None:  # a live subscription that no consumer is attached to
        core = broker.app.broker
        core.add_filter(core.subscription("orphan"), "telemetry/orphan/#")

    broker.call(orphan)
    _, before = scrape(url)
    publisher = Paho(broker.mqtt_port, "drop-pub")
    try:
        for _ in range(3):
            publisher.publish("telemetry/orphan/1", b"lost", qos=1)
    finally:
        publisher.client.disconnect()
    _, after = scrape(url)
    by_reason = "shardgate_messages_dropped_by_reason_total"
    assert value(after, by_reason, reason="no_consumer") - value(before, by_reason, reason="no_consumer") == 3
    assert grows(before, after, "shardgate_messages_dropped_total", 3)
    reasons = [dict(labels)["reason"] for name, labels in after if name == by_reason]
    assert "other" in reasons  # drops the protocols count without a reason
    assert sum(value(after, by_reason, reason=r) for r in reasons) == value(
        after, "shardgate_messages_dropped_total")


def test_security_denials_by_protocol_and_action(node: tuple[ThreadedBroker, str]) -> None:
    broker, url = node
    data_dir = broker.config.data_dir
    save_users(data_dir / "users.json", {"alice": User("alice", hash_password("alice-pw")),
                                         "ops": User("ops", hash_password("ops-pw"), ["admin"])})
    (data_dir / "acl.toml").write_text('[[allow]]\nactions = ["publish", "subscribe"]\n'
                                       'topics = ["devices/%u/#"]\n')
    broker.call(lambda: install_security(broker.app))
    ops = ("ops", "ops-pw")  # /metrics needs an admin once users exist
    _, before = scrape(url, ops)
    denials = "shardgate_security_denials_total"
    assert not [name for name, _ in before if name == denials]  # nothing refused yet

    intruder = Paho(broker.mqtt_port, "intruder", V311, username="alice", password="nope", connect=False)
    assert intruder.connect()[1] != 0
    alice = Paho(broker.mqtt_port, "alice-1", V311, username="alice", password="alice-pw")
    try:
        alice.publish("devices/bob/temp", b"forged", qos=1)  # acknowledged, then dropped
    finally:
        alice.client.disconnect()
    grpc_url = f"127.0.0.1:{broker.app.port('grpc')}"
    with SyncClient(grpc_url, username="alice", password="wrong") as client, \
            pytest.raises(Unauthenticated):
        client.producer().send("devices/alice/temp", b"21")

    def counted() -> Samples | None:
        _, samples = scrape(url, ops)
        keys = [(denials, (("action", a), ("protocol", p)))
                for p, a in (("mqtt", "connect"), ("mqtt", "publish"), ("grpc", "connect"))]
        return samples if all(key in samples for key in keys) else None

    after = wait_for(counted)
    assert value(after, denials, protocol="mqtt", action="connect") == 1
    assert value(after, denials, protocol="mqtt", action="publish") == 1
    assert value(after, denials, protocol="grpc", action="connect") >= 1


def test_bridge_status_becomes_metrics(broker_factory: Callable[..., ThreadedBroker]) -> None:
    remote = start_node(broker_factory)
    local = start_node(broker_factory)
    for url in serve_admin(local):
        check_bridge_metrics(local, remote, url)


def check_bridge_metrics(local: ThreadedBroker, remote: ThreadedBroker, url: str) -> None:
    _, before = scrape(url)
    assert not [name for name, _ in before if name.startswith("shardgate_bridge_")]
    settings = BridgeSettings(name="edge", remote=f"mqtt://127.0.0.1:{remote.mqtt_port}", out=["sensors/#"])
    bridge = local.call(lambda: start_bridges(local.app, [settings]))[0]
    forwarded = ("shardgate_bridge_forwarded_total", (("bridge", "edge"), ("direction", "out")))

    def acked() -> Samples | None:  # the bridge counts a message once the remote acks it
        _, samples = scrape(url)
        return samples if samples.get(forwarded) == 2 else None

    try:
        wait_for(lambda: bridge.connected)
        watcher = Paho(remote.mqtt_port, "hq")
        device = Paho(local.mqtt_port, "device")
        try:
            watcher.subscribe("sensors/#", qos=1)
            for _ in range(2):
                device.publish("sensors/1", b"21", qos=1)
            watcher.expect_n(2)
        finally:
            watcher.client.disconnect()
            device.client.disconnect()
        samples = wait_for(acked)
    finally:
        local.call(stop_bridges(local.app))
    assert value(samples, "shardgate_bridge_connected", bridge="edge") == 1
    assert value(samples, "shardgate_bridge_forwarded_total", bridge="edge", direction="in") == 0
    assert value(samples, "shardgate_bridge_queued", bridge="edge") == 0
    for direction, reason in (("out", "queue_full"), ("out", "expired"), ("out", "outside_prefix"),
                              ("in", "outside_prefix"), ("in", "refused_locally")):
        assert value(samples, "shardgate_bridge_dropped_total", bridge="edge",
                     direction=direction, reason=reason) == 0
    assert value(samples, "shardgate_bridge_connects_total", bridge="edge") == 1
