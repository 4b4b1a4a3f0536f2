"""TLS on the cluster port (`shardgate/cluster/link_tls.py`, issue 26 item 12): with
`[cluster] tls_cert_file / tls_key_file / tls_ca_file`, two `shardgate serve --cluster` nodes on
a real etcd link, forward messages and make their internal gRPC calls over TLS with
certificates of a CA this test makes; the port speaks nothing in the clear, and refuses a
client without a certificate of that CA (mutual verification)."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.e2e.test_cluster_link_auth import Cluster, cluster_address, talk
from tests.mqtt_clients import V5, V311, Paho


def _name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])


def make_ca(directory: Path, name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    path = directory / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, path


def make_node_cert(directory: Path, name: str, ca_key: ec.EllipticCurvePrivateKey,
                   ca_cert: x509.Certificate) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    directory = tmp_path / "pki"
    directory.mkdir()
    ca_key, ca_cert, ca_path = make_ca(directory, "cluster-ca")
    node_cert, node_key = make_node_cert(directory, "node", ca_key, ca_cert)
    rogue_key, rogue_cert, _rogue_ca = make_ca(directory, "rogue-ca")
    rogue_node_cert, rogue_node_key = make_node_cert(directory, "rogue", rogue_key, rogue_cert)
    return {"ca": ca_path, "cert": node_cert, "key": node_key,
            "rogue_cert": rogue_node_cert, "rogue_key": rogue_node_key}


def handshake(address: tuple[str, int], ca: Path, cert: Path | None = None,
              key: Path | None = None) -> bool:
    """Whether a TLS handshake with the cluster port succeeds with this client certificate."""
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    with socket.create_connection(address, timeout=10) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                # TLS 1.3: the server checks the client's certificate after the client's
                # handshake ends; its refusal arrives at the first read
                sock.sendall(b"SGLINK2\n")
                sock.settimeout(3)
                return sock.recv(1) != b""  # closed at once: refused
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
            return False
        except TimeoutError:
            return True  # the node waits for the rest of the hello: the handshake passed


@pytest.mark.timeout(300)
def test_two_nodes_talk_over_mutual_tls_and_the_port_refuses_clear_text_and_strangers(
        cluster: Cluster, pki: dict[str, Path]) -> None:
    n1, n2 = cluster(2, extra_config=(f'tls_cert_file = "{pki["cert"]}"\n'
                                      f'tls_key_file = "{pki["key"]}"\n'
                                      f'tls_ca_file = "{pki["ca"]}"\n'))
    # the data path over the TLS links: a publish on n2 reaches a subscriber on n1
    subscriber = Paho(n1.mqtt_port, "watcher", V311)
    subscriber.subscribe("tls/#", qos=1)
    publisher = Paho(n2.mqtt_port, "publisher", V311)
    publisher.publish("tls/x", b"across", qos=1)
    assert subscriber.expect(timeout=30).payload == b"across"
    # an internal gRPC call over TLS: a persistent session taken over from the other node
    # (taken over, the first client stays away: paho would connect it again after a second
    # and take the session back while the CONNECT on n2 may still wait for it)
    roamer = Paho(n1.mqtt_port, "roamer", V5, clean=False, session_expiry=3600, reconnect=False)
    roamer.subscribe("roam/#", qos=1)
    moved = Paho(n2.mqtt_port, "roamer", V5, clean=False, session_expiry=3600, connect=False)
    flags, rc, _props = moved.connect()
    assert rc == 0 and flags.session_present
    publisher.publish("roam/1", b"to the moved session", qos=1)
    assert moved.expect(timeout=30).payload == b"to the moved session"
    for client in (subscriber, publisher, moved):
        client.disconnect()

    address = cluster_address(n1)
    # nothing in the clear: a stranger's link hello gets no link answer
    assert b"SGLINK" not in talk(address, b"SGLINK2\n" + b"\x00" * 64)
    # mutual: a certificate of the cluster CA passes, none or another CA's does not
    assert handshake(address, pki["ca"], pki["cert"], pki["key"])
    assert not handshake(address, pki["ca"])
    assert not handshake(address, pki["ca"], pki["rogue_cert"], pki["rogue_key"])
    for node in (n1, n2):
        log = node.log_path.read_text(errors="replace")
        assert "Traceback" not in log


def test_a_node_with_only_part_of_the_tls_settings_refuses_to_start(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from tests.conftest import free_port

    config = tmp_path / "c.toml"
    config.write_text('[cluster]\nsecret = "a-cluster-secret-of-32-characters"\n'
                      f'tls_cert_file = "{tmp_path / "node.crt"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    result = subprocess.run(
        [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(tmp_path / "d"),
         "--config", str(config), "--cluster", f"http://127.0.0.1:{free_port()}", "--node-id", "n1",
         "--mqtt-port", "0", "--mqtt-ws-port", "0", "--amqp-port", "0", "--grpc-port", "0",
         "--http-port", "0"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode != 0
    assert "tls_key_file, tls_ca_file not set" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
