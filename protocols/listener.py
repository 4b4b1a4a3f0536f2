"""The client-facing TCP listener every protocol shares: accept every pending connection at once.

uvloop (libuv >= 1.45) accepts one connection per event-loop iteration, so under load, when an
iteration takes tens of milliseconds, a burst of a few hundred connections waits seconds in the
kernel's accept queue before the broker reads a byte of it (mosquitto, RabbitMQ and asyncio's
own loop accept a batch per readiness). `TcpListener` accepts up to `ACCEPT_BATCH` connections
at each readiness of any of its sockets and hands each to the loop's transport
(`loop.connect_accepted_socket`, with TLS when configured). `start_tcp_listener` binds every
address a host resolves to, as `loop.create_server` does. MQTT (TCP, TLS, WebSocket) and AMQP
(plain, TLS) listen through it.

Each accepted connection's transport is made at once, in the accepting callback
(`start_eagerly`: the first step of `loop.connect_accepted_socket`, as Python 3.12's eager tasks
run it), not by a task that first runs a loop iteration later: its protocol's `connection_made`
then comes one iteration after the accept, as with the loop's own listener, instead of two,
and so does the first read of what the client sent (under load an iteration takes tens of ms).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# Connections accepted per readiness of a listening socket (the listen backlog is 1024).
ACCEPT_BATCH = 1024
LISTEN_BACKLOG = 1024
# After accept fails for lack of file descriptors, listen again after this long.
ACCEPT_RETRY_S = 1.0


class TcpListener:
    """Listening sockets that accept every pending connection at once.

    It offers what the broker uses of an `asyncio.Server`: `sockets`, `is_serving`,
    `get_loop`, `close`, `wait_closed`. `largest_batch` is the most connections one readiness
    has accepted (for tests and diagnostics)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, socks: list[socket.socket],
                 protocol_factory: Callable[[], asyncio.BaseProtocol],
                 ssl_context: ssl.SSLContext | None, *, name: str = "TCP") -> None:
        self._loop = loop
        self._socks = socks
        self._factory = protocol_factory
        self._ssl = ssl_context
        self._name = name
        self._handshakes: set[asyncio.Future[Any]] = set()
        self._retries: dict[int, asyncio.TimerHandle] = {}
        self._serving = True
        self.largest_batch = 0
        for sock in socks:
            loop.add_reader(sock.fileno(), self._accept, sock)

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._socks) if self._serving else ()

    def is_serving(self) -> bool:
        return self._serving

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def _accept(self, sock: socket.socket) -> None:
        accepted = 0
        try:
            for _ in range(ACCEPT_BATCH):
                try:
                    conn, _address = sock.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    return
                except OSError as exc:
                    # Out of file descriptors (EMFILE, ENFILE, ENOBUFS): stop listening a while
                    # rather than spin on a socket that stays readable.
                    log.error("%s listener: accept failed (%s); retrying in %.0f s",
                              self._name, exc, ACCEPT_RETRY_S)
                    self._loop.remove_reader(sock.fileno())
                    self._retries[sock.fileno()] = self._loop.call_later(
                        ACCEPT_RETRY_S, self._listen_again, sock)
                    return
                accepted += 1
                conn.setblocking(False)
                if conn.family in (socket.AF_INET, socket.AF_INET6):
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                task = start_eagerly(
                    self._loop, self._loop.connect_accepted_socket(self._factory, conn, ssl=self._ssl))
                self._handshakes.add(task)
                task.add_done_callback(self._handshake_done)
        finally:
            if accepted > self.largest_batch:
                self.largest_batch = accepted

    def _handshake_done(self, task: asyncio.Future[Any]) -> None:
        self._handshakes.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.info("%s listener: connection not established: %s", self._name, exc)

    def _listen_again(self, sock: socket.socket) -> None:
        self._retries.pop(sock.fileno(), None)
        if self._serving:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def close(self) -> None:
        if not self._serving:
            return
        self._serving = False
        for sock in self._socks:
            retry = self._retries.pop(sock.fileno(), None)
            if retry is not None:
                retry.cancel()
            else:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        for task in self._handshakes:
            task.cancel()

    async def wait_closed(self) -> None:
        if self._handshakes:
            await asyncio.gather(*self._handshakes, return_exceptions=True)


