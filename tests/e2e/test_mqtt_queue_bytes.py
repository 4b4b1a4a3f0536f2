"""An MQTT session's queue is bounded in bytes as well as in messages (`mqtt.max_queued_bytes`,
as mosquitto's): a subscriber that is offline, or online and not reading, holds at most that
much; what finds the queue full is dropped, counted under the reason "queue_bytes" in
`shardgate_messages_dropped_by_reason_total` and logged a few times, not once per message
(issue 26, item 10)."""

from __future__ import annotations

import logging

import pytest
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode

from tests.conftest import free_port, serve_admin
from tests.e2e.test_metrics import scrape, value
from tests.mqtt_clients import V311, Paho, RawClient

KIB = 1024
DROPPED = "shardgate_messages_dropped_by_reason_total"


def queue_full_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "queue full" in r.getMessage()]


def test_an_offline_session_queues_up_to_max_queued_bytes(broker_factory, caplog) -> None:
    caplog.set_level(logging.WARNING)
    broker = broker_factory(mqtt={"max_queued_bytes": 4 * 512 * KIB},
                            listeners={"http_port": free_port()},
                            default_stream_mode="non-reliable")
    away = Paho(broker.mqtt_port, "away", V311, clean=False)
    away.subscribe("big/#", 1)
    away.disconnect()
    publisher = Paho(broker.mqtt_port, "pub", V311)
    for index in range(20):
        publisher.publish(f"big/{index}", bytes([index]) * (512 * KIB), 1)
    back = Paho(broker.mqtt_port, "away", V311, clean=False)
    # the queue took messages while under its 2 MiB, the first 4; the other 16 were dropped
    assert [m.payload[:1] for m in back.expect_n(4)] == [bytes([i]) for i in range(4)]
    back.expect_none()
    for url in serve_admin(broker):
        _, samples = scrape(url)
        assert value(samples, DROPPED, reason="queue_bytes") == 16
    lines = queue_full_lines(caplog)
    assert 1 <= len(lines) <= 2, lines  # rate-limited
    assert "'away'" in lines[0] and "max_queued_bytes" in lines[0]


def test_a_subscriber_that_stops_reading_holds_at_most_max_queued_bytes(
        broker_factory, monkeypatch) -> None:
    from shardgate.protocols.mqtt import service

    monkeypatch.setattr(service, "CONGESTION_GIVE_UP_S", 0.2)
    broker = broker_factory(mqtt={"max_inflight": 2, "max_queued_bytes": 1024 * KIB},
                            default_stream_mode="non-reliable")
    dead = RawClient(broker.mqtt_port, 4)
    dead.connect("dead")
    dead.send(p.Subscribe(1, [p.SubscriptionRequest("work", 1)]))
    assert isinstance(dead.receive(), p.Suback)
    publisher = RawClient(broker.mqtt_port, 4)
    publisher.connect("pub")
    payload = bytes(256 * KIB)
    for index in range(40):
        publisher.send(encode(p.Publish("work", payload, 1, packet_id=index + 1), 4))
    # every publish is acknowledged in the end (held for a while, then no longer)
    acks = [publisher.receive() for _ in range(40)]
    assert sorted(a.packet_id for a in acks) == list(range(1, 41))

    def session_bytes() -> tuple[int, int]:
        session = broker.app.mqtt.sessions["dead"]
        return session.queued_bytes, broker.app.broker.stats.dropped_by_reason["queue_bytes"]

    queued, dropped = broker.call(session_bytes)
    assert queued <= 1024 * KIB and dropped > 0
