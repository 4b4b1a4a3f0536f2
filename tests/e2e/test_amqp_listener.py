"""The AMQP listener accepts a burst of connections at once: clients that connected while the
broker's event loop was busy all complete the AMQP handshake, and the listener took them from
the kernel's accept queue in one readiness rather than one per loop iteration."""

from __future__ import annotations

import socket
import threading

from pamqp import commands, frame

from tests.conftest import free_port

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
BURST = 300


def _read_frame(sock: socket.socket, buffer: bytearray) -> object:
    while True:
        if len(buffer) >= 7:
            size = int.from_bytes(buffer[3:7], "big") + 8
            if len(buffer) >= size:
                _used, _channel, value = frame.unmarshal(bytes(buffer[:size]))
                del buffer[:size]
                return value
        data = sock.recv(65536)
        if not data:
            raise AssertionError("the broker closed the connection during the handshake")
        buffer += data


def _handshake(*socks: socket.socket) -> None:
    """The AMQP handshake on every socket (each already sent the protocol header), step by
    step across all of them, so that none waits for the others to finish."""
    buffers = [bytearray() for _ in socks]
    for sock, buffer in zip(socks, buffers, strict=True):
        assert isinstance(_read_frame(sock, buffer), commands.Connection.Start)
        sock.sendall(frame.marshal(commands.Connection.StartOk(
            client_properties={}, mechanism="PLAIN", response="\0guest\0guest"), 0))
    for sock, buffer in zip(socks, buffers, strict=True):
        assert isinstance(_read_frame(sock, buffer), commands.Connection.Tune)
        sock.sendall(frame.marshal(commands.Connection.TuneOk(channel_max=16, frame_max=131072, heartbeat=0), 0)
                     + frame.marshal(commands.Connection.Open(virtual_host="/"), 0))
    for sock, buffer in zip(socks, buffers, strict=True):
        assert isinstance(_read_frame(sock, buffer), commands.Connection.OpenOk)


def test_a_burst_of_connections_during_a_busy_loop_all_complete_the_handshake(broker_factory) -> None:
    node = broker_factory(listeners={"amqp_port": free_port()})
    port = node.app.port("amqp")
    listener = node.app.listeners["amqp"].server.server
    busy = threading.Event()
    release = threading.Event()

    def hold_the_loop() -> None:
        busy.set()
        release.wait(60)

    node.loop.call_soon_threadsafe(hold_the_loop)
    assert busy.wait(15)
    clients: list[socket.socket] = []
    try:
        for _ in range(BURST):  # the kernel completes each TCP handshake into the accept queue
            client = socket.create_connection(("127.0.0.1", port), timeout=30)
            client.sendall(PROTOCOL_HEADER)
            clients.append(client)
        release.set()
        _handshake(*clients)
        assert listener.largest_batch == BURST
    finally:
        release.set()
        for client in clients:
            client.close()