def start_eagerly(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """Run `coro` up to its first suspension now, in the caller's callback, and the rest in a
    task: the future of its outcome (Python 3.12's `asyncio.eager_task_factory` does the same).
    What its first step schedules (a transport's `connection_made`) runs in the next
    iteration, not the one after."""
    try:
        first = coro.send(None)
    except StopIteration as done:
        result: asyncio.Future[T] = loop.create_future()
        result.set_result(done.value)
        return result
    except BaseException as exc:  # noqa: BLE001 - handed to the future, as a task would
        failed: asyncio.Future[T] = loop.create_future()
        failed.set_exception(exc)
        return failed
    return loop.create_task(_resumed(coro, first))


async def _resumed(coro: Coroutine[Any, Any, T], first: object) -> T:
    """The rest of a coroutine `start_eagerly` began, driven as a task drives it: resumed once
    what it waits for is done (a started coroutine cannot be awaited again)."""
    waiting = first
    while True:
        try:
            if isinstance(waiting, asyncio.Future):
                await asyncio.wait([waiting])
            else:
                await asyncio.sleep(0)  # a bare yield: resumed on the next iteration
        except BaseException:
            coro.close()  # cancelled (the listener closed): the coroutine cleans up as it stops
            raise
        try:
            waiting = coro.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def _listening_socket(family: int, kind: int, proto: int, address: Any) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # as asyncio.create_server: the IPv4 address of a dual-stack host gets its own socket
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def start_tcp_listener(
    protocol_factory: Callable[[], asyncio.BaseProtocol], host: str, port: int,
    ssl_context: ssl.SSLContext | None = None, *, name: str = "TCP",
) -> TcpListener:
    """Listen on every address `host` resolves to (all interfaces for "" or "0.0.0.0" / "::"
    as given), like `asyncio.create_server`; `name` labels the listener's log lines."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    try:
        for family, kind, proto, _name, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            socks.append(_listening_socket(family, kind, proto, address))
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return TcpListener(loop, socks, protocol_factory, ssl_context, name=name)


async def start_websocket_listener(
    handler: Callable[[Any], Awaitable[None]], host: str, port: int,
    ssl_context: ssl.SSLContext | None = None, *, name: str = "WebSocket",
    subprotocols: Sequence[Any] | None = None,
    select_subprotocol: Callable[[Any, Sequence[Any]], Any] | None = None,
    max_size: int | None = 2**20, logger: Any = None,
    process_request: Callable[[Any, Any], Any] | None = None,
) -> Any:
    """A `websockets` server (`websockets.asyncio.server.Server`, no compression) whose TCP
    side is a `TcpListener`: `serve()` would listen through `loop.create_server`, which accepts
    one connection per loop iteration. This is the wiring `Server.wrap` documents: a `Server`,
    a protocol factory that hands it each connection, and the listening sockets attached."""
    from websockets.asyncio.server import Server, ServerConnection
    from websockets.server import ServerProtocol

    server = Server(handler, logger=logger, process_request=process_request)

    def connection_factory() -> ServerConnection:
        def choose(protocol: ServerProtocol, offered: Sequence[Any]) -> Any:
            assert select_subprotocol is not None
            return select_subprotocol(connection, offered)

        protocol = ServerProtocol(
            subprotocols=subprotocols, max_size=max_size, logger=logger,
            select_subprotocol=choose if select_subprotocol is not None else None,
        )
        connection = ServerConnection(protocol, server)
        return connection

    listener = await start_tcp_listener(connection_factory, host, port, ssl_context, name=name)
    server.wrap(listener)  # type: ignore[arg-type]
    return server
