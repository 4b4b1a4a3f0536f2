"""TLS on the cluster port: encryption and mutual certificate verification of everything nodes
say to each other there (the peer links of `link.py` and the internal gRPC calls of
`state_rpc.py`, `shard_reader.py`, `amqp_queues.py`), when `[cluster] tls_cert_file`,
`tls_key_file` and `tls_ca_file` are set.

Every node presents its certificate (signed by the cluster's CA) and accepts a peer only when
the peer's certificate is signed by that CA too, in both directions, as RabbitMQ's
inter-node TLS with `verify_peer` and `fail_if_no_peer_cert` does. The dialing node checks that
the certificate names the host it dials (the peer's advertised address; or `tls_server_name`
for all nodes, when their certificates name one shared name). The node's identity is still
proven by the cluster secret and checked against etcd (`link_auth.py`): TLS adds secrecy and
keeps strangers without a certificate from even starting that handshake.

The accepting side terminates TLS before `ClusterPortProtocol` sees the first byte, so the
link protocol and the pass-through to the loopback gRPC server are the same with or without
it; ALPN offers `h2` for the gRPC clients, which require it.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

# What the accepting side offers by ALPN: gRPC clients over TLS require HTTP/2.
ALPN_GRPC = "h2"


class ClusterTlsError(ValueError):
    """A TLS file of the cluster port is missing, unreadable, or not what it should be."""


class ClusterTls:
    """The cluster port's certificate, key and CA, and the contexts built from them once."""

    def __init__(self, cert_file: str, key_file: str, ca_file: str, server_name: str = "") -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.ca_file = ca_file
        self.server_name = server_name
        try:
            cert = Path(cert_file).read_bytes()
            key = Path(key_file).read_bytes()
            ca = Path(ca_file).read_bytes()
        except OSError as exc:
            raise ClusterTlsError(f"cannot read a cluster TLS file: {exc}") from None
        try:
            self.server_context = self._context(ssl.PROTOCOL_TLS_SERVER)
            self.server_context.set_alpn_protocols([ALPN_GRPC])
            self.client_context = self._context(ssl.PROTOCOL_TLS_CLIENT)
        except (ssl.SSLError, ValueError) as exc:
            raise ClusterTlsError(f"cluster TLS files {cert_file}, {key_file}, {ca_file}: {exc}") from None
        self.channel_credentials = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert)

    def _context(self, purpose: int) -> ssl.SSLContext:
        context = ssl.SSLContext(purpose)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        context.load_verify_locations(cafile=self.ca_file)
        context.verify_mode = ssl.CERT_REQUIRED  # the other node's certificate, both ways
        return context

    def dial_name(self, host: str) -> str:
        """The name the dialing side checks the peer's certificate against."""
        return self.server_name or host

    def channel_options(self, host: str) -> list[tuple[str, str]]:
        """gRPC channel options that check the peer's certificate against `dial_name`."""
        return [("grpc.ssl_target_name_override", self.dial_name(host))]


def load_cluster_tls(cert_file: str | None, key_file: str | None, ca_file: str | None,
                     server_name: str | None = None) -> ClusterTls | None:
    """The cluster port's TLS, or None when none of its files is set. ClusterTlsError when
    only some are set, or they cannot be used."""
    given = {"tls_cert_file": cert_file, "tls_key_file": key_file, "tls_ca_file": ca_file}
    if not any(given.values()):
        return None
    missing = [name for name, value in given.items() if not value]
    if missing:
        raise ClusterTlsError(
            f"cluster TLS needs tls_cert_file, tls_key_file and tls_ca_file; {', '.join(missing)} "
            "not set")
    assert cert_file and key_file and ca_file
    return ClusterTls(cert_file, key_file, ca_file, server_name or "")
