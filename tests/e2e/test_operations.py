"""What an operator meets on day one, through the real command and sockets: `--version`, the
JSON log (ISO 8601 `ts`, structured fields), a log line for every client that connects or
leaves (MQTT, AMQP, gRPC), and the `/healthz` and `/readyz` probes of the admin port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pika
from shardgate.client import SyncClient

from shardgate import __version__
from tests.conftest import BrokerProcess, free_port, wait_for
from tests.mqtt_clients import V5, Paho


def test_version_flag_prints_the_version_and_exits_zero() -> None:
    done = subprocess.run([sys.executable, "-m", "shardgate", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"shardgate {__version__}"


def _json_lines(path: Path) -> list[dict[str, Any]]:
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_json_log_has_iso_timestamps_and_logs_each_client_arriving_and_leaving(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path,
) -> None:
    config = tmp_path / "shardgate.toml"
    config.write_text("log_json = true\n")
    amqp_port, grpc_port = free_port(), free_port()
    node = broker_process(config_file=config, extra_args=[
        "--amqp-port", str(amqp_port), "--grpc-port", str(grpc_port)]).start()

    mqtt = Paho(node.mqtt_port, "sensor-7", V5)
    mqtt.disconnect()
    dropped = Paho(node.mqtt_port, "sensor-8", V5)
    dropped.drop()
    amqp = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", amqp_port))
    amqp.close()
    with SyncClient(f"127.0.0.1:{grpc_port}") as client:
        producer = client.producer("meter")
        producer.send("t/x", b"1")
        producer.close()

    def events() -> list[dict[str, Any]]:
        return [line for line in _json_lines(node.log_path)
                if line.get("event") in ("client_connected", "client_disconnected")]

    def seen(event: str, protocol: str, **fields: str) -> dict[str, Any] | None:
        for line in events():
            if line["event"] == event and line["protocol"] == protocol and all(
                    line.get(k) == v for k, v in fields.items()):
                return line
        return None

    wait_for(lambda: seen("client_disconnected", "mqtt", client_id="sensor-7")
             and seen("client_disconnected", "mqtt", client_id="sensor-8")
             and seen("client_disconnected", "amqp") and seen("client_disconnected", "grpc"),
             timeout=30)
    assert node.terminate() == 0
    connected = seen("client_connected", "mqtt", client_id="sensor-7")
    assert connected is not None and connected["level"] == "info"
    assert connected["peer"].startswith("127.0.0.1:")
    assert seen("client_disconnected", "mqtt", client_id="sensor-7")["reason"] == "client sent DISCONNECT"
    assert seen("client_disconnected", "mqtt", client_id="sensor-8")["reason"] == "connection lost"
    assert seen("client_connected", "amqp") is not None
    assert seen("client_disconnected", "amqp")["reason"] == "client sent connection.close"
    assert seen("client_connected", "grpc") is not None
    for line in _json_lines(node.log_path):
        stamp = datetime.fromisoformat(line["ts"].replace("Z", "+00:00"))  # ISO 8601, UTC
        assert stamp.utcoffset() is not None and stamp.utcoffset().total_seconds() == 0


def test_healthz_and_readyz_answer_on_the_admin_port(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    http_port = free_port()
    node = broker_process(extra_args=["--http-port", str(http_port)]).start()
    base = f"http://127.0.0.1:{http_port}"
    assert _get(f"{base}/healthz") == (200, {"status": "ok"})
    status, body = _get(f"{base}/readyz")
    assert status == 200 and body["ready"] is True, body
    assert set(body["checks"]) == {"started", "listeners", "journal"}
    # a journal directory the broker cannot write in: not ready, and the check says why
    probe = node.data_dir / "journal" / ".readyz-probe"
    probe.mkdir()
    (probe / "in-the-way").write_text("")
    status, body = _get(f"{base}/readyz")
    assert status == 503 and body["ready"] is False
    assert body["checks"]["journal"]["ok"] is False and "cannot write" in body["checks"]["journal"]["detail"]
    assert _get(f"{base}/healthz")[0] == 200  # alive all the same
    (probe / "in-the-way").unlink()
    probe.rmdir()
    assert _get(f"{base}/readyz")[0] == 200
    assert node.terminate() == 0


def _shardgate(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    return subprocess.run([sys.executable, "-m", "shardgate", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=env)


def test_config_check_and_serve_refuse_a_setting_out_of_range_naming_file_and_range(
    tmp_path: Path,
) -> None:
    config = tmp_path / "shardgate.toml"
    config.write_text("[archive]\nmax_delay_s = -5\n")
    for args in (["config", "check", str(config)],
                 ["serve", "--config", str(config), "--data-dir", str(tmp_path / "data"),
                  "--mqtt-port", "0", "--mqtt-ws-port", "0", "--amqp-port", "0",
                  "--grpc-port", "0", "--http-port", "0"]):
        done = _shardgate(*args, cwd=tmp_path)
        assert done.returncode == 2, done
        assert done.stderr.strip() == (f"shardgate: {config}: archive.max_delay_s = -5 is out of "
                                       "range (allowed: at least 0)")
        assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "data").exists()  # refused before anything was created
    config.write_text('[[streams]]\nname = "sensors"\npartitions = 4\nroutes = ["sensors/#"]\n')
    done = _shardgate("config", "check", str(config), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "configuration is valid" in done.stdout
