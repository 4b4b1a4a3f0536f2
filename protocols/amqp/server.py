"""The AMQP listener: an `asyncio.Protocol` feeding socket bytes to `AmqpConnection`.

This is the only AMQP module with sockets. `start_amqp_listener` is what the composition root
calls; it listens through the shared `TcpListener` (every pending connection accepted at each
readiness) and returns an `AmqpServer`. Reads past the loop turn's read budget
(`protocols/read_budget.py`, shared with MQTT) wait for a later turn.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
from typing import TYPE_CHECKING, cast

from ..listener import TcpListener, start_tcp_listener
from ..read_budget import ReadBudget
from .connection import AmqpConnection
from .errors import ConnectionException, ReplyCode
from .frames import OPEN
from .service import AmqpService
from .settings import AmqpSettings

if TYPE_CHECKING:
    from ...core.edge import Edge
    from .remote import ExchangeDirectory, QueueDirectory

log = logging.getLogger(__name__)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host in ("localhost",)


class AmqpProtocol(asyncio.Protocol):
    """One TCP connection: bytes in to the state machine, its output to the transport."""

    def __init__(self, service: AmqpService) -> None:
        self.service = service
        self.budget = service.read_budget  # shared with every client listener of the broker
        self.transport: asyncio.Transport | None = None
        self.connection: AmqpConnection | None = None
        # paused by the connection (memory alarm, publishes in flight)
        self.held = False
        # what was read once the turn's read budget was spent, handled at a later turn (the
        # socket is not read meanwhile); None: nothing waits
        self.deferred: bytes | None = None

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
        if self.deferred is not None:  # (a TLS transport may still hand over what it decrypted)
            self.deferred += data
            return
        if connection.state is OPEN and self.budget.spent():
            # This loop turn has done its share of reads (every listener's together): this
            # read waits for a later turn, so that new connections are accepted and answered
            # meanwhile (the handshake up to connection.open-ok never waits here).
            self.deferred = data
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.pause_reading()
            self.budget.defer(self.run_deferred)
            return
        self._handle(data)

    def _handle(self, data: bytes) -> None:
        connection = self.connection
        assert connection is not None
        try:
            connection.data_received(data)
        except Exception:
            log.exception("internal error on AMQP connection %s", connection.remote)
            connection.close(ConnectionException(ReplyCode.INTERNAL_ERROR, "internal error"))

    def run_deferred(self) -> None:
        """Handle the read the budget left for this turn, then read the socket again."""
        data, self.deferred = self.deferred, None
        if data is not None:
            self._handle(data)  # a closed connection ignores it
        transport = self.transport
        if self.deferred is None and not self.held and transport is not None and not transport.is_closing():
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
        if self.transport is not None and not self.transport.is_closing() and self.deferred is None:
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
    read_budget: ReadBudget | None = None,
    queue_directory: QueueDirectory | None = None,
    exchange_directory: ExchangeDirectory | None = None,
) -> AmqpServer:
    """Listen for AMQP 0-9-1 clients (AMQPS with `ssl_context`). A second listener (TLS next to
    plain TCP) passes the first one's `service` so that both serve the same exchanges and
    queues. `read_budget` is the broker's one budget of reads per loop turn, which the other
    client listeners share (`protocols/read_budget.py`); without it the service has its own."""
    owns = service is None
    if service is None:
        service = AmqpService(edge, settings, scheduler=asyncio.get_running_loop(),
                              read_budget=read_budget, queue_directory=queue_directory,
                              exchange_directory=exchange_directory)
        service.start()
    shared = service
    name = "AMQP" if ssl_context is None else "AMQPS"
    server = await start_tcp_listener(lambda: AmqpProtocol(shared), host, port, ssl_context,
                                      name=name)
    return AmqpServer(server, service, owns)
