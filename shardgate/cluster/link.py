"""The byte transport of the peer links: length-prefixed protobuf frames (`PeerFrame` one way,
`PeerReply` the other, `proto/cluster.proto`) over one TCP connection per link, read and
written by the event loop itself.

Why not a gRPC stream, as the links first were: grpc.aio hands every message it reads or
writes to the event loop from a poller thread, and under load each hand-off waits for the GIL
and for a core. A receiver then took in a few hundred frames a second, one hand-off each, and
fell behind the sender, whose writes went on filling gRPC's buffers: at 5,000 msg/s on a busy
2-core machine the pushes to a subscriber's node reached a p99 of 200-550 ms, with the node
itself mostly idle. On a plain socket one read takes everything that arrived, many frames at
once, and a write is one `send` from the loop: the batching follows the load by itself.

The cluster port serves both: a connection that opens with `LINK_MAGIC` is a peer's link,
which first proves on both sides that it belongs to the cluster (`link_auth.py`: the shared
secret by challenge and response, and the dialer's identity against its etcd registration);
anything else (the shared-state gRPC calls of `state_rpc.py` and `shard_reader.py`) is passed
through, byte for byte, to the node's gRPC server on a loopback port. So a node still has one
cluster address to advertise and to open in a firewall.

A peer whose process is frozen (SIGSTOP, a stalled VM) keeps its connections open: its kernel
even accepts new ones. So a dialing node asks for heartbeats in its hello (`heartbeat_ms`):
the accepting end answers the hello at once and writes a heartbeat reply whenever it has
written nothing for a third of that time, and the dialing end gives the connection up when it
has heard nothing for the whole time (`LinkClient.silent_for`; `peer_link.PeerLink` decides).

`FrameReader` and `frame_bytes` are sans-IO; the protocols below only move bytes and call
back into the data plane (`data_plane.py` and its pieces), which owns every decision.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Callable
from typing import Protocol, cast

from google.protobuf.message import DecodeError

from ..proto import cluster_pb2 as pb
from .link_auth import (
    ACCEPTED,
    HANDSHAKE_MAX_BYTES,
    HANDSHAKE_TIMEOUT_S,
    IDENTITY_WAIT_S,
    LINK_MAGIC,
    AcceptorHandshake,
    DialerHandshake,
    HandshakeError,
    NodeCredentials,
    refusal,
)

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
# A frame holds at most a few MiB of messages (outbox.py bounds it) but one message, or the
# retained messages sent when a link opens, may be big; beyond this the peer is not one of ours.
MAX_FRAME_BYTES = 512 << 20
# Above this many bytes waiting in the transport a link stops writing frames (and its
# messages gather into bigger ones) until the peer has read most of them.
WRITE_HIGH_WATER = 1 << 20
WRITE_LOW_WATER = 256 << 10


# What the accepting end of a link sends when it has nothing else to say (see above).
_HEARTBEAT = pb.PeerReply(heartbeat=True)


class PeerEnded(ConnectionError):
    """The peer closed the link in order (a node stopping): it is redialed, without alarm."""


class LinkForgotten(ConnectionError):
    """The receiving node forgot the peer's link session (the peer left its view while this
    stream stayed open): the stream ends, and the peer resumes its session on a new one."""


class FrameError(ValueError):
    """Bytes on a link that are not frames of this protocol."""


class LinkRefused(ConnectionError):
    """The peer did not prove it belongs to the cluster, or refused this node's proof."""


# Refused connections on the cluster port are logged at most this often (a stranger may try
# many times a second); the others are counted and said with the next line.
_REFUSAL_LOG_S = 10.0
_refusals = {"logged_at": -_REFUSAL_LOG_S, "quiet": 0}


def _log_refusal(remote: str, reason: str) -> None:
    now = time.monotonic()
    if now - _refusals["logged_at"] < _REFUSAL_LOG_S:
        _refusals["quiet"] += 1
        return
    quiet, _refusals["quiet"], _refusals["logged_at"] = _refusals["quiet"], 0, now
    more = f" ({quiet} more refused since the last such line)" if quiet else ""
    log.warning("cluster port: refused a link from %s: %s%s", remote, reason, more)


