"""What a client that has not logged in can cost, with raw sockets: the same time for an unknown
user as for a known one without a password (no user enumeration), a CONNECT timeout that runs
from accept (a trickled CONNECT does not restart it), a small first packet before login, and an
AMQP handshake that stalls after tune-ok closed after the handshake timeout."""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pamqp import commands, frame
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode

from shardgate.security.auth import User, hash_password, install_security, save_users
from tests.conftest import ThreadedBroker, free_port


def closed_within(sock: socket.socket, seconds: float, feed: Callable[[], None] | None = None) -> float | None:
    """Seconds until the server closes `sock` (None: still open after `seconds`); `feed` is
    called about once a second meanwhile (to trickle bytes)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        sock.settimeout(1.0)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            if feed is not None:
                try:
                    feed()
                except OSError:
                    return time.monotonic() - start
            continue
        except OSError:
            return time.monotonic() - start
        if not data:
            return time.monotonic() - start
    return None


@pytest.fixture
def broker(broker_factory: Callable[..., ThreadedBroker]) -> ThreadedBroker:
    started = broker_factory(listeners={"amqp_port": free_port()}, amqp={"handshake_timeout": 2.0})
    data_dir: Path = started.config.data_dir
    save_users(data_dir / "users.json", {"alice": User("alice", hash_password("alice-pw"))})
    started.call(lambda: install_security(started.app))
    return started


def connack_time(port: int, username: str, password: bytes | None, source: str) -> float:
    with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as sock:
        start = time.monotonic()
        sock.sendall(encode(p.Connect("MQTT", 4, True, 60, "enum", None, username, password), 4))
        data = sock.recv(4)
        assert len(data) == 4 and data[3] != 0, data
        return time.monotonic() - start


def test_known_user_without_password_takes_as_long_as_an_unknown_user(broker: ThreadedBroker) -> None:
    port = broker.mqtt_port
    # Each first attempt from a fresh source address: no failure delay in the way.
    known = [connack_time(port, "alice", None, f"127.0.1.{n}") for n in range(1, 4)]
    unknown = [connack_time(port, "mallory", b"x", f"127.0.2.{n}") for n in range(1, 4)]
    assert statistics.median(known) > 0.3 * statistics.median(unknown), (known, unknown)


def test_trickled_connect_is_closed_by_the_timeout_from_accept(broker: ThreadedBroker) -> None:
    connect = encode(p.Connect("MQTT", 4, True, 60, "trickle-" + "x" * 40, None, "alice", b"alice-pw"), 4)
    sent = 0
    with socket.create_connection(("127.0.0.1", broker.mqtt_port), timeout=30) as sock:

        def one_byte() -> None:
            nonlocal sent
            if sent < len(connect) - 1:  # never the last byte
                sock.sendall(connect[sent:sent + 1])
                sent += 1

        one_byte()
        # CONNECT_TIMEOUT_S is 10 s; the CONNECT would take about 50 s at a byte a second.
        elapsed = closed_within(sock, 25, one_byte)
    assert elapsed is not None and elapsed < 16, elapsed


def test_large_first_packet_is_refused_before_login(broker: ThreadedBroker) -> None:
    with socket.create_connection(("127.0.0.1", broker.mqtt_port), timeout=30) as sock:
        # A CONNECT announcing 512 KiB (under max_packet_size, over the unauthenticated limit).
        remaining = 512 * 1024
        length = bytearray()
        while True:
            byte, remaining = remaining % 128, remaining // 128
            length.append(byte | (0x80 if remaining else 0))
            if not remaining:
                break
        sock.sendall(bytes([0x10]) + bytes(length) + b"\x00\x04MQTT\x04\x02\x00\x3c")
        elapsed = closed_within(sock, 6)
    assert elapsed is not None, "a half-sent 512 KiB CONNECT is still held"


def test_amqp_handshake_stalled_after_tune_ok_is_closed(broker: ThreadedBroker) -> None:
    with socket.create_connection(("127.0.0.1", broker.app.port("amqp")), timeout=30) as sock:
        sock.sendall(b"AMQP\x00\x00\x09\x01")
        sock.settimeout(10)
        sock.recv(65536)  # connection.start
        sock.sendall(frame.marshal(commands.Connection.StartOk(
            client_properties={}, mechanism="PLAIN", response="\x00alice\x00alice-pw", locale="en_US"), 0))
        received = b""
        while b"\x00\x0a\x00\x1e" not in received:  # connection.tune (class 10, method 30)
            chunk = sock.recv(65536)
            assert chunk, "closed before connection.tune"
            received += chunk
        sock.sendall(frame.marshal(commands.Connection.TuneOk(channel_max=0, frame_max=131072, heartbeat=0), 0))
        # No connection.open: the handshake timeout (2 s here) closes the socket.
        elapsed = closed_within(sock, 12)
    assert elapsed is not None, "an AMQP handshake stalled after tune-ok is never closed"
