"""`tls.require_client_cert = true` without `tls.ca_file` is refused at start on every TLS
listener (MQTTS, WSS, AMQPS, gRPCS): without a CA nothing could verify a client certificate,
and the listener would accept clients with none."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.e2e.test_serve_cli import serve


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "server.crt", folder / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


@pytest.mark.parametrize("listener", ["mqtts_port", "mqtt_wss_port", "amqps_port", "grpcs_port"])
def test_required_client_certificate_without_a_ca_refuses_to_start(
    tmp_path: Path, certificate: tuple[Path, Path], listener: str,
) -> None:
    cert, key = certificate
    config = tmp_path / "shardgate.toml"
    config.write_text(
        f"[listeners]\n{listener} = {free_port()}\n"
        f'[tls]\ncert_file = "{cert}"\nkey_file = "{key}"\nrequire_client_cert = true\n'
    )
    result = serve(tmp_path / "data", "--config", str(config))
    assert result.returncode == 2, result.stderr
    assert "tls.require_client_cert" in result.stderr and "tls.ca_file" in result.stderr
    assert "Traceback" not in result.stderr