def frame_bytes(message: pb.PeerFrame | pb.PeerReply) -> bytes:
    """One frame on the wire: its length (4 bytes, big endian), then the message."""
    data = message.SerializeToString()
    return _HEADER.pack(len(data)) + data


_HEARTBEAT_BYTES = frame_bytes(_HEARTBEAT)


class FrameReader:
    """Bytes in, the payloads of the complete frames among them out (sans-IO)."""

    __slots__ = ("_buffer", "limit")

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        # the largest frame accepted (small while a link's handshake runs)
        self.limit = limit

    def feed(self, data: bytes, most: int = 0) -> list[bytes]:
        """The complete frames so far (at most `most` of them when it is not 0: the others
        stay buffered, for a next call that may allow bigger frames)."""
        buffer = self._buffer
        buffer += data
        frames: list[bytes] = []
        position, end = 0, len(buffer)
        limit = self.limit
        while end - position >= 4 and not (most and len(frames) >= most):
            (size,) = _HEADER.unpack_from(buffer, position)
            if size > limit:
                raise FrameError(f"a frame of {size} bytes (at most {limit})")
            stop = position + 4 + size
            if stop > end:
                break
            frames.append(bytes(buffer[position + 4:stop]))
            position = stop
        if position:
            del buffer[:position]
        return frames


