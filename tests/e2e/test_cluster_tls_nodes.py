"""Cluster-port TLS with a certificate per node (issue 26, item 12): each node listens on its own
address (127.0.0.2 and 127.0.0.3, both loopback) and holds a certificate of the cluster CA whose
subject alternative name is that address alone, as a deployment gives each host its own name.
Each dialing node checks that the peer's certificate names the address the peer advertised, on
the peer links and on the internal gRPC calls, so the nodes link, forward and hand a persistent
session over; a certificate naming another node is refused; and after a node is killed and
started again (same address, same certificate) the links come back over TLS and carry
messages both ways. Real etcd, `shardgate serve --cluster` processes, the CA and certificates
made with the openssl commands of docs/OPERATIONS.md."""

from __future__ import annotations

import queue
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer, linked, settled
from tests.e2e.test_cluster_link_auth import cluster_address
from tests.mqtt_clients import V5, V311, Paho

HOSTS = {"n1": "127.0.0.2", "n2": "127.0.0.3"}


def loopback_alias_usable() -> bool:
    try:
        with socket.socket() as sock:
            sock.bind((HOSTS["n1"], 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not loopback_alias_usable(),
                                reason="127.0.0.2 cannot be bound here (not Linux loopback)")


def openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def node_pki(tmp_path: Path) -> dict[str, Path]:
    """The cluster CA and one certificate per node, made with the openssl commands
    docs/OPERATIONS.md gives."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    directory = tmp_path / "pki"
    directory.mkdir()
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl("req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.crt",
            "-subj", "/CN=shardgate-cluster-ca", "-days", "3650", cwd=directory)
    files = {"ca": directory / "ca.crt"}
    for node_id, host in HOSTS.items():
        openssl("req", "-new", *curve, "-keyout", f"{node_id}.key", "-out", f"{node_id}.csr",
                "-subj", f"/CN={node_id}", cwd=directory)
        (directory / f"{node_id}.ext").write_text(f"subjectAltName = IP:{host}\n")
        openssl("x509", "-req", "-in", f"{node_id}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "825", "-extfile", f"{node_id}.ext",
                "-out", f"{node_id}.crt", cwd=directory)
        files[f"{node_id}-cert"] = directory / f"{node_id}.crt"
        files[f"{node_id}-key"] = directory / f"{node_id}.key"
    return files


def tls_node(tmp_path: Path, etcd: EtcdServer, node_id: str, pki: dict[str, Path],
             cert_of: str | None = None) -> ClusterNodeProcess:
    cert_of = cert_of or node_id
    config = (f'tls_cert_file = "{pki[cert_of + "-cert"]}"\n'
              f'tls_key_file = "{pki[cert_of + "-key"]}"\n'
              f'tls_ca_file = "{pki["ca"]}"\n')
    return ClusterNodeProcess(tmp_path / node_id, node_id, etcd.url, extra_config=config,
                              extra_args=["--host", HOSTS[node_id]])


def wait_linked(nodes: list[ClusterNodeProcess]) -> None:
    everyone = {node.node_id for node in nodes}
    for node in nodes:
        wait_for(lambda node=node: settled(node, everyone), timeout=60, interval=0.1)
    for node in nodes:
        wait_for(lambda node=node: linked(node) >= everyone - {node.node_id}, timeout=60,
                 interval=0.1)


def client(node: ClusterNodeProcess, client_id: str, version: int = V311, **kwargs) -> Paho:  # type: ignore[no-untyped-def]
    return Paho(node.mqtt_port, client_id, version, host=HOSTS[node.node_id], **kwargs)


def across(publisher_node: ClusterNodeProcess, subscriber_node: ClusterNodeProcess,
           topic: str, payload: bytes) -> None:
    """A QoS 1 publish on one node reaches a subscriber on the other (over the TLS link)."""
    subscriber = client(subscriber_node, f"sub-{topic}")
    subscriber.subscribe(topic, qos=1)
    publisher = client(publisher_node, f"pub-{topic}")

    def arrived() -> bool:  # a subscription reaches the other node's routes a moment later
        publisher.publish(topic, payload, qos=1)
        try:
            return subscriber.expect(timeout=2).payload == payload
        except queue.Empty:
            return False

    wait_for(arrived, timeout=60)
    for paho in (subscriber, publisher):
        paho.disconnect()


def handshake_as(address: tuple[str, int], pki: dict[str, Path], server_name: str) -> bool:
    """Whether a TLS client holding n1's certificate accepts the node at `address` when it
    expects the certificate to name `server_name`."""
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    context.load_cert_chain(str(pki["n1-cert"]), str(pki["n1-key"]))
    with socket.create_connection(address, timeout=10) as raw:
        try:
            with context.wrap_socket(raw, server_hostname=server_name):
                return True
        except ssl.SSLCertVerificationError:
            return False


@pytest.mark.timeout(400)
def test_nodes_with_their_own_certificates_link_and_link_again_after_a_restart(
        tmp_path: Path, etcd: EtcdServer, node_pki: dict[str, Path]) -> None:
    n1 = tls_node(tmp_path, etcd, "n1", node_pki).start()
    n2 = tls_node(tmp_path, etcd, "n2", node_pki).start()
    nodes = [n1, n2]
    try:
        wait_linked(nodes)
        assert cluster_address(n1)[0] == HOSTS["n1"] and cluster_address(n2)[0] == HOSTS["n2"]
        across(n2, n1, "tls/one", b"n2 to n1")
        across(n1, n2, "tls/two", b"n1 to n2")
        # an internal gRPC call, checked against the other node's own name: a session moves
        roamer = client(n1, "roamer", V5, clean=False, session_expiry=3600)
        roamer.subscribe("roam/#", qos=1)
        roamer.disconnect()
        moved = client(n2, "roamer", V5, clean=False, session_expiry=3600, connect=False)
        flags, rc, _props = moved.connect()
        assert rc == 0 and flags.session_present
        moved.disconnect()
        # each certificate names its own node only
        assert handshake_as(cluster_address(n2), node_pki, HOSTS["n2"])
        assert not handshake_as(cluster_address(n2), node_pki, HOSTS["n1"])

        # a node killed and started again, same address and certificate: linked over TLS again
        n1.kill()
        n1.start()
        wait_linked(nodes)
        across(n2, n1, "tls/three", b"n2 to n1 after the restart")
        across(n1, n2, "tls/four", b"n1 to n2 after the restart")
        for node in nodes:
            log = node.log_path.read_text(errors="replace")
            assert "Traceback" not in log
    finally:
        for node in nodes:
            if node.alive():
                node.kill()
