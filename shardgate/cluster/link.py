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

The accepting end is the cluster port (`cluster_port.py`).

A peer whose process is frozen (SIGSTOP, a stalled VM) keeps its connections open: its kernel
even accepts new ones. So a dialing node asks for heartbeats in its hello (`heartbeat_ms`):
the accepting end answers the hello at once and writes a heartbeat reply whenever it has
written nothing for a third of that time, and the dialing end gives the connection up when it
has heard nothing for the whole time (`LinkClient.silent_for`; `peer_link.PeerLink` decides).
Hearing the peer does not prove that it hears this end, so both ends also have their kernel
end the connection once what they wrote went unacknowledged for that time
(`give_up_unacknowledged`: a path that loses one end's frames, or its bigger packets only).

`FrameReader` and `frame_bytes` are sans-IO; `LinkClient` only moves bytes and calls back into
the link that dialed it (`peer_link.PeerLink`), which owns every decision.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable
from typing import cast

from google.protobuf.message import DecodeError

from ..proto import cluster_pb2 as pb
from .link_auth import (
    HANDSHAKE_MAX_BYTES,
    LINK_MAGIC,
    DialerHandshake,
    HandshakeError,
    NodeCredentials,
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
HEARTBEAT = pb.PeerReply(heartbeat=True)


class PeerEnded(ConnectionError):
    """The peer closed the link in order (a node stopping): it is redialed, without alarm."""


class LinkForgotten(ConnectionError):
    """The receiving node forgot the peer's link session (the peer left its view while this
    stream stayed open): the stream ends, and the peer resumes its session on a new one."""


class FrameError(ValueError):
    """Bytes on a link that are not frames of this protocol."""


class LinkRefused(ConnectionError):
    """The peer did not prove it belongs to the cluster, or refused this node's proof."""


def frame_bytes(message: pb.PeerFrame | pb.PeerReply) -> bytes:
    """One frame on the wire: its length (4 bytes, big endian), then the message."""
    data: bytes = message.SerializeToString()
    return _HEADER.pack(len(data)) + data


HEARTBEAT_BYTES = frame_bytes(HEARTBEAT)


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


def keepalive(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def give_up_unacknowledged(transport: asyncio.BaseTransport, timeout_s: float) -> None:
    """Have the kernel end the connection once bytes written on it went unacknowledged by the
    peer's kernel for `timeout_s` (TCP_USER_TIMEOUT, Linux). The heartbeats prove that the
    peer's end runs and that its bytes reach this one, not that this end's reach it: where the
    path drops only what one end sends, or only its bigger packets (a path-MTU black hole),
    the peer's small heartbeats and acknowledgements still arrive while every frame of this
    end is lost, and TCP would send them again for about 15 minutes. A peer that is alive but
    slow to read (its window shut) answers the kernel's probes, so it is not given up on."""
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    sock = transport.get_extra_info("socket")
    if option is None or sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, max(1, round(timeout_s * 1000)))
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
        unacknowledged_s: float | None = None,
    ) -> None:
        self._on_reply = on_reply
        self._unacknowledged_s = unacknowledged_s
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
        keepalive(stream)
        if self._unacknowledged_s is not None:
            give_up_unacknowledged(stream, self._unacknowledged_s)
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
