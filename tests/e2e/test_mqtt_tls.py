"""MQTT over TLS and secure WebSocket with a certificate from the configuration."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.mqtt_clients import V5, V311, Paho


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


def test_tls_and_secure_websocket_listeners(broker_factory, certificate):
    cert, key = certificate
    broker = broker_factory(
        listeners={"mqtts_port": free_port(), "mqtt_wss_port": free_port()},
        tls={"cert_file": str(cert), "key_file": str(key)},
    )
    tls = {"ca_certs": str(cert), "cert_reqs": ssl.CERT_REQUIRED}
    secure = Paho(broker.app.port("mqtts"), "tls-client", V311, tls=tls)
    secure.subscribe("secure/#", 1)
    web = Paho(broker.app.port("mqtt-wss"), "wss-client", V5, transport="websockets", tls=tls)
    web.publish("secure/x", "encrypted", 1)
    assert secure.expect().payload == b"encrypted"
    plain = Paho(broker.mqtt_port, "plain", V311)
    plain.publish("secure/y", "mixed", 1)
    assert secure.expect().payload == b"mixed"


def test_tls_listener_without_certificate_is_a_clear_error(tmp_path):
    from shardgate.app import Shardgate
    from shardgate.config import ConfigError
    from tests.conftest import make_config

    config = make_config(tmp_path / "d", listeners={"mqtts_port": free_port()})
    import asyncio

    async def start() -> None:
        app = Shardgate(config)
        try:
            await app.start()
        finally:
            await app.stop()

    with pytest.raises(ConfigError, match="cert_file"):
        asyncio.run(start())
