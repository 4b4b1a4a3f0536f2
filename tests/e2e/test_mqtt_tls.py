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


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate for CN=alice."""
    files = {name: tmp_path / name for name in (
        "ca.crt", "ca.key", "server.crt", "server.key", "server.csr", "alice.crt", "alice.key", "alice.csr",
        "ext.cnf",
    )}
    files["ext.cnf"].write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(files["ca.key"]),
             "-out", str(files["ca.crt"]), "-days", "1", "-subj", "/CN=test-ca")
    for name, subject in (("server", "/CN=localhost"), ("alice", "/CN=alice")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(files[f"{name}.key"]),
                 "-out", str(files[f"{name}.csr"]), "-subj", subject)
        extra = ["-extfile", str(files["ext.cnf"])] if name == "server" else []
        _openssl("x509", "-req", "-in", str(files[f"{name}.csr"]), "-CA", str(files["ca.crt"]),
                 "-CAkey", str(files["ca.key"]), "-CAcreateserial", "-out", str(files[f"{name}.crt"]),
                 "-days", "1", *extra)
    return files


def test_client_certificate_identity_is_the_user_name(broker_factory, pki):
    from shardgate.security.auth import User, hash_password, install_security, save_users

    broker = broker_factory(
        listeners={"mqtts_port": free_port()},
        tls={"cert_file": str(pki["server.crt"]), "key_file": str(pki["server.key"]),
             "ca_file": str(pki["ca.crt"]), "use_identity_as_username": True},
    )
    data_dir = broker.config.data_dir
    save_users(data_dir / "users.json", {"bob": User("bob", hash_password("bob-pw"))})
    (data_dir / "acl.toml").write_text(
        '[[allow]]\nactions = ["publish", "subscribe"]\ntopics = ["devices/%u/#"]\n'
    )
    broker.call(lambda: install_security(broker.app))
    port = broker.app.port("mqtts")
    server_only = {"ca_certs": str(pki["ca.crt"]), "cert_reqs": ssl.CERT_REQUIRED}

    # No certificate and no password: refused, as everywhere once users exist.
    anonymous = Paho(port, "anon", V5, tls=server_only, connect=False)
    _, code, _ = anonymous.connect()
    assert code.value == 0x87
    # A password still works on the same listener for clients without a certificate.
    bob = Paho(port, "bob", V5, tls=server_only, username="bob", password="bob-pw")
    assert [c.value for c in bob.subscribe([("devices/bob/#", 1), ("devices/alice/#", 1)])] == [1, 0x87]
    # The certificate names the user: no password, and the ACL's %u is "alice".
    alice = Paho(port, "alice-device", V311, tls={
        **server_only, "certfile": str(pki["alice.crt"]), "keyfile": str(pki["alice.key"]),
    })
    assert [getattr(c, "value", c) for c in alice.subscribe([("devices/alice/#", 1), ("devices/bob/#", 1)])] \
        == [1, 0x80]
    assert broker.call(lambda: sorted(
        c.username for c in broker.app.mqtt.connections if c.username is not None
    )) == ["alice", "bob"]
