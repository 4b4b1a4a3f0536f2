"""The TLS context of the broker's listeners, from the `[tls]` section: the certificate and
its key, and the CA that verifies client certificates (required or optional)."""

from __future__ import annotations

import ssl

from .config import ConfigError, TlsConfig


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """The server side TLS context of every TLS listener (MQTT, MQTT over WebSocket, AMQP,
    gRPC) from `[tls]`; a missing or unreadable certificate, key or CA is a `ConfigError`."""
    if not tls.cert_file or not tls.key_file:
        raise ConfigError("a TLS listener needs tls.cert_file and tls.key_file")
    if tls.require_client_cert and not tls.ca_file:
        # Without a CA there is nothing to verify a client certificate against: the
        # listener would accept clients with none, the opposite of what was asked.
        raise ConfigError("tls.require_client_cert = true needs tls.ca_file (the CA that "
                          "signs client certificates)")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls.cert_file {tls.cert_file!r} / tls.key_file {tls.key_file!r}: "
                          f"cannot load a certificate and its key ({exc})") from None
    if tls.ca_file:
        try:
            context.load_verify_locations(tls.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"tls.ca_file {tls.ca_file!r}: cannot load ({exc})") from None
        context.verify_mode = ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_OPTIONAL
    return context
