"""The shared TCP listener (`protocols/listener.py`): connections that queued in the kernel
while the event loop was busy are all accepted at the listener's next readiness, not one per
loop iteration."""

from __future__ import annotations

import asyncio
import socket
import threading

from shardgate.protocols.listener import start_tcp_listener


class Recorder(asyncio.Protocol):
    def __init__(self, made: list[Recorder]) -> None:
        self.made = made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(self)
        self.transport = transport


async def _wait_until(condition, what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_connections_queued_while_the_loop_is_busy_are_accepted_at_one_readiness() -> None:
    made: list[Recorder] = []
    listener = await start_tcp_listener(lambda: Recorder(made), "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    clients: list[socket.socket] = []
    try:
        # The loop is busy (this thread holds it) while 150 clients connect: the kernel
        # completes their handshakes into the accept queue, as under load.
        def connect() -> None:
            for _ in range(150):
                clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))

        connector = threading.Thread(target=connect)
        connector.start()
        connector.join(30)
        assert len(clients) == 150
        await _wait_until(lambda: len(made) == 150, f"{len(made)} of 150 connections made")
        assert listener.largest_batch == 150
    finally:
        for client in clients:
            client.close()
        listener.close()
        await listener.wait_closed()
    assert listener.sockets == ()

