"""A plain TCP MQTT connection is made at the end of the loop iteration that accepted it: a
CONNECT already in its socket is answered then, before the transport's `connection_made` (a
loop iteration later, behind the next iteration's queued callbacks: under load most of a new
client's CONNECT → CONNACK). What the connection writes or asks for between the two (more
output, a close, a read of what the client sends later) reaches the transport in order once it
exists, and a new connection's first packets are handled after what other connections had
sent before it connected."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import uvloop
from shardgate.core.broker import Broker
from shardgate.core.edge import Edge
from shardgate.protocols.listener import TcpListener, _listening_socket
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode
from shardgate.protocols.mqtt.server import MqttProtocol
from shardgate.protocols.mqtt.service import MqttService
from shardgate.storage.memory import MemoryStorage


def _recv_until(client: socket.socket, predicate: Callable[[bytes], bool]) -> bytes:
    """Blocking reads (the socket has a timeout) until `predicate` holds or the peer closes."""
    received = b""
    while not predicate(received):
        chunk = client.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


def _run(scenario: Callable[[MqttService, TcpListener, list[bytes], list[bytes]], Awaitable[bytes]]) -> tuple[bytes, list[bytes], list[bytes]]:
    """Run `scenario` on uvloop with a listener whose protocols record, in `before_made`, what
    they wrote before their transport's `connection_made`, and in `after_made` what after."""

    async def main() -> tuple[bytes, list[bytes], list[bytes]]:
        loop = asyncio.get_running_loop()
        service = MqttService(Edge(Broker(storage=MemoryStorage())), scheduler=loop)
        before_made: list[bytes] = []
        after_made: list[bytes] = []

        class Recording(MqttProtocol):
            __slots__ = ("made",)

            def __init__(self, service: MqttService) -> None:
                super().__init__(service)
                self.made = False

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.made = True
                super().connection_made(transport)

            def write(self, data: bytes) -> None:
                (after_made if self.made else before_made).append(data)
                super().write(data)

        listening = _listening_socket(socket.AF_INET, socket.SOCK_STREAM, 0, ("127.0.0.1", 0))
        listener = TcpListener(loop, [listening], lambda: Recording(service), None)
        try:
            reply = await scenario(service, listener, before_made, after_made)
        finally:
            listener.close()
            await listener.wait_closed()
            service.stop()
        return reply, before_made, after_made

    return uvloop.run(main())


def _connect_and_send(listener: TcpListener, data: bytes) -> socket.socket:
    client = socket.create_connection(listener.sockets[0].getsockname())
    client.settimeout(10)
    client.sendall(data)  # in the socket before the loop next polls the listener
    return client


def test_a_connect_already_sent_is_answered_in_the_accepting_callback() -> None:
    async def scenario(service: MqttService, listener: TcpListener, before: list[bytes], after: list[bytes]) -> bytes:
        client = _connect_and_send(listener, encode(p.Connect("MQTT", 4, True, 30, "at-accept"), 4))
        try:
            return await asyncio.get_running_loop().run_in_executor(None, client.recv, 64)
        finally:
            client.close()

    reply, before, _after = _run(scenario)
    assert reply[:1] == b"\x20"  # CONNACK
    assert before and before[0][:1] == b"\x20", "the CONNACK waited for the transport"


