"""A flood of wrong passwords costs its sender, not the other clients (MQTT, admin HTTP, gRPC).

Passwords are hashed off the event loop, and a source address that keeps failing waits longer
and longer for each next check: a flooder from 127.0.0.1 gets few answers, while a client from
127.0.0.2 logs in promptly and a connected client's QoS 1 round trips keep their pace. A broker
`shardgate serve` with users made by `shardgate users add`.
"""

from __future__ import annotations

import base64
import http.client
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode

from tests.conftest import BrokerProcess, free_port

FLOOD_S = 8.0
FLOODERS = 6
# Without the delay a flooder gets an answer per hash (tens of milliseconds): scores of
# answers in FLOOD_S. With it, one check at a time per address, 0.25, 0.5, 1, 2, 4 s apart.
MAX_ANSWERS = 12


def add_user(data_dir: Path, name: str, password: str, *roles: str) -> None:
    role_args = [arg for role in roles for arg in ("--role", role)]
    subprocess.run([sys.executable, "-m", "shardgate", "users", "add", name, "--password", password,
                    "--data-dir", str(data_dir), *role_args], check=True, capture_output=True, timeout=60,
                   env={k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")})


@pytest.fixture
def broker(tmp_path: Path) -> BrokerProcess:
    data_dir = tmp_path / "data"
    add_user(data_dir, "alice", "alice-pw", "admin")
    add_user(data_dir, "bob", "bob-pw")
    process = BrokerProcess(data_dir, ["--grpc-port", str(free_port()), "--http-port", str(free_port())])
    process.start()
    yield process
    process.terminate()


def flood(attempt: Callable[[], None]) -> int:
    """Run `attempt` (one refused login) from FLOODERS threads for FLOOD_S; answers received."""
    answers = 0
    lock = threading.Lock()
    deadline = time.monotonic() + FLOOD_S

    def run() -> None:
        nonlocal answers
        while time.monotonic() < deadline:
            try:
                attempt()
            except (OSError, TimeoutError):
                continue
            if time.monotonic() < deadline:
                with lock:
                    answers += 1

    threads = [threading.Thread(target=run, daemon=True) for _ in range(FLOODERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return answers


def mqtt_connect(port: int, username: str, password: bytes, source: str = "127.0.0.1",
                 timeout: float = 20.0) -> int:
    """A raw MQTT 3.1.1 CONNECT from `source`; the CONNACK's return code."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0)) as sock:
        sock.sendall(encode(p.Connect("MQTT", 4, True, 60, f"c-{time.monotonic_ns()}", None, username,
                                      password), 4))
        data = b""
        while len(data) < 4:
            chunk = sock.recv(16)
            if not chunk:
                raise OSError("closed without CONNACK")
            data += chunk
        return data[3]


def round_trips(client: mqtt.Client, received: list[float], count: int) -> list[float]:
    """`count` QoS 1 publishes to the client's own subscription: seconds until each comes back."""
    times = []
    for _ in range(count):
        before = len(received)
        start = time.monotonic()
        client.publish("rt/alice", b"x", qos=1)
        deadline = start + 30
        while len(received) == before and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(received) > before, "round trip lost"
        times.append(received[-1] - start)
    return times


def test_mqtt_password_flood_is_slowed_and_others_keep_their_pace(broker: BrokerProcess) -> None:
    port = broker.mqtt_port
    received: list[float] = []
    good = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="alice-rt", protocol=mqtt.MQTTv311)
    good.username_pw_set("alice", "alice-pw")
    good.on_message = lambda c, u, m: received.append(time.monotonic())
    subscribed = threading.Event()
    good.on_subscribe = lambda *args: subscribed.set()
    good.connect("127.0.0.1", port, bind_address="127.0.0.2")
    good.loop_start()
    try:
        good.subscribe("rt/alice", 1)
        assert subscribed.wait(20)
        baseline = statistics.median(round_trips(good, received, 20))
        answers: list[int] = []
        flooding = threading.Thread(
            target=lambda: answers.append(flood(lambda: mqtt_connect(port, "alice", b"wrong") and None)),
            daemon=True)
        flooding.start()
        time.sleep(0.5)  # the flood is under way (its first hashes run now)
        during = round_trips(good, received, 20)
        start = time.monotonic()
        assert mqtt_connect(port, "bob", b"bob-pw", source="127.0.0.2") == 0
        login_s = time.monotonic() - start
        flooding.join(60)
        assert answers and answers[0] <= MAX_ANSWERS, \
            f"{answers} refusals in {FLOOD_S}s: the flood is not slowed"
        # Generous bounds (the machine is loaded): with the hashing on the event loop a round
        # trip waits for the hashes in front of it (a few hundred ms each).
        assert login_s < 5, login_s
        assert statistics.median(during) < max(5 * baseline, 0.1), (baseline, during)
    finally:
        good.loop_stop()
        good.disconnect()


def test_admin_http_basic_flood_is_slowed(broker: BrokerProcess) -> None:
    port = broker.ports["http"]

    def get(password: str, source: str = "127.0.0.1") -> int:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=20, source_address=(source, 0))
        try:
            token = base64.b64encode(f"alice:{password}".encode()).decode()
            connection.request("GET", "/api/info", headers={"Authorization": f"Basic {token}"})
            return connection.getresponse().status
        finally:
            connection.close()

    def attempt() -> None:
        assert get("wrong") == 401

    answers = flood(attempt)
    assert answers <= MAX_ANSWERS, f"{answers} refusals in {FLOOD_S}s: the flood is not slowed"
    assert get("alice-pw", source="127.0.0.2") == 200


def test_grpc_password_flood_is_slowed(broker: BrokerProcess) -> None:
    from shardgate.client import ShardgateError, SyncClient, Unauthenticated

    url = f"127.0.0.1:{broker.ports['grpc']}"

    def attempt() -> None:
        client = SyncClient(url, username="alice", password="wrong")
        try:
            client.producer().publish("x/y", b"1")
        except Unauthenticated:
            return
        except ShardgateError as exc:
            if "DEADLINE_EXCEEDED" in str(exc):
                raise TimeoutError(str(exc)) from None  # held back by the delay: no answer
            raise
        finally:
            client.close()
        raise AssertionError("a wrong password was accepted")

    answers = flood(attempt)
    assert answers <= MAX_ANSWERS, f"{answers} refusals in {FLOOD_S}s: the flood is not slowed"


# 0.25 + 0.5 + 1 + 2 + 4 s, then 5 s each: the default delay makes these many wrong passwords in
# a row from one address take over 100 s; without it each is one hash (well under 1 s each even
# on a loaded machine)
IN_A_ROW = 24
IN_A_ROW_WAIT_S = 60.0


def test_the_delay_is_the_auth_login_delay_setting_and_zero_turns_it_off(tmp_path: Path) -> None:
    """`[auth] login_delay_s = 0` and `login_max_delay_s = 0`: wrong passwords from one address
    are answered one after another without the growing wait (what tests that knock with wrong
    passwords set), and the right one is still let in."""
    data_dir = tmp_path / "data"
    add_user(data_dir, "alice", "alice-pw")
    config = tmp_path / "shardgate.toml"
    config.write_text("[auth]\nlogin_delay_s = 0\nlogin_max_delay_s = 0\n")
    process = BrokerProcess(data_dir, config_file=config).start()
    try:
        refused = 0
        deadline = time.monotonic() + IN_A_ROW_WAIT_S
        while refused < IN_A_ROW and time.monotonic() < deadline:
            code = mqtt_connect(process.mqtt_port, "alice", b"wrong", timeout=IN_A_ROW_WAIT_S)
            assert code == p.ConnackCode311.BAD_USERNAME_OR_PASSWORD, code
            refused += 1
        assert refused == IN_A_ROW, f"{refused} wrong passwords answered in {IN_A_ROW_WAIT_S} s"
        assert mqtt_connect(process.mqtt_port, "alice", b"alice-pw") == 0
    finally:
        process.terminate()
