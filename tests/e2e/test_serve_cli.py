"""`shardgate serve` as a user runs it: clear refusals of a data directory it cannot use, of a
second broker on the same data directory, of a bad configuration."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import BrokerProcess


def serve(data_dir: Path, *extra: str, env: dict[str, str] | None = None,
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(data_dir), "--mqtt-port", "0",
         "--mqtt-ws-port", "0", "--grpc-port", "0", "--http-port", "0", "--amqp-port", "0", *extra],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")} | (env or {}),
    )


def test_data_directory_from_a_newer_format_is_refused(tmp_path: Path) -> None:
    journal = tmp_path / "data" / "journal"
    journal.mkdir(parents=True)
    (journal / "journal.version").write_text("99 crc32c\n")
    result = serve(tmp_path / "data")
    assert result.returncode == 2
    assert "journal" in result.stderr and "99" in result.stderr


def test_second_broker_on_the_same_data_directory_is_refused(tmp_path: Path) -> None:
    first = BrokerProcess(tmp_path / "data").start()
    try:
        result = serve(tmp_path / "data")
        assert result.returncode == 2
        assert "already open" in result.stderr
    finally:
        assert first.terminate() == 0


def test_bad_configuration_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[mqtt]\nmax_packet_size = 'huge'\n")
    result = serve(tmp_path / "data", "--config", str(config))
    assert result.returncode == 2
    assert "mqtt.max_packet_size" in result.stderr and "integer" in result.stderr
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[mqtt]\nno_such_setting = 1\n")
    result = serve(tmp_path / "data", "--config", str(unknown))
    assert result.returncode == 2 and "no_such_setting" in result.stderr


@pytest.mark.parametrize(("text", "expected"), [
    ('[[bridges]]\nname = "cloud"\nremote = "mqtt://127.0.0.1:1"\noutt = ["a/#"]\n',
     ["[[bridges]] #1 ('cloud')", "unknown setting 'outt'", "remote, out,", "inbound"]),
    ('[[streams]]\nname = "pc"\nmode = "durable"\n',
     ["[[streams]] #1 ('pc')", "mode = 'durable'", "reliable | non-reliable"]),
    ('[[streams]]\nname = "pc"\npartitions = "many"\n', ["partitions", "integer"]),
    ('[[amqp_bridges]]\nname = "rabbit"\n', ["[[amqp_bridges]] #1 ('rabbit')", "'remote' is required"]),
    ('default_stream_mode = "durable"\n', ["default_stream_mode = 'durable'", "reliable | non-reliable"]),
    ('[journal]\nfsync = "sometimes"\n', ["journal.fsync", "always | interval | os"]),
])
def test_config_errors_name_the_setting_the_file_and_the_allowed_values(
    tmp_path: Path, text: str, expected: list[str],
) -> None:
    config = tmp_path / "shardgate.toml"
    config.write_text(text)
    result = serve(tmp_path / "data", "--config", str(config))
    assert result.returncode == 2, result.stderr
    assert str(config) in result.stderr
    for part in expected:
        assert part in result.stderr
    assert "__init__" not in result.stderr and "not a valid" not in result.stderr


def test_a_port_in_use_names_the_listener(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        listeners = (("--grpc-port", "gRPC"), ("--mqtt-port", "MQTT"), ("--http-port", "admin HTTP"))
        with ThreadPoolExecutor(len(listeners)) as pool:  # three brokers at once: one wait
            results = list(pool.map(
                lambda listener: serve(tmp_path / f"data-{listener[0][2:]}", listener[0], port),
                listeners))
        for (flag, name), result in zip(listeners, results, strict=True):
            assert result.returncode == 2, result.stderr
            assert f"cannot listen for {name} on 127.0.0.1:{port}: the port is already in use" in result.stderr
            assert flag in result.stderr
            assert "add_port.cc" not in result.stderr and "Traceback" not in result.stderr


def test_an_address_the_host_does_not_have_names_the_host_setting(tmp_path: Path) -> None:
    result = serve(tmp_path / "data", "--host", "192.0.2.1", "--mqtt-port", "18999")  # TEST-NET-1
    assert result.returncode == 2, result.stderr
    assert "cannot listen for MQTT on 192.0.2.1:18999" in result.stderr
    assert "listeners.host or --host" in result.stderr and "already in use" not in result.stderr


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_is_refused_before_anything_listens(tmp_path: Path, port: str) -> None:
    result = serve(tmp_path / "data", "--grpc-port", port)
    assert result.returncode == 2, result.stderr
    assert f"listeners.grpc_port = {port} is not a port number" in result.stderr


def test_shardgate_config_in_the_environment_names_the_configuration_file(tmp_path: Path) -> None:
    config = tmp_path / "from-env.toml"
    config.write_text('[journal]\nfsync = "sometimes"\n')
    result = serve(tmp_path / "data", env={"SHARDGATE_CONFIG": str(config)})
    assert result.returncode == 2, result.stderr
    assert f"{config}: journal.fsync = 'sometimes' is not allowed" in result.stderr


def test_a_certificate_that_cannot_be_loaded_names_the_tls_settings(tmp_path: Path) -> None:
    config = tmp_path / "tls.toml"
    config.write_text(f'[tls]\ncert_file = "{tmp_path / "missing.crt"}"\n'
                      f'key_file = "{tmp_path / "missing.key"}"\n')
    result = serve(tmp_path / "data", "--config", str(config), "--mqtts-port", "18998")
    assert result.returncode == 2, result.stderr
    assert "tls.cert_file" in result.stderr and "cannot load a certificate" in result.stderr
    assert "listeners.host" not in result.stderr and "Traceback" not in result.stderr