def test_output_after_the_accept_reaches_the_client_through_the_transport_in_order() -> None:
    connect = encode(p.Connect("MQTT", 4, True, 30, "then-subscribe"), 4)
    subscribe = encode(p.Subscribe(7, [p.SubscriptionRequest("a/b", 1)]), 4)
    ping = encode(p.Pingreq(), 4)

    async def scenario(service: MqttService, listener: TcpListener, before: list[bytes], after: list[bytes]) -> bytes:
        client = _connect_and_send(listener, connect + subscribe)
        loop = asyncio.get_running_loop()
        try:
            first = await loop.run_in_executor(None, _recv_until, client, lambda got: len(got) >= 4 + 5)
            client.sendall(ping)  # read by the transport, not the first read
            rest = await loop.run_in_executor(None, _recv_until, client, lambda got: len(got) >= 2)
            return first + rest
        finally:
            client.close()

    reply, before, after = _run(scenario)
    # CONNACK, SUBACK (packet id 7, granted QoS 1), PINGRESP: in that order.
    assert reply == b"\x20\x02\x00\x00" + b"\x90\x03\x00\x07\x01" + b"\xd0\x00"
    assert before[0][:1] == b"\x20"
    assert any(chunk[:1] == b"\xd0" for chunk in after), "the PINGRESP did not go through the transport"


def test_a_connection_closed_before_its_transport_is_closed_once_it_exists() -> None:
    async def scenario(service: MqttService, listener: TcpListener, before: list[bytes], after: list[bytes]) -> bytes:
        client = _connect_and_send(listener, encode(p.Pingreq(), 4))  # not a CONNECT
        try:
            return await asyncio.get_running_loop().run_in_executor(None, _recv_until, client, lambda got: False)
        finally:
            client.close()

    reply, _before, _after = _run(scenario)
    assert reply == b""  # closed without an answer, as when the transport read it


def test_a_connect_sent_after_the_accept_is_read_by_the_transport() -> None:
    async def scenario(service: MqttService, listener: TcpListener, before: list[bytes], after: list[bytes]) -> bytes:
        loop = asyncio.get_running_loop()
        client = socket.create_connection(listener.sockets[0].getsockname())
        client.settimeout(10)
        try:
            async with asyncio.timeout(10):
                while not service._handshaking:  # accepted, nothing read yet
                    await asyncio.sleep(0.01)
            client.sendall(encode(p.Connect("MQTT", 5, True, 30, "late-connect"), 5))
            return await loop.run_in_executor(None, client.recv, 64)
        finally:
            client.close()

    reply, before, after = _run(scenario)
    assert reply[:1] == b"\x20"
    assert not before and after[0][:1] == b"\x20"


def test_a_new_connection_is_handled_after_what_others_sent_in_the_same_turn() -> None:
    """B connects (CONNECT and SUBSCRIBE already sent), then the connected A publishes a
    retained message, before the broker's next poll: the poll reports the listener first, yet
    A's publish is handled first, so B's subscription finds the message retained (RETAIN 1),
    as when the new connection was handled an iteration later."""

    async def scenario(service: MqttService, listener: TcpListener, before: list[bytes], after: list[bytes]) -> bytes:
        loop = asyncio.get_running_loop()
        address = listener.sockets[0].getsockname()
        publisher = socket.create_connection(address)
        publisher.settimeout(10)
        subscriber = None
        try:
            publisher.sendall(encode(p.Connect("MQTT", 4, True, 30, "publisher"), 4))
            assert (await loop.run_in_executor(None, publisher.recv, 64))[:1] == b"\x20"
            subscriber = socket.create_connection(address)
            subscriber.settimeout(10)
            subscriber.sendall(encode(p.Connect("MQTT", 4, True, 30, "subscriber"), 4)
                               + encode(p.Subscribe(1, [p.SubscriptionRequest("kept/t", 0)]), 4))
            publisher.sendall(encode(p.Publish("kept/t", b"v", qos=0, retain=True), 4))
            return await loop.run_in_executor(None, _recv_until, subscriber, lambda got: len(got) >= 4 + 5 + 1)
        finally:
            publisher.close()
            if subscriber is not None:
                subscriber.close()

    reply, _before, _after = _run(scenario)
    assert reply[:4] == b"\x20\x02\x00\x00" and reply[4:9] == b"\x90\x03\x00\x01\x00"
    assert reply[9] == 0x31, f"PUBLISH first byte {reply[9]:#x}: the subscription was handled before the publish"
