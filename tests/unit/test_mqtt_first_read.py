"""A new MQTT connection whose CONNECT is already in its socket is answered as the connection
is made, not when the event loop next polls the socket (after the rest of that iteration's
callbacks and the reads of every socket polled before it)."""

from __future__ import annotations

import asyncio
import socket

import uvloop
from shardgate.core.broker import Broker
from shardgate.core.edge import Edge
from shardgate.protocols.listener import TcpListener, _listening_socket
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode
from shardgate.protocols.mqtt.server import MqttProtocol
from shardgate.protocols.mqtt.service import MqttService
from shardgate.storage.memory import MemoryStorage


def _written_during_connection_made() -> tuple[bool, bytes]:
    async def scenario() -> tuple[bool, bytes]:
        loop = asyncio.get_running_loop()
        service = MqttService(Edge(Broker(storage=MemoryStorage())), scheduler=loop)
        written: list[bytes] = []
        answered: list[bool] = []

        class Recording(MqttProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                super().connection_made(transport)
                answered.append(bool(written))

            def write(self, data: bytes) -> None:
                written.append(data)
                super().write(data)

        listening = _listening_socket(socket.AF_INET, socket.SOCK_STREAM, 0, ("127.0.0.1", 0))
        listener = TcpListener(loop, [listening], lambda: Recording(service), None)
        client = socket.create_connection(listening.getsockname())
        client.sendall(encode(p.Connect("MQTT", 4, True, 30, "early"), 4))
        client.settimeout(10)
        try:
            reply = await loop.run_in_executor(None, client.recv, 64)
        finally:
            client.close()
            listener.close()
            await listener.wait_closed()
            service.stop()
        return answered[0], reply

    return uvloop.run(scenario())


def test_a_connect_already_sent_is_answered_as_the_connection_is_made() -> None:
    answered, reply = _written_during_connection_made()
    assert reply[:1] == b"\x20"  # CONNACK
    assert answered, "the CONNACK waited for the loop to poll the new socket"
