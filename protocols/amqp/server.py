"""The AMQP listener: an `asyncio.Protocol` feeding socket bytes to `AmqpConnection`.

This is the only AMQP module with sockets. `start_amqp_listener` is what the composition root
calls; it listens through the shared `TcpListener` (every pending connection accepted at each
readiness) and returns an `AmqpServer`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
import time
import weakref
from typing import TYPE_CHECKING, cast

from ..listener import TcpListener, start_tcp_listener
from .connection import AmqpConnection
from .errors import ConnectionException, ReplyCode
from .service import AmqpService
from .settings import AmqpSettings

if TYPE_CHECKING:
    from ...core.edge import Edge

log = logging.getLogger(__name__)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host in ("localhost",)


# Reads of one event-loop turn, all connections together, after which a connection that read
# is not read again before the next turn.
READ_BUDGET_S = 0.005


class ReadTurns:
    """Gives every socket, and the listener, a share of each event-loop turn.

    libuv reads a readable socket up to 32 times per callback (256 KiB each with uvloop), so
    one publisher flooding the broker can hold a loop turn for hundreds of milliseconds, turn
    after turn; the listening socket's readiness then waits seconds (measured: a burst of
    connections stayed in the accept queue until the flood ended). Once the reads of a turn
    have taken `READ_BUDGET_S`, a connection that has just read is paused until the next turn
    (TCP back-pressure meanwhile): each turn still reads every busy socket at least once, and
    the listener's accept runs between turns."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.started = 0.0  # when this turn's first read began; 0: no read yet this turn
        self._paused: list[AmqpProtocol] = []

    def begin(self) -> None:
        if not self.started:
            self.started = time.perf_counter()
            self._loop.call_soon(self._next_turn)

    def spent(self) -> bool:
        return time.perf_counter() - self.started > READ_BUDGET_S

    def pause(self, protocol: AmqpProtocol) -> None:
        self._paused.append(protocol)

    def _next_turn(self) -> None:
        self.started = 0.0
        paused, self._paused = self._paused, []
        for protocol in paused:
            protocol.turn_resume()


_read_turns: weakref.WeakKeyDictionary[AmqpService, ReadTurns] = weakref.WeakKeyDictionary()


class AmqpProtocol(asyncio.Protocol):
    """One TCP connection: bytes in to the state machine, its output to the transport."""

    def __init__(self, service: AmqpService, turns: ReadTurns | None = None) -> None:
        self.service = service
        self.turns = turns
        self.transport: asyncio.Transport | None = None
        self.connection: AmqpConnection | None = None
        # paused by the connection (memory alarm), or until the next loop turn
        self.held = False
        self.yielded = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream server's transport has the asyncio.Transport interface; uvloop's are not
        # asyncio.Transport subclasses, so this is a cast rather than an isinstance check.
        self.transport = cast(asyncio.Transport, transport)
        limit = self.service.settings.max_outbound_buffer
        self.transport.set_write_buffer_limits(high=limit, low=limit // 4)
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        remote = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.connection = AmqpConnection(self.service, self, remote, _is_loopback(host))
        self.service.connection_made(self.connection)

    def data_received(self, data: bytes) -> None:
        connection = self.connection
        assert connection is not None
        turns = self.turns
        if turns is not None:
            turns.begin()
        try:
            connection.data_received(data)
        except Exception:
            log.exception("internal error on AMQP connection %s", connection.remote)
            connection.close(ConnectionException(ReplyCode.INTERNAL_ERROR, "internal error"))
        if turns is not None and turns.spent() and not self.yielded:
            transport = self.transport
            if transport is not None and not transport.is_closing():
                self.yielded = True
                transport.pause_reading()
                turns.pause(self)

    def turn_resume(self) -> None:
        self.yielded = False
        transport = self.transport
        if not self.held and transport is not None and not transport.is_closing():
            transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.connection is not None:
            self.service.connection_gone(self.connection)

    def pause_writing(self) -> None:
        if self.connection is not None:
            self.connection.set_writable(False)

    def resume_writing(self) -> None:
        if self.connection is not None:
            self.connection.set_writable(True)

    # Link
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def pause_reading(self) -> None:
        self.held = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        self.held = False
        if self.transport is not None and not self.transport.is_closing() and not self.yielded:
            self.transport.resume_reading()


class AmqpServer:
    """The listening socket(s) and the service behind them; shaped like `asyncio.Server`."""

    def __init__(self, server: TcpListener, service: AmqpService, owns_service: bool) -> None:
        self.server = server
        self.service = service
        self.owns_service = owns_service

    @property
    def sockets(self) -> tuple[object, ...]:
        return self.server.sockets

    def close(self) -> None:
        """Stop accepting; the listener that created the service also closes every client
        connection (connection.close 320)."""
        self.server.close()
        if self.owns_service:
            self.service.stop()

    async def wait_closed(self) -> None:
        await self.server.wait_closed()


async def start_amqp_listener(
    edge: Edge,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None = None,
    settings: AmqpSettings | None = None,
    *,
    service: AmqpService | None = None,
) -> AmqpServer:
    """Listen for AMQP 0-9-1 clients (AMQPS with `ssl_context`). A second listener (TLS next to
    plain TCP) passes the first one's `service` so that both serve the same exchanges and
    queues."""
    owns = service is None
    if service is None:
        service = AmqpService(edge, settings, scheduler=asyncio.get_running_loop())
        service.start()
    shared = service
    name = "AMQP" if ssl_context is None else "AMQPS"
    turns = _read_turns.get(shared)
    if turns is None:
        turns = _read_turns[shared] = ReadTurns(asyncio.get_running_loop())
    server = await start_tcp_listener(lambda: AmqpProtocol(shared, turns), host, port, ssl_context,
                                      name=name)
    return AmqpServer(server, service, owns)
