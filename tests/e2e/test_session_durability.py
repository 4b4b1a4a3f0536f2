"""Session state is durable before it is acknowledged, and the fsync that makes it so runs off
the event loop.

A CONNACK that reports a persistent session, a SUBACK and the like leave only once the metadata
store's sync thread has fsynced the commit holding that state; meanwhile the broker keeps
serving other clients. A new persistent session's CONNACK reports no session (session present
0): it leaves once the session is committed, before the fsync, and everything after it waits
for that fsync. A SIGKILL right after the acknowledgement keeps what it reported."""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardgate.protocols.mqtt import packets as p

from tests.conftest import ThreadedBroker, wait_for
from tests.mqtt_clients import V5, V311, Paho, RawClient


def _committed(db_path: Path, sql: str) -> bool:
    """What another SQLite connection sees: committed (not necessarily fsynced yet)."""
    other = sqlite3.connect(db_path)
    try:
        return other.execute(sql).fetchone() is not None
    finally:
        other.close()


@contextmanager
def _fsync_held(broker: ThreadedBroker) -> Iterator[None]:
    """The metadata store's sync thread cannot finish an fsync inside the block."""
    store = broker.app.metadata
    assert store is not None and store._syncer is not None
    syncer = store._syncer
    released = threading.Event()

    def held_fsync(fd: int) -> None:
        released.wait(30)
        os.fsync(fd)

    syncer.fsync_file = held_fsync
    try:
        yield
    finally:
        released.set()
        syncer.fsync_file = os.fsync


def _nothing_received(client: RawClient) -> bool:
    timeout = client.sock.gettimeout()
    client.sock.setblocking(False)
    try:
        data = client.sock.recv(65536)
    except BlockingIOError:
        return True
    finally:
        client.sock.settimeout(timeout)
    client.pending.extend(client.parser.feed(data))
    return False


def test_a_new_sessions_connack_leaves_before_the_fsync_and_what_follows_waits_for_it(
    broker: ThreadedBroker,
) -> None:
    assert broker.app.metadata is not None
    db_path = broker.app.metadata.path
    client = RawClient(broker.mqtt_port, version=5)
    with _fsync_held(broker):
        client.send(p.Connect("MQTT", 5, False, 60, "held",
                              properties=p.Properties(session_expiry_interval=3600)))
        connack = client.receive()
        assert isinstance(connack, p.Connack) and connack.reason_code == 0
        assert not connack.session_present
        # Committed before the CONNACK was written (a crash of the process keeps it) ...
        assert _committed(db_path, "SELECT 1 FROM sessions WHERE client_id = 'held'")
        # ... but not fsynced: an acknowledgement after the CONNACK waits for that fsync, even
        # one that depends on no session state (a QoS 1 PUBACK waits for the journal only).
        client.send(p.Publish("plain/x", b"m", qos=1, packet_id=7))
        wait_for(lambda: broker.app.journal.stats.records >= 1)  # in the journal, fsynced
        for _ in range(3):
            broker.call(lambda: None)  # the turns that acknowledge it have flushed their output
        assert _nothing_received(client), "PUBACK sent before the session was durable"
        # The event loop is not waiting for that fsync: another client is served meanwhile.
        other = Paho(broker.mqtt_port, "other", V311)
        other.subscribe("free/#", 0)
        other.publish("free/x", "served", 0)
        assert other.expect().payload == b"served"
        other.disconnect()
    puback = client.receive()
    assert isinstance(puback, p.Puback) and puback.packet_id == 7

    with _fsync_held(broker):
        client.send(p.Subscribe(1, [p.SubscriptionRequest("kept/#", 1)]))
        wait_for(lambda: _committed(
            db_path, "SELECT 1 FROM sessions WHERE client_id = 'held' AND CAST(data AS TEXT) LIKE '%kept/#%'"))
        broker.call(lambda: None)
        assert _nothing_received(client), "SUBACK sent before the subscription was durable"
    suback = client.receive()
    assert isinstance(suback, p.Suback) and list(suback.reason_codes) == [1]
    client.close()


def test_a_resumed_session_is_not_held_for_the_fsync_of_its_reconnection(
    broker: ThreadedBroker,
) -> None:
    """A resumed session is durable already: its CONNACK (session present) does not wait for
    the commit of what the reconnection wrote (its expiry, no longer disconnected), while a
    new persistent session's CONNACK does."""
    first = Paho(broker.mqtt_port, "resumer", V5, clean=False, session_expiry=3600)
    first.subscribe("resumed/#", 1)
    first.disconnect()
    assert broker.app.metadata is not None
    db_path = broker.app.metadata.path
    with _fsync_held(broker):
        back = RawClient(broker.mqtt_port, version=5)
        back.send(p.Connect("MQTT", 5, False, 60, "resumer",
                            properties=p.Properties(session_expiry_interval=7200)))
        connack = back.receive()
        assert isinstance(connack, p.Connack) and connack.reason_code == 0
        assert connack.session_present
        # ... nor a new persistent session's (session present 0), committed before it; its
        # SUBACK waits for the fsync.
        fresh = RawClient(broker.mqtt_port, version=5)
        fresh.send(p.Connect("MQTT", 5, False, 60, "fresh",
                             properties=p.Properties(session_expiry_interval=3600)))
        connack = fresh.receive()
        assert isinstance(connack, p.Connack) and not connack.session_present
        assert _committed(db_path, "SELECT 1 FROM sessions WHERE client_id = 'fresh'")
        fresh.send(p.Subscribe(1, [p.SubscriptionRequest("fresh/#", 1)]))
        wait_for(lambda: _committed(
            db_path, "SELECT 1 FROM sessions WHERE client_id = 'fresh' AND CAST(data AS TEXT) LIKE '%fresh/#%'"))
        broker.call(lambda: None)
        assert _nothing_received(fresh), "SUBACK sent before the subscription was durable"
    suback = fresh.receive()
    assert isinstance(suback, p.Suback) and list(suback.reason_codes) == [1]
    # The resumed session works as before: its subscription delivers.
    publisher = Paho(broker.mqtt_port, "resumed-pub", V311)
    publisher.publish("resumed/x", "after resume", 1)
    delivered = back.receive()
    assert isinstance(delivered, p.Publish) and delivered.payload == b"after resume"
    for client in (back, fresh):
        client.close()
    publisher.disconnect()


def test_sigkill_right_after_connack_and_suback_keeps_the_session(broker_process) -> None:
    broker = broker_process().start()
    port = broker.mqtt_port
    first = Paho(port, "kept-v5", V5, clean=False, session_expiry=3600)
    first.subscribe("after/crash/#", 1)
    v311 = Paho(port, "kept-v311", V311, clean=False)
    broker.kill()  # at once: no disconnect, no clean stop
    first.drop()
    v311.drop()

    broker.start(mqtt_port=port)
    back = Paho(port, "kept-v5", V5, clean=False, session_expiry=3600, connect=False)
    flags, _, _ = back.connect()
    assert flags.session_present
    back_311 = Paho(port, "kept-v311", V311, clean=False, connect=False)
    flags, _, _ = back_311.connect()
    assert flags.session_present
    publisher = Paho(port, "pub", V311)
    publisher.publish("after/crash/x", "still subscribed", 1)
    assert back.expect().payload == b"still subscribed"
    for client in (back, back_311, publisher):
        client.disconnect()