def _keepalive(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class LinkClient(asyncio.Protocol):
    """The dialing end of one link connection: proves this node (`credentials`) to the peer
    and the peer to this node (it must be node `peer`), then sends frames and hands each reply
    to `on_reply`. Frames sent before the handshake ends wait for it. `closed` resolves with
    why the connection ended."""

    def __init__(
        self, on_reply: Callable[[pb.PeerReply], None], on_writable: Callable[[], None],
        credentials: NodeCredentials | None = None, peer: str | None = None,
    ) -> None:
        self._on_reply = on_reply
        self._on_writable = on_writable
        self._reader = FrameReader(HANDSHAKE_MAX_BYTES)
        self._handshake: DialerHandshake | None = DialerHandshake(
            credentials or NodeCredentials(""), peer)
        # frames sent before the peer proved itself (None once it did)
        self._waiting: list[bytes] | None = []
        self.transport: asyncio.Transport | None = None
        self.paused = False
        loop = asyncio.get_running_loop()
        self._loop = loop
        self.closed: asyncio.Future[BaseException] = loop.create_future()
        # Resolved by the first bytes the peer sends (the answer to the hello).
        self.answered: asyncio.Future[None] = loop.create_future()
        self._heard_at = loop.time()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)
        self.transport = stream
        _keepalive(stream)
        stream.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)
        assert self._handshake is not None
        stream.write(LINK_MAGIC + self._handshake.hello())

    def send(self, frame: pb.PeerFrame) -> None:
        """Write `frame`. On a connection already ending (the peer's EOF arrives before the
        link's task has seen the end) nothing is written: the sender keeps every frame until
        it is answered and sends it again on the next connection of the session."""
        transport = self.transport
        assert transport is not None
        if transport.is_closing():
            return
        if self._waiting is not None:
            self._waiting.append(frame_bytes(frame))
            return
        transport.write(frame_bytes(frame))

    @property
    def closing(self) -> bool:
        """The connection is ending (or ended): frames sent now are not written."""
        return self.transport is None or self.transport.is_closing()

    def data_received(self, data: bytes) -> None:
        self._heard_at = self._loop.time()
        try:
            handshake = self._handshake
            while handshake is not None:
                message = self._reader.feed(data, 1)
                data = b""
                if not message:
                    return
                if self._waiting is not None:
                    proof = handshake.answer(message[0])
                    # the frames go with the proof: the peer holds them until it accepts
                    waiting, self._waiting = self._waiting, None
                    assert self.transport is not None
                    self.transport.write(b"".join([proof, *waiting]))
                else:
                    handshake.accepted(message[0])
                    self._handshake = handshake = None
                    self._reader.limit = MAX_FRAME_BYTES
            payloads = self._reader.feed(data)
            if payloads and not self.answered.done():
                self.answered.set_result(None)
            for payload in payloads:
                self._on_reply(pb.PeerReply.FromString(payload))
        except HandshakeError as exc:
            self._end(LinkRefused(str(exc)))
        except (FrameError, DecodeError) as exc:
            self._end(ConnectionError(f"malformed reply on the link: {exc}"))

    def silent_for(self) -> float:
        """Seconds since the peer last sent anything (since the connection opened, at first)."""
        return self._loop.time() - self._heard_at

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._on_writable()

    def eof_received(self) -> bool:
        self._end(PeerEnded("the peer ended the link"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc or ConnectionError("the link was closed"))

    def _end(self, exc: BaseException) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def close(self) -> None:
        self._end(ConnectionError("the link was closed"))


class LinkReceiver(Protocol):
    """What the receiving end calls (the data plane's `inbox.Inboxes`)."""

    def link_opened(self, peer: str, session: int, reply: Callable[[pb.PeerReply], None]) -> None: ...

    def receive(self, peer: str, frame: pb.PeerFrame, reply: Callable[[pb.PeerReply], None]) -> None: ...

    def peer_link_ended(self, peer: str, reply: Callable[[pb.PeerReply], None]) -> None: ...


class LinkReplies:
    """Where the replies of one accepted link connection go (`reply(frame)`), and that
    connection's reading paused and resumed: the data plane holds a peer's link this way
    while the pushes it carries fill a subscriber's queue (back-pressure)."""

    __slots__ = ("_connection",)

    def __init__(self, connection: ClusterPortProtocol) -> None:
        self._connection = connection

    def __call__(self, reply: pb.PeerReply) -> None:
        self._connection._send(reply)

    def pause_reading(self) -> None:
        transport = self._connection.transport
        if transport is not None and not transport.is_closing() and transport.is_reading():
            transport.pause_reading()

    def resume_reading(self) -> None:
        transport = self._connection.transport
        if transport is not None and not transport.is_closing() and not transport.is_reading():
            transport.resume_reading()


class ClusterPortProtocol(asyncio.Protocol):
    """One connection accepted on the cluster port: a peer's link (it opens with
    `LINK_MAGIC`, then proves itself: `link_auth.py`), or anything else, passed through to the
    gRPC server at `grpc_address` (which authenticates each call itself).
    `registered(node, instance)` says whether etcd has that node registered by that instance."""

    def __init__(
        self, receiver: LinkReceiver, grpc_address: tuple[str, int],
        connections: set[ClusterPortProtocol], credentials: NodeCredentials | None = None,
        registered: Callable[[str, str], bool] | None = None,
    ) -> None:
        self._receiver = receiver
        self._grpc_address = grpc_address
        self._connections = connections
        self._credentials = credentials or NodeCredentials("")
        self._registered = registered or (lambda node, instance: True)
        self.transport: asyncio.Transport | None = None
        self._head = bytearray()
        self._mode = ""  # "", "auth" (handshake), "wait" (for the registration), "link" or "grpc"
        self._deadline: asyncio.TimerHandle | None = None
        # link mode
        self._reader = FrameReader(HANDSHAKE_MAX_BYTES)
        self._handshake: AcceptorHandshake | None = None
        # the node that proved itself, and frames that arrived before its registration was seen
        self._node = ""
        self._instance = ""
        self._held: list[bytes] = []
        self._peer = ""
        # Replies made while a read is applied leave together at its end; others at once.
        self._out: list[bytes] | None = None
        # Heartbeats asked for by the dialing node (its hello's `heartbeat_ms`).
        self._heartbeat_s = 0.0
        self._heartbeat: asyncio.TimerHandle | None = None
        self._wrote_at = 0.0
        # One object for the whole connection: the data plane compares it by identity.
        self._reply = LinkReplies(self)
        # pass-through mode
        self._upstream: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._connections.add(self)
        self._deadline = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT_S, self._too_slow)

    def _too_slow(self) -> None:
        self._deadline = None
        if self._mode in ("", "auth", "wait"):
            _log_refusal(self._remote(), f"no complete handshake within {HANDSHAKE_TIMEOUT_S:g} s"
                         + (f" (claimed node {self._node})" if self._node else ""))
            self._abort()

    def _settled(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def data_received(self, data: bytes) -> None:
        mode = self._mode
        if mode == "link":
            self._frames(data)
        elif mode == "grpc":
            self._pass(data)
        elif mode == "auth":
            self._authenticate(data)
        elif mode == "wait":
            try:
                self._held += self._reader.feed(data)
            except FrameError as exc:
                self._refuse(str(exc))
        else:
            self._head += data
            head = bytes(self._head)
            if len(head) < len(LINK_MAGIC) and LINK_MAGIC.startswith(head):
                return  # not enough to tell yet
            self._head = bytearray()
            if head.startswith(LINK_MAGIC):
                self._mode = "auth"
                self._handshake = AcceptorHandshake(self._credentials)
                _keepalive(self.transport)  # type: ignore[arg-type]
                self._authenticate(head[len(LINK_MAGIC):])
            else:
                self._mode = "grpc"
                self._settled()
                self._open_upstream(head)

    # ------------------------------------------------------------ the handshake
    def _authenticate(self, data: bytes) -> None:
        handshake = self._handshake
        assert handshake is not None
        try:
            payloads = self._reader.feed(data, 1)
            while payloads and not self._node:
                if not handshake.claimed:
                    self._write(handshake.challenge(payloads[0]))
                else:
                    self._node, self._instance = handshake.verify(payloads[0])
                    break
                payloads = self._reader.feed(b"", 1)
            if not self._node:
                return
            # proven: the frames may be big from now on
            self._handshake = None
            self._reader.limit = MAX_FRAME_BYTES
            self._held = self._reader.feed(b"")
        except (HandshakeError, FrameError) as exc:
            self._refuse(str(exc))
            return
        self._mode = "wait"
        self._identify(asyncio.get_running_loop().time() + IDENTITY_WAIT_S)

    def _identify(self, until: float) -> None:
        """Open the link once etcd has the node registered by the instance that proved itself
        (this node's watch may see a node that has just registered a moment later)."""
        transport = self.transport
        if self._mode != "wait" or transport is None or transport.is_closing():
            return
        loop = asyncio.get_running_loop()
        if self._registered(self._node, self._instance):
            self._mode = "link"
            self._settled()
            transport.write(ACCEPTED)
            transport.resume_reading()
            held, self._held = self._held, []
            self._apply(held)
            return
        if loop.time() >= until:
            self._refuse(f"node {self._node} (instance {self._instance or '-'}) is not "
                         "registered in the cluster")
            return
        transport.pause_reading()
        loop.call_later(0.05, self._identify, until)

    def _refuse(self, reason: str) -> None:
        claimed = self._handshake.claimed if self._handshake is not None else self._node
        _log_refusal(self._remote(), reason + (f" (claimed node {claimed})" if claimed else ""))
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(refusal(reason))
            transport.close()  # (the refusal is written first)

    # ------------------------------------------------------------ a peer's link
    def _frames(self, data: bytes) -> None:
        try:
            payloads = self._reader.feed(data)
        except FrameError as exc:
            log.warning("cluster link from %s refused: %s", self._peer or self._remote(), exc)
            self._abort()
            return
        self._apply(payloads)

    def _apply(self, payloads: list[bytes]) -> None:
        receiver = self._receiver
        self._out = []
        try:
            for payload in payloads:
                frame = pb.PeerFrame.FromString(payload)
                if frame.from_node:
                    if frame.from_node != self._node:
                        raise FrameError(f"node {self._node} sent frames of node {frame.from_node}")
                    self._peer = frame.from_node
                    receiver.link_opened(self._peer, frame.session, self._reply)
                    if frame.heartbeat_ms:
                        self._start_heartbeats(frame.heartbeat_ms / 1000)
                if not self._peer:
                    raise FrameError("the first frame of a link must name its node")
                receiver.receive(self._peer, frame, self._reply)
        except LinkForgotten as exc:
            log.info("cluster link from %s ended: %s", self._peer, exc)
            self._abort()
        except (FrameError, DecodeError) as exc:
            log.warning("cluster link from %s refused: %s", self._peer or self._remote(), exc)
            self._abort()
        except Exception:  # noqa: BLE001 - a bad peer ends its own link only
            log.exception("cluster link from %s failed", self._peer or self._remote())
            self._abort()
        finally:
            out, self._out = self._out, None
            if out:
                self._write(b"".join(out))

    def _send(self, reply: pb.PeerReply) -> None:
        """Send a reply: at the end of the read being applied (the replies of one read leave
        in one write), else at once (a reply that waited for a journal commit)."""
        data = frame_bytes(reply)
        if self._out is not None:
            self._out.append(data)
        else:
            self._write(data)

    def _write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)
            if self._heartbeat_s:
                self._wrote_at = asyncio.get_running_loop().time()

    def _start_heartbeats(self, interval_s: float) -> None:
        """Answer the hello now, then keep the dialing node hearing from this end at least
        every third of `interval_s` (see the module docstring)."""
        self._heartbeat_s = max(0.03, interval_s / 3)
        self._send(_HEARTBEAT)
        if self._heartbeat is None:
            self._heartbeat = asyncio.get_running_loop().call_later(self._heartbeat_s, self._beat)

    def _beat(self) -> None:
        loop = asyncio.get_running_loop()
        transport = self.transport
        if transport is None or transport.is_closing():
            self._heartbeat = None
            return
        if loop.time() - self._wrote_at >= self._heartbeat_s * 0.9:
            self._write(_HEARTBEAT_BYTES)
        self._heartbeat = loop.call_later(self._heartbeat_s, self._beat)

    # ------------------------------------------------------------ gRPC, passed through
    def _open_upstream(self, head: bytes) -> None:
        transport = self.transport
        assert transport is not None
        transport.pause_reading()

        async def dial() -> None:
            try:
                upstream, _pipe = await asyncio.get_running_loop().create_connection(
                    lambda: _Pipe(transport), *self._grpc_address)
            except OSError as exc:
                log.warning("cluster port: cannot reach the node's gRPC server: %s", exc)
                transport.abort()
                return
            if transport.is_closing():
                upstream.close()
                return
            self._upstream = upstream
            upstream.write(head)
            transport.resume_reading()

        asyncio.get_running_loop().create_task(dial())

    def _pass(self, data: bytes) -> None:
        if self._upstream is not None:
            self._upstream.write(data)

    def pause_writing(self) -> None:
        if self._upstream is not None:
            self._upstream.pause_reading()

    def resume_writing(self) -> None:
        if self._upstream is not None:
            self._upstream.resume_reading()

    # ------------------------------------------------------------ both
    def _remote(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return str(peer)

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    @property
    def peer(self) -> str:
        """The node whose link this connection carries ("" before its hello, or not a link)."""
        return self._peer

    def close(self) -> None:
        self._abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        self._settled()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        if self._upstream is not None:
            self._upstream.close()
        if self._peer:
            self._receiver.peer_link_ended(self._peer, self._reply)


class _Pipe(asyncio.Protocol):
    """The node's side of a passed-through connection: what the gRPC server sends goes back
    to the client, with back-pressure both ways."""

    def __init__(self, downstream: asyncio.Transport) -> None:
        self._downstream = downstream
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self._downstream.is_closing():
            self._downstream.write(data)

    def pause_writing(self) -> None:
        if not self._downstream.is_closing():
            self._downstream.pause_reading()

    def resume_writing(self) -> None:
        if not self._downstream.is_closing():
            self._downstream.resume_reading()

    def eof_received(self) -> bool:
        if self._downstream.can_write_eof() and not self._downstream.is_closing():
            self._downstream.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._downstream.close()
