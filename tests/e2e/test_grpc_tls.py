"""The native gRPC API over TLS (`listeners.grpcs_port`) with the `[tls]` certificate, through
the project's SDK: the same servicers as the plaintext port, and a plaintext client refused."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from shardgate.client import Client, Unavailable

from shardgate.app import Shardgate
from shardgate.config import ConfigError
from tests.conftest import ThreadedBroker, free_port, make_config
from tests.e2e import test_mqtt_tls

TIMEOUT = 5.0
certificate = test_mqtt_tls.certificate  # the self-signed server certificate fixture
pki = test_mqtt_tls.pki  # a CA, a server certificate and alice's client certificate


@pytest.fixture
def tls_broker(broker_factory: Callable[..., ThreadedBroker],
               certificate: tuple[Path, Path]) -> ThreadedBroker:
    cert, key = certificate
    return broker_factory(listeners={"grpc_port": free_port(), "grpcs_port": free_port()},
                          tls={"cert_file": str(cert), "key_file": str(key)})


async def test_sdk_over_tls_shares_subscriptions_with_the_plaintext_port(
    tls_broker: ThreadedBroker, certificate: tuple[Path, Path],
) -> None:
    cert, _ = certificate
    secure_port = tls_broker.app.port("grpcs")
    assert secure_port != tls_broker.app.port("grpc")
    async with Client(f"grpcs://127.0.0.1:{secure_port}", root_certificates=cert.read_bytes()) as secure, \
            Client(f"127.0.0.1:{tls_broker.app.port('grpc')}") as plain:
        consumer = await secure.consumer("over-tls", ["secure/#"]).subscribe()
        await plain.producer().send("secure/a", b"from plaintext")
        await secure.producer().send("secure/b", b"from tls")
        received = []
        for _ in range(2):
            message = await consumer.receive(TIMEOUT)
            message.ack()
            received.append(message.payload)
        assert sorted(received) == [b"from plaintext", b"from tls"]


async def test_plaintext_client_on_the_tls_port_is_refused(
    tls_broker: ThreadedBroker, certificate: tuple[Path, Path],
) -> None:
    port = tls_broker.app.port("grpcs")
    with pytest.raises(Unavailable):
        async with Client(f"127.0.0.1:{port}", timeout=2.0) as plain:
            await plain.producer().send("secure/x", b"never")
    # a client that speaks no TLS at all: the connection is closed, the listener keeps serving
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00" * 64)
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""  # closed, no HTTP/2 answer
    writer.close()
    cert, _ = certificate
    async with Client(f"grpcs://127.0.0.1:{port}", root_certificates=cert.read_bytes()) as secure:
        receipt = await secure.producer().send("secure/y", b"still serving")
    assert receipt is not None


def test_tls_port_only_and_info_lists_it(
    broker_factory: Callable[..., ThreadedBroker], certificate: tuple[Path, Path],
) -> None:
    cert, key = certificate
    broker = broker_factory(listeners={"grpc_port": 0, "grpcs_port": free_port(), "http_port": free_port()},
                            tls={"cert_file": str(cert), "key_file": str(key)})
    names = {listener.name for listener in broker.app.listeners.values()}
    assert "grpcs" in names and "grpc" not in names
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.app.port('http')}/api/info", timeout=TIMEOUT) as answer:
        info = json.load(answer)
    assert {"name": "grpcs", "host": "127.0.0.1", "port": broker.app.port("grpcs")} in info["listeners"]


def test_tls_port_without_certificate_is_a_clear_error(tmp_path: Path) -> None:
    config = make_config(tmp_path / "d", listeners={"grpcs_port": free_port()})

    async def start() -> None:
        app = Shardgate(config)
        try:
            await app.start()
        finally:
            await app.stop()

    with pytest.raises(ConfigError, match="cert_file"):
        asyncio.run(start())


async def test_required_client_certificate(
    broker_factory: Callable[..., ThreadedBroker], pki: dict[str, Path],
) -> None:
    """`tls.ca_file` + `require_client_cert`: as on the MQTT TLS listener, a client without a
    certificate signed by that CA gets no connection; one with it does."""
    broker = broker_factory(
        listeners={"grpc_port": 0, "grpcs_port": free_port()},
        tls={"cert_file": str(pki["server.crt"]), "key_file": str(pki["server.key"]),
             "ca_file": str(pki["ca.crt"]), "require_client_cert": True},
    )
    target = f"127.0.0.1:{broker.app.port('grpcs')}"
    ca = pki["ca.crt"].read_bytes()
    with pytest.raises(Unavailable):
        async with Client(f"grpcs://{target}", root_certificates=ca, timeout=2.0):
            pass
    credentials = grpc.ssl_channel_credentials(ca, pki["alice.key"].read_bytes(),
                                               pki["alice.crt"].read_bytes())
    async with grpc.aio.secure_channel(target, credentials) as channel:
        await asyncio.wait_for(channel.channel_ready(), TIMEOUT)
