"""The AMQP connection handshake (AMQP 0-9-1 §4.2.2, class connection): the protocol header,
start/start-ok with PLAIN or AMQPLAIN authentication, tune/tune-ok, open/open-ok, and
connection.close on channel 0. The server properties and capabilities are RabbitMQ's."""

from __future__ import annotations

import asyncio
import logging
import struct

from pamqp import commands, decode

from ... import __version__
from ...core.edge import Principal
from .base import ConnectionBase
from .errors import ConnectionException, ReplyCode
from .frames import FRAME_MIN_SIZE, PROTOCOL_HEADER, State, method_ids

log = logging.getLogger(__name__)


# Connection states as rabbit_reader names them in its error texts.
_RABBIT_STATES = {
    State.AWAIT_START_OK: "starting", State.AWAIT_TUNE_OK: "tuning",
    State.AWAIT_OPEN: "opening", State.OPEN: "running", State.CLOSING: "closing",
}


def _login_text(value: object) -> str | None:
    """An AMQPLAIN LOGIN or PASSWORD field as text (a byte string as UTF-8); None, which
    authentication refuses, for a missing field or one of another type."""
    if isinstance(value, bytes):
        return value.decode()
    return value if isinstance(value, str) else None


class HandshakeMixin(ConnectionBase):
    """Channel 0 up to an open connection, and connection.close from the client."""

    def _protocol_header(self) -> bool:
        buffer = self.buffer
        if len(buffer) < 8:
            if PROTOCOL_HEADER.startswith(bytes(buffer)) or bytes(buffer) == b"AMQP"[: len(buffer)]:
                return False
            self._reject_header()
            return False
        if bytes(buffer[:8]) != PROTOCOL_HEADER:
            self._reject_header()
            return False
        del buffer[:8]
        self.state = State.AWAIT_START_OK
        self.send_method(0, commands.Connection.Start(
            version_major=0, version_minor=9,
            server_properties={
                "product": self.settings.product,
                "version": __version__,
                "platform": "Python",
                "information": "Shardgate multi-protocol message gateway",
                "copyright": "Copyright (c) the Shardgate authors",
                "capabilities": {
                    "publisher_confirms": True,
                    "exchange_exchange_bindings": True,
                    "basic.nack": True,
                    "consumer_cancel_notify": True,
                    "connection.blocked": True,
                    "consumer_priorities": True,
                    "authentication_failure_close": True,
                    "per_consumer_qos": True,
                    "direct_reply_to": True,
                },
            },
            mechanisms="PLAIN AMQPLAIN", locales="en_US",
        ))
        return True

    def _reject_header(self) -> None:
        """Not an AMQP 0-9-1 header: answer with ours and close (§4.2.2)."""
        log.info("%s sent a bad protocol header %r", self.remote, bytes(self.buffer[:8]))
        self.buffer.clear()
        self._write(PROTOCOL_HEADER)
        self.state = State.CLOSING
        self.close_after_flush = True

    # ================================================================== connection class
    def _connection_method(self, value: commands.base.Frame) -> None:
        state = self.state
        if isinstance(value, commands.Connection.Close):
            if self.close_reason is None:
                self.close_reason = "client sent connection.close"
            self.send_method(0, commands.Connection.CloseOk())
            self.state = State.CLOSING
            self.close_after_flush = True
            self._release_all()
            return
        if state is State.AWAIT_START_OK and isinstance(value, commands.Connection.StartOk):
            self._start_ok(value)
        elif state is State.AWAIT_TUNE_OK and isinstance(value, commands.Connection.TuneOk):
            self._tune_ok(value)
        elif state is State.AWAIT_OPEN and isinstance(value, commands.Connection.Open):
            self._open(value)
        elif isinstance(value, commands.Connection.UpdateSecret) and state is State.OPEN:
            self.send_method(0, commands.Connection.UpdateSecretOk())
        else:
            # rabbit_reader:handle_method0/2 for anything else on channel 0.
            raise ConnectionException(
                ReplyCode.CHANNEL_ERROR,
                f"unexpected method in connection state {_RABBIT_STATES.get(state, 'running')}",
                *method_ids(value),
            )

    def _start_ok(self, frame: commands.Connection.StartOk) -> None:
        self.client_properties = dict(frame.client_properties or {})
        caps = self.client_properties.get("capabilities")
        self.capabilities = dict(caps) if isinstance(caps, dict) else {}
        response = frame.response
        raw = response.encode("utf-8") if isinstance(response, str) else bytes(response or b"")
        user = password = None
        if frame.mechanism == "PLAIN":
            parts = raw.split(b"\x00")
            if len(parts) == 3:
                user, password = parts[1].decode("utf-8", "replace"), parts[2].decode("utf-8", "replace")
        elif frame.mechanism == "AMQPLAIN":
            try:
                _, table = decode.field_table(struct.pack(">I", len(raw)) + raw)
                login, secret = table.get("LOGIN"), table.get("PASSWORD")
                user, password = _login_text(login), _login_text(secret)
            except (ValueError, UnicodeDecodeError):
                pass
        else:
            raise ConnectionException(
                ReplyCode.ACCESS_REFUSED,
                f"unsupported authentication mechanism '{frame.mechanism}'", *method_ids(frame),
            )
        refusal = self.service.authenticate(user, password, self.loopback, self.remote)
        if isinstance(refusal, asyncio.Future):
            # A password is being hashed off the event loop: read no further frames until
            # the verdict is in (the handshake timeout still runs).
            self.hold()
            mechanism = str(frame.mechanism)
            refusal.add_done_callback(lambda done: self._login_checked(done, mechanism, user))
            return
        self._logged_in(refusal, str(frame.mechanism), user)

    def _login_checked(self, done: asyncio.Future[str | None], mechanism: str, user: str | None) -> None:
        self._holds -= 1
        if self.state is not State.AWAIT_START_OK:
            return  # closed meanwhile
        try:
            self._logged_in(done.result(), mechanism, user)
        except ConnectionException as exc:
            self.close(exc)
        self._request_flush()
        self.resume_reading()

    def _logged_in(self, refusal: str | None, mechanism: str, user: str | None) -> None:
        if refusal is not None:
            # rabbit_reader:auth_fail/5 names the mechanism the client used; class and method 0.
            refusal = refusal.replace("mechanism PLAIN or AMQPLAIN", f"mechanism {mechanism}")
            raise ConnectionException(ReplyCode.ACCESS_REFUSED, refusal)
        self.username = str(user)
        # ACL rules see AMQP clients by user only (no client id for `client =` or `%c`).
        self.principal = Principal("amqp", self.username, "", self.remote)
        self.state = State.AWAIT_TUNE_OK
        self.send_method(0, commands.Connection.Tune(
            channel_max=self.settings.channel_max, frame_max=self.settings.frame_max,
            heartbeat=self.settings.heartbeat,
        ))

    def _tune_ok(self, frame: commands.Connection.TuneOk) -> None:
        settings = self.settings
        frame_max = frame.frame_max or settings.frame_max
        channel_max = frame.channel_max or settings.channel_max
        problem = None
        if frame_max < FRAME_MIN_SIZE or frame_max > settings.frame_max:
            problem = f"frame_max={frame_max} outside [{FRAME_MIN_SIZE}, {settings.frame_max}]"
        elif channel_max > settings.channel_max:
            problem = f"channel_max={channel_max} above the server's {settings.channel_max}"
        if problem is not None:
            # rabbit_reader: an error while tuning is a handshake error, and the socket is
            # closed without a connection.close (the client is not trusted yet).
            log.info("AMQP handshake of %s refused: %s", self.remote, problem)
            self.state = State.CLOSING
            self.close_after_flush = True
            self._request_flush()
            return
        self.frame_max = frame_max
        self.channel_max = channel_max
        self.heartbeat = frame.heartbeat
        self.state = State.AWAIT_OPEN

    def _open(self, frame: commands.Connection.Open) -> None:
        vhost = self.service.vhost(frame.virtual_host)
        if vhost is None:
            raise ConnectionException(
                ReplyCode.NOT_ALLOWED, f"vhost {frame.virtual_host} not found", *method_ids(frame)
            )
        self.vhost = vhost
        self.state = State.OPEN
        self.service.connection_opened(self)
        self.send_method(0, commands.Connection.OpenOk())
