"""MQTT listeners: the asyncio adapters that feed sockets to `MqttConnection`.

This is the only MQTT module with sockets. TCP (optionally TLS) uses an `asyncio.Protocol`;
MQTT over WebSocket (subprotocol `mqtt`, binary frames) uses the `websockets` library.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import sys
from collections import deque
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from ..listener import TcpListener
from ..listener import start_tcp_listener as listen_tcp
from ..listener import start_websocket_listener as listen_websocket
from .connection import MqttConnection
from .service import MqttService

log = logging.getLogger(__name__)


def origin_allowed(origin: str | None, host: str | None, allowed: Sequence[str]) -> bool:
    """May a WebSocket handshake with this `Origin` go on? No Origin (not a browser): yes. An
    origin listed in `allowed` (or "*" there): yes. With an empty list, a page of the same host
    name as the request's `Host` (any port): yes. Anything else: no."""
    if origin is None:
        return True
    if "*" in allowed or origin.rstrip("/") in (entry.rstrip("/") for entry in allowed):
        return True
    if allowed or not host:
        return False
    try:
        origin_host = urlsplit(origin).hostname
        own_host = urlsplit(f"//{host}").hostname
    except ValueError:
        return False
    return origin_host is not None and origin_host == own_host


def _check_origin(allowed: Sequence[str]) -> Callable[[Any, Any], Any]:
    def process_request(connection: Any, request: Any) -> Any:
        origin = request.headers.get("Origin")
        if origin_allowed(origin, request.headers.get("Host"), allowed):
            return None
        log.info("%s: WebSocket from origin %r refused (mqtt.ws_allowed_origins)",
                 getattr(connection, "remote_address", "-"), origin)
        return connection.respond(HTTPStatus.FORBIDDEN, "origin not allowed\n")

    return process_request

# After the server ends a connection it half-closes (FIN) and discards what the client still
# sends for up to this long: closing with unread input makes the kernel send RST, which can
# destroy the DISCONNECT reason code before the client reads it (e.g. after an oversized packet).
LINGER_SECONDS = 2.0
# What a new connection reads at once when it is made (its CONNECT, usually already sent).
FIRST_READ_BYTES = 65536
# The buffer those first reads go through (the loop is single-threaded and each read is copied
# out at once): `os.read` would allocate FIRST_READ_BYTES per connection with malloc and shrink
# it to the CONNECT's size in place, leaving a heap chunk per connection among long-lived
# objects; a copy of the bytes read is an exact-size (small-object allocator) bytes.
_FIRST_READ_VIEW = memoryview(bytearray(FIRST_READ_BYTES))


