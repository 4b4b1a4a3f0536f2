"""Reliable streams through MQTT: delayed delivery that survives a restart, schemas, offline
sessions kept as cursors rather than copies, and a failing disk turned into a clear error."""

from __future__ import annotations

import errno
import time
from pathlib import Path

from tests.mqtt_clients import V5, V311, Paho, RawClient


def test_delayed_publish_is_held_then_delivered(broker):
    sub = Paho(broker.mqtt_port, "sub")
    sub.subscribe("later/#", 1)
    pub = Paho(broker.mqtt_port, "pub")
    started = time.monotonic()
    pub.publish("$delayed/1/later/x", "wait for it", 1)
    pub.publish("later/now", "immediate", 1)
    assert sub.expect().payload == b"immediate"
    message = sub.expect(timeout=5)
    assert (message.topic, message.payload) == ("later/x", b"wait for it")
    assert time.monotonic() - started >= 0.9


def test_delayed_message_survives_restart(broker_process, tmp_path: Path):
    broker = broker_process().start()
    port = broker.mqtt_port
    sub = Paho(port, "sleeper", V5, clean=False, session_expiry=600)
    sub.subscribe("wake/#", 1)
    sub.disconnect()
    pub = Paho(port, "pub", V311)
    pub.publish("$delayed/2/wake/up", "after restart", 1)
    pub.disconnect()
    broker.kill()
    broker.start(mqtt_port=port)
    back = Paho(port, "sleeper", V5, clean=False, session_expiry=600)
    assert back.expect(timeout=10).payload == b"after restart"


def test_stream_schema_refuses_bad_payload_over_mqtt5(broker_factory):
    from shardgate.config import StreamEntry

    broker = broker_factory(streams=[StreamEntry("readings", schema="json", routes=["readings/#"])])
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("schema")
    from shardgate.protocols.mqtt import packets as p

    raw.send(p.Publish("readings/t1", b'{"t": 21.5}', 1, packet_id=1))
    assert raw.receive().reason_code == 0
    raw.send(p.Publish("readings/t1", b"not json", 1, packet_id=2))
    ack = raw.receive()
    assert ack.reason_code == 0x99 and "JSON" in ack.properties.reason_string


# Ten times the offline queue's cap: on a reliable stream an offline session holds a cursor, so
# nothing beyond the cap is lost or copied.
OFFLINE_QUEUE_CAP = 100
OFFLINE_BACKLOG = 10 * OFFLINE_QUEUE_CAP


def test_offline_sessions_hold_cursors_not_copies(broker_factory):
    broker = broker_factory(mqtt={"max_queued_messages": OFFLINE_QUEUE_CAP})
    sessions = [Paho(broker.mqtt_port, f"offline-{i}", V5, clean=False, session_expiry=600) for i in range(20)]
    for session in sessions:
        session.subscribe("bulk/#", 1)
        session.disconnect()
    pub = Paho(broker.mqtt_port, "pub", V311)
    for index in range(OFFLINE_BACKLOG):
        pub.publish("bulk/x", str(index), 1 if index % 100 == 0 else 0, wait=index % 100 == 0)
    pub.publish("bulk/x", "last", 1)

    def per_session_state() -> list[tuple[int, int, int]]:
        return [
            (len(s.queue), len(s.inflight), s.subscription.inflight_count())
            for s in broker.app.mqtt.sessions.values() if s.client_id.startswith("offline-")
        ]

    state = broker.call(per_session_state)
    assert len(state) == 20 and all(entry == (0, 0, 0) for entry in state)
    back = Paho(broker.mqtt_port, "offline-7", V5, clean=False, session_expiry=600)
    received = [back.expect().payload for _ in range(OFFLINE_BACKLOG + 1)]
    assert received[0] == b"0" and received[-1] == b"last"


def test_journal_write_error_is_reported_and_broker_keeps_serving(broker, monkeypatch):
    import shardgate.storage.journal.log as journal_log
    from shardgate.protocols.mqtt import packets as p

    sub = Paho(broker.mqtt_port, "reader", V311)
    sub.subscribe("disk/#", 1)
    raw5 = RawClient(broker.mqtt_port, 5)
    raw5.connect("v5-writer")
    raw3 = RawClient(broker.mqtt_port, 4)
    raw3.connect("v3-writer")

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(journal_log, "write_all", disk_full)
        patch.setattr(journal_log, "write_durably", disk_full)  # write + fsync in one call
        raw5.send(p.Publish("disk/full", b"refused", 1, packet_id=1))
        ack = raw5.receive()
        assert isinstance(ack, p.Puback) and ack.reason_code >= 0x80  # never acknowledged as stored
        raw3.send(p.Publish("disk/full", b"refused too", 1, packet_id=1))
        assert raw3.receive_until_closed() == []  # 3.1.1 has no error code: the connection closes
    pub = Paho(broker.mqtt_port, "writer-after", V311)
    pub.publish("disk/ok", "stored", 1)
    payloads = []
    while b"stored" not in payloads:
        payloads.append(sub.expect().payload)
