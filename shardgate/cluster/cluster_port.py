"""The cluster port: the accepting end of the peers' links, and the door to the node's
shared-state gRPC calls.

A connection that opens with `LINK_MAGIC` is a peer's link,
which first proves on both sides that it belongs to the cluster (`link_auth.py`: the shared
secret by challenge and response, and the dialer's identity against its etcd registration);
anything else (the shared-state gRPC calls of `state_rpc.py` and `shard_reader.py`) is passed
through, byte for byte, to the node's gRPC server on a loopback port. So a node still has one
cluster address to advertise and to open in a firewall.

An accepted link is handed frame by frame to a `LinkReceiver` (the data plane's
`inbox.Inboxes`), which owns every decision; this module only moves bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from google.protobuf.message import DecodeError

from ..proto import cluster_pb2 as pb
from .link import (
    HEARTBEAT,
    HEARTBEAT_BYTES,
    MAX_FRAME_BYTES,
    FrameError,
    FrameReader,
    LinkForgotten,
    frame_bytes,
    give_up_unacknowledged,
    keepalive,
)
from .link_auth import (
    ACCEPTED,
    HANDSHAKE_MAX_BYTES,
    HANDSHAKE_TIMEOUT_S,
    IDENTITY_WAIT_S,
    LINK_MAGIC,
    AcceptorHandshake,
    HandshakeError,
    NodeCredentials,
    refusal,
)

log = logging.getLogger(__name__)

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
                keepalive(self.transport)  # type: ignore[arg-type]
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
                        if self.transport is not None:
                            # replies this end cannot get across end the connection as
                            # frames the dialer cannot get across do (`link.py`)
                            give_up_unacknowledged(self.transport, frame.heartbeat_ms / 1000)
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
        self._send(HEARTBEAT)
        if self._heartbeat is None:
            self._heartbeat = asyncio.get_running_loop().call_later(self._heartbeat_s, self._beat)

    def _beat(self) -> None:
        loop = asyncio.get_running_loop()
        transport = self.transport
        if transport is None or transport.is_closing():
            self._heartbeat = None
            return
        if loop.time() - self._wrote_at >= self._heartbeat_s * 0.9:
            self._write(HEARTBEAT_BYTES)
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