def certificate_common_name(peercert: dict | None) -> str | None:
    """The subject CN of a verified peer certificate (`SSLObject.getpeercert()`), else None."""
    for rdn in (peercert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and value:
                return value
    return None


class MqttProtocol(asyncio.Protocol):
    """One TCP connection: bytes in to the state machine, its output to the transport."""

    __slots__ = ("service", "transport", "connection", "linger", "paused")

    def __init__(self, service: MqttService) -> None:
        self.service = service
        self.transport: asyncio.Transport | None = None
        self.connection: MqttConnection | None = None
        self.linger: asyncio.TimerHandle | None = None
        self.paused: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        remote = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        tls = transport.get_extra_info("sslcontext") is not None
        self.connection = MqttConnection(self.service, self, remote, "tls" if tls else "tcp")
        if tls and self.service.use_identity_as_username:
            self.connection.certificate_identity = certificate_common_name(
                transport.get_extra_info("peercert")
            )
        self.service.connection_made(self.connection)
        # pause_writing / resume_writing at the connection's output high-water mark.
        high = self.service.settings.output_high_water
        transport.set_write_buffer_limits(high=high, low=high >> 2)  # type: ignore[attr-defined]
        if not tls:
            self._read_first(transport)

    def _read_first(self, transport: asyncio.BaseTransport) -> None:
        """Read what the client has sent already (its CONNECT, written right after its TCP
        connect) now, not when the loop next polls the socket: that poll comes after the rest
        of this iteration's callbacks and the reads of every socket polled before it, which
        under load is tens of milliseconds of the client's CONNECT → CONNACK. Plain TCP only
        (TLS bytes go through the transport's decryption); what is left stays for the
        transport, which reads after this in order."""
        sock = transport.get_extra_info("socket")
        if sock is None:
            return
        try:
            count = os.readv(sock.fileno(), (_FIRST_READ_VIEW,))
        except OSError:
            return  # nothing sent yet (EAGAIN), or an error the transport meets too
        if count:
            self.data_received(bytes(_FIRST_READ_VIEW[:count]))

    def pause_writing(self) -> None:
        pass  # the connection looks at `buffered()` itself (`MqttConnection.output_room`)

    def resume_writing(self) -> None:
        if self.connection is not None:
            self.connection.output_drained()

    def data_received(self, data: bytes) -> None:
        connection = self.connection
        if self.linger is not None or connection is None:
            return
        try:
            connection.data_received(data)
        except Exception:
            log.exception("internal error on connection %s", connection.remote)
            connection.close(0x83, "internal error")

    def connection_lost(self, exc: Exception | None) -> None:
        if self.linger is not None:
            self.linger.cancel()
        if self.paused is not None:
            self.paused.cancel()
            self.paused = None
        connection, self.connection = self.connection, None
        # No reference back to the state machine or the transport: a closed connection is
        # freed at once by reference counting, not left for the cycle collector (under load
        # thousands of them piled up between collections).
        self.transport = None
        if connection is not None:
            self.service.connection_gone(connection)

    # Link
    def write(self, data: bytes) -> None:
        if self.linger is None and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing() or self.linger is not None:
            return
        if not transport.can_write_eof():  # TLS: no half-close
            transport.close()
            return
        transport.write_eof()
        self.linger = asyncio.get_running_loop().call_later(LINGER_SECONDS, transport.close)
        try:
            transport.resume_reading()
        except RuntimeError:
            pass

    def buffered(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    def throttle(self, seconds: float) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.paused is not None:
            self.paused.cancel()
        transport.pause_reading()
        self.paused = asyncio.get_running_loop().call_later(seconds, self.resume)

    def resume(self) -> None:
        if self.paused is not None:
            self.paused.cancel()
            self.paused = None
        if self.transport is not None and not self.transport.is_closing():
            try:
                self.transport.resume_reading()
            except RuntimeError:
                pass


async def start_tcp_listener(
    service: MqttService, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> TcpListener:
    """Listen for MQTT over TCP (TLS with `ssl_context`) on every address `host` resolves to,
    accepting every pending connection at each readiness (`protocols/listener.py`)."""
    return await listen_tcp(lambda: MqttProtocol(service), host, port, ssl_context, name="MQTT")


class WebSocketLink:
    """Link for one MQTT-over-WebSocket connection: writes go out in order through one task;
    while throttled (the read budget, a publish rate, a held publisher) its handler reads no
    frame, until `resume` or the throttle's time runs out."""

    def __init__(self, websocket: object) -> None:
        self.websocket = websocket
        self.pending: deque[bytes] = deque()
        self.pending_bytes = 0
        self.wakeup = asyncio.Event()
        self.closing = False
        self.readable = asyncio.Event()
        self.readable.set()
        self._throttle: asyncio.TimerHandle | None = None

    def write(self, data: bytes) -> None:
        self.pending.append(data)
        self.pending_bytes += len(data)
        self.wakeup.set()

    # The connection, told when everything pending has been sent (`output_drained`).
    drained: Callable[[], None] | None = None

    def close(self) -> None:
        self.closing = True
        self.wakeup.set()

    def buffered(self) -> int:
        return self.pending_bytes

    def throttle(self, seconds: float) -> None:
        if self._throttle is not None:
            self._throttle.cancel()
        self.readable.clear()
        self._throttle = asyncio.get_running_loop().call_later(seconds, self.resume)

    def resume(self) -> None:
        if self._throttle is not None:
            self._throttle.cancel()
            self._throttle = None
        self.readable.set()

    async def run_writer(self) -> None:
        ws = self.websocket
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.pending:
                data = self.pending.popleft()
                self.pending_bytes -= len(data)
                try:
                    await ws.send(data)  # type: ignore[attr-defined]
                except Exception:
                    self.closing = True
                    break
            if not self.pending and self.drained is not None and not self.closing:
                self.drained()
            if self.closing:
                try:
                    await ws.close()  # type: ignore[attr-defined]
                except Exception:
                    pass
                return


class _WebSocketServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The `websockets` server's logger, except that a failed opening handshake is one line,
    not an ERROR with a traceback: a TCP connect-and-close (what load balancers and Kubernetes
    TCP probes do) logs at debug level, any other bad handshake at info level."""

    def log(self, level: int, msg: object, *args: object, **kwargs: object) -> None:
        if msg == "opening handshake failed":
            exc = sys.exc_info()[1]
            cause = exc.__cause__ if exc is not None and exc.__cause__ is not None else exc
            closed = isinstance(cause, EOFError | ConnectionError)
            log.log(
                logging.DEBUG if closed else logging.INFO,
                "websocket opening handshake failed: %s%s", exc,
                f" ({cause})" if cause is not exc else "",
            )
            return
        super().log(level, msg, *args, **kwargs)  # type: ignore[arg-type]


async def start_websocket_listener(
    service: MqttService, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> object:
    from websockets.typing import Subprotocol

    async def handler(websocket: object) -> None:
        link = WebSocketLink(websocket)
        remote_address = getattr(websocket, "remote_address", None)
        remote = f"{remote_address[0]}:{remote_address[1]}" if remote_address else "ws"
        connection = MqttConnection(service, link, remote, "ws")
        link.drained = connection.output_drained
        transport = getattr(websocket, "transport", None)
        if ssl_context is not None and service.use_identity_as_username and transport is not None:
            connection.certificate_identity = certificate_common_name(transport.get_extra_info("peercert"))
        service.connection_made(connection)
        writer = asyncio.create_task(link.run_writer())
        try:
            async for frame in websocket:  # type: ignore[attr-defined]
                if isinstance(frame, str):
                    connection.close(0x81, "MQTT over WebSocket needs binary frames")
                    break
                connection.data_received(frame)
                if not connection.open:
                    break
                if not link.readable.is_set():
                    await link.readable.wait()
        except Exception as exc:
            log.debug("websocket %s ended: %s", remote, exc)
        finally:
            service.connection_gone(connection)
            link.resume()
            link.close()
            await writer

    offered = [Subprotocol("mqtt"), Subprotocol("mqttv3.1")]

    def select_subprotocol(connection: object, subprotocols: Sequence[Subprotocol]) -> Subprotocol | None:
        for candidate in offered:
            if candidate in subprotocols:
                return candidate
        return None

    return await listen_websocket(
        handler, host, port, ssl_context, name="MQTT over WebSocket", subprotocols=offered,
        select_subprotocol=select_subprotocol, max_size=service.settings.max_packet_size + 8,
        process_request=_check_origin(list(service.settings.ws_allowed_origins)),
        logger=_WebSocketServerLog(logging.getLogger("websockets.server")),
    )
