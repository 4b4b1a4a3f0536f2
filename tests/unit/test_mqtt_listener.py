"""The MQTT TCP listener: every address the host resolves to is served, and every pending
connection of a burst is accepted."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from shardgate.protocols.listener import TcpListener
from shardgate.protocols.mqtt import server
from shardgate.protocols.mqtt.server import start_tcp_listener


class Recorder(asyncio.Protocol):
    made: list[Recorder] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        Recorder.made.append(self)
        self.transport = transport


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


async def _connect(host: str, port: int) -> None:
    _reader, writer = await asyncio.open_connection(host, port)
    writer.close()


async def _wait_for_connections(count: int) -> None:
    for _ in range(500):
        if len(Recorder.made) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(Recorder.made)} of {count} connections accepted")


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback")
async def test_a_host_with_two_addresses_is_served_on_both(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def both_loopbacks(host: Any, port: Any, **kwargs: Any) -> list[Any]:
        assert host == "localhost"
        stream = socket.SOCK_STREAM
        return [
            (socket.AF_INET6, stream, 6, "", ("::1", port, 0, 0)),
            (socket.AF_INET, stream, 6, "", ("127.0.0.1", port)),
            (socket.AF_INET, stream, 6, "", ("127.0.0.1", port)),  # duplicates are bound once
        ]

    monkeypatch.setattr(loop, "getaddrinfo", both_loopbacks)
    monkeypatch.setattr(server, "MqttProtocol", lambda service: Recorder())
    Recorder.made = []
    listener = await start_tcp_listener(None, "localhost", port)  # type: ignore[arg-type]
    try:
        assert sorted(sock.family for sock in listener.sockets) == sorted(
            [socket.AF_INET, socket.AF_INET6])
        await _connect("127.0.0.1", port)
        await _connect("::1", port)
        await _wait_for_connections(2)
    finally:
        listener.close()
        await listener.wait_closed()
    assert listener.sockets == ()


async def test_a_burst_of_connections_is_accepted() -> None:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    Recorder.made = []
    listener = TcpListener(loop, [sock], Recorder, None)
    try:
        await asyncio.gather(*(_connect("127.0.0.1", port) for _ in range(200)))
        await _wait_for_connections(200)
    finally:
        listener.close()
        await listener.wait_closed()
