"""Node authentication on the cluster port: every node proves it knows the cluster's shared
secret before the other says anything of its own, as an Erlang node proves its cookie or a
Kafka broker authenticates to another with SASL. The secret itself never crosses the wire.

A peer link (`link.py`) opens with `LINK_MAGIC`, then three handshake messages (each a JSON
object behind a 4-byte length, at most `HANDSHAKE_MAX_BYTES`), then the link's frames:

    dialer   -> acceptor  {"node": D, "instance": I, "nonce": Nd}
    acceptor -> dialer    {"node": A, "nonce": Na, "proof": HMAC(k, accept, Nd, Na, A, D, I)}
                          (or {"refused": reason}, then the acceptor closes)
    dialer   -> acceptor  {"proof": HMAC(k, dial, Nd, Na, D, I, A)}, then its first frames
    acceptor -> dialer    {"accepted": true} (or {"refused": reason}, then it closes)

where k is derived from the secret, Nd and Na are 32 random bytes each side picks anew for
every connection (so no proof can be replayed), and the labels keep a proof of one side from
being reflected as the other's. Each side compares with `hmac.compare_digest`. The dialer
checks that the acceptor is the node it meant to dial; the acceptor then checks that the
dialer's claimed id is registered in etcd by the same node instance (the identity of its data
directory, `control.node_instance`), waiting a little for its watch to see a node that has
just registered. Only then does the link's first frame count; a link's frames must all name
that node. The registration itself is written by each node to etcd (under etcd's own
credentials) and never by a peer over its link.

The gRPC calls one node makes on another (session handover, shard reads, AMQP queue methods,
relayed durable consumers) are passed through the cluster port to the node's internal gRPC
server (`link.py`). Each call carries `x-shardgate-node`, `x-shardgate-instance` and
`x-shardgate-auth: <unix ms>.<nonce>.<HMAC(k, call, node, instance, method, ms, nonce)>`;
the server refuses (UNAUTHENTICATED) a call without a valid one, signed more than `CALL_SKEW_S`
away from its own clock (node clocks are kept in step, NTP), with a nonce it has seen, or
from a node not registered under that instance.

Without a secret (`[cluster] insecure = true`, `--insecure-cluster`) the same handshake runs
with an empty key: node identities are still checked against etcd, but anyone who can reach
the cluster port can claim one. `attach.connect` refuses to start a node with neither.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from .link_tls import ClusterTls

# The first bytes a dialing node sends on the cluster port (an HTTP/2 client sends "PRI * ").
# Version 2: the authenticated handshake follows (version 1 had none).
LINK_MAGIC = b"SGLINK2\n"
HANDSHAKE_MAX_BYTES = 4096
# An accepted connection that has not finished its handshake by then is closed.
HANDSHAKE_TIMEOUT_S = 10.0
# How long the acceptor waits for its view of etcd to show the dialer's registration.
IDENTITY_WAIT_S = 5.0
# How far a call's signing time may be from this node's clock.
CALL_SKEW_S = 120.0
# A secret shorter than this is refused: it could be guessed from a captured handshake.
MIN_SECRET_BYTES = 16

NODE_HEADER = "x-shardgate-node"
INSTANCE_HEADER = "x-shardgate-instance"
AUTH_HEADER = "x-shardgate-auth"

_HEADER = struct.Struct(">I")


class HandshakeError(Exception):
    """The other end did not prove it belongs to the cluster (or broke the handshake)."""


@dataclass(frozen=True, slots=True)
class NodeCredentials:
    """Who this node is on the cluster port, and the secret it proves. An empty secret: the
    cluster runs without node authentication (`insecure`)."""

    node_id: str
    instance: str = ""
    secret: bytes = b""
    # TLS on the cluster port (`link_tls.py`), or None: authenticated, not encrypted
    tls: ClusterTls | None = None

    @property
    def key(self) -> bytes:
        return _derive(self.secret, b"shardgate cluster key v1")

    @property
    def authenticated(self) -> bool:
        return bool(self.secret)


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, label, hashlib.sha256).digest()


def _mac(key: bytes, *parts: str | bytes) -> bytes:
    """HMAC-SHA256 over `parts`, each behind its length (no two lists of parts collide)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        mac.update(_HEADER.pack(len(data)))
        mac.update(data)
    return mac.digest()


def secret_check(secret: bytes, salt: bytes | None = None) -> str:
    """What a node puts in its etcd registration so that a node started with another secret
    sees the mismatch at once and refuses to start (`attach.connect`): `salt.HMAC(salt)`."""
    salt = os.urandom(16) if salt is None else salt
    return f"{salt.hex()}.{_mac(_derive(secret, b'shardgate cluster check v1'), salt).hex()}"


def secret_matches(secret: bytes, check: str) -> bool:
    salt, _, _mac_hex = check.partition(".")
    try:
        expected = secret_check(secret, bytes.fromhex(salt))
    except ValueError:
        return False
    return hmac.compare_digest(expected.encode(), check.encode())


def _message(data: dict[str, str]) -> bytes:
    body = json.dumps(data, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


def _accepted() -> bytes:
    body = b'{"accepted":true}'
    return _HEADER.pack(len(body)) + body


# The acceptor's last handshake message: the dialer's identity is registered; frames follow.
ACCEPTED = _accepted()


def refusal(reason: str) -> bytes:
    """The acceptor's answer to a hello it refuses (then it closes the connection)."""
    return _message({"refused": reason})


def _parse(payload: bytes, *fields: str) -> dict[str, str]:
    try:
        data = json.loads(payload)
    except ValueError:
        raise HandshakeError("the handshake message is not JSON") from None
    if not isinstance(data, dict):
        raise HandshakeError("the handshake message is not an object")
    refused = data.get("refused")
    if isinstance(refused, str):
        raise HandshakeError(f"refused: {refused}")
    for name in fields:
        if not isinstance(data.get(name), str):
            raise HandshakeError(f"the handshake message has no {name!r}")
    return data


def _nonce(data: dict[str, str]) -> bytes:
    try:
        nonce = bytes.fromhex(data["nonce"])
    except ValueError:
        raise HandshakeError("the handshake nonce is not hex") from None
    if len(nonce) != 32:
        raise HandshakeError("the handshake nonce is not 32 bytes")
    return nonce


def _proof(data: dict[str, str]) -> bytes:
    try:
        return bytes.fromhex(data["proof"])
    except ValueError:
        raise HandshakeError("the handshake proof is not hex") from None


class DialerHandshake:
    """The dialing end (sans-IO): `hello()` to send, then `answer(challenge)` gives the proof
    to send, once the acceptor proved itself as `peer` (any node when `peer` is None)."""

    __slots__ = ("_credentials", "_nonce", "_peer")

    def __init__(self, credentials: NodeCredentials, peer: str | None) -> None:
        self._credentials = credentials
        self._peer = peer
        self._nonce = os.urandom(32)

    def hello(self) -> bytes:
        me = self._credentials
        return _message({"node": me.node_id, "instance": me.instance, "nonce": self._nonce.hex()})

    def answer(self, payload: bytes) -> bytes:
        me = self._credentials
        data = _parse(payload, "node", "nonce", "proof")
        node, theirs = data["node"], _nonce(data)
        if self._peer is not None and node != self._peer:
            raise HandshakeError(f"dialed node {self._peer} but node {node} answered")
        key = me.key
        expected = _mac(key, b"accept", self._nonce, theirs, node, me.node_id, me.instance)
        if not hmac.compare_digest(expected, _proof(data)):
            raise HandshakeError(f"node {node} did not prove the cluster secret "
                                 "(the two nodes' [cluster] secrets differ)")
        return _message({"proof": _mac(key, b"dial", self._nonce, theirs, me.node_id,
                                       me.instance, node).hex()})

    def accepted(self, payload: bytes) -> None:
        """The acceptor's last word: accepted, or `HandshakeError` with its reason."""
        try:
            data = json.loads(payload)
        except ValueError:
            raise HandshakeError("the handshake message is not JSON") from None
        if not isinstance(data, dict) or data.get("accepted") is not True:
            _parse(payload)  # says why (refused), if it does
            raise HandshakeError("the peer did not accept the link")


class AcceptorHandshake:
    """The accepting end (sans-IO): `challenge(hello)` to send, then `verify(proof)` names the
    node and instance that proved the secret (`HandshakeError` otherwise)."""

    __slots__ = ("_credentials", "_instance", "_node", "_theirs", "_nonce")

    def __init__(self, credentials: NodeCredentials) -> None:
        self._credentials = credentials
        self._nonce = os.urandom(32)
        self._node = self._instance = ""
        self._theirs = b""

    @property
    def claimed(self) -> str:
        """The node id the dialer claimed in its hello ("" before it)."""
        return self._node

    def challenge(self, payload: bytes) -> bytes:
        me = self._credentials
        data = _parse(payload, "node", "instance", "nonce")
        self._node, self._instance, self._theirs = data["node"], data["instance"], _nonce(data)
        if not self._node:
            raise HandshakeError("the hello names no node")
        proof = _mac(me.key, b"accept", self._theirs, self._nonce, me.node_id, self._node,
                     self._instance)
        return _message({"node": me.node_id, "nonce": self._nonce.hex(), "proof": proof.hex()})

    def verify(self, payload: bytes) -> tuple[str, str]:
        me = self._credentials
        if not self._theirs:
            raise HandshakeError("a proof before the hello")
        data = _parse(payload, "proof")
        expected = _mac(me.key, b"dial", self._theirs, self._nonce, self._node, self._instance,
                        me.node_id)
        if not hmac.compare_digest(expected, _proof(data)):
            raise HandshakeError(f"the peer claiming to be node {self._node} did not prove "
                                 "the cluster secret")
        return self._node, self._instance


# ---------------------------------------------------------------- gRPC calls between nodes

def _method(details: Any) -> str:
    method = details.method
    return method.decode() if isinstance(method, bytes) else str(method)


def call_metadata(credentials: NodeCredentials, method: str,
                  now_ms: int | None = None) -> list[tuple[str, str]]:
    """The metadata that authenticates one call of this node to `method` on a peer."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    nonce = os.urandom(16).hex()
    mac = _mac(credentials.key, b"call", credentials.node_id, credentials.instance, method,
               str(now_ms), nonce).hex()
    return [(NODE_HEADER, credentials.node_id), (INSTANCE_HEADER, credentials.instance),
            (AUTH_HEADER, f"{now_ms}.{nonce}.{mac}")]


class _CallSigner:
    """Adds `call_metadata` to every call of a channel to a peer's cluster port."""

    def __init__(self, credentials: NodeCredentials) -> None:
        self._credentials = credentials

    def details(self, details: Any) -> Any:
        metadata = list(details.metadata or ()) + call_metadata(self._credentials, _method(details))
        return grpc.aio.ClientCallDetails(details.method, details.timeout, grpc.aio.Metadata(*metadata),
                                          details.credentials, details.wait_for_ready)


# (grpc.aio files an interceptor under the first of the four kinds it is: one class per kind)
class _SignUnaryUnary(_CallSigner, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]  # (grpc: no stubs)
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self.details(details), request)


class _SignUnaryStream(_CallSigner, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]  # (grpc: no stubs)
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self.details(details), request)


class _SignStreamUnary(_CallSigner, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]  # (grpc: no stubs)
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self.details(details), requests)


class _SignStreamStream(_CallSigner, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]  # (grpc: no stubs)
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self.details(details), requests)


def cluster_channel(address: str, credentials: NodeCredentials,
                    options: list[tuple[str, Any]]) -> grpc.aio.Channel:
    """A channel to a peer's cluster port whose every call is authenticated."""
    kinds = (_SignUnaryUnary, _SignUnaryStream, _SignStreamUnary, _SignStreamStream)
    interceptors = [kind(credentials) for kind in kinds]
    tls = credentials.tls
    if tls is not None:
        host = address.rpartition(":")[0].strip("[]")
        return grpc.aio.secure_channel(address, tls.channel_credentials,
                                       options=[*options, *tls.channel_options(host)],
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


class CallAuthenticator(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # (grpc: no stubs)
    """The internal gRPC server's gate: a call goes to its handler only when it carries a
    valid `call_metadata` of a registered node (`registered(node, instance)`)."""

    def __init__(self, credentials: NodeCredentials, registered: Callable[[str, str], bool]) -> None:
        self._credentials = credentials
        self._registered = registered
        # nonce -> when it stops mattering (its call would be stale): a replay is refused
        self._seen: OrderedDict[str, float] = OrderedDict()

    def check(self, method: str, metadata: dict[str, str], now: float | None = None) -> str | None:
        """Why the call is refused, or None."""
        now = time.time() if now is None else now
        node, instance = metadata.get(NODE_HEADER), metadata.get(INSTANCE_HEADER, "")
        stamp, _, rest = metadata.get(AUTH_HEADER, "").partition(".")
        nonce, _, mac = rest.partition(".")
        if not node or not stamp or not nonce or not mac:
            return "a call between cluster nodes needs the node's credentials"
        try:
            signed = int(stamp) / 1000
            given = bytes.fromhex(mac)
        except ValueError:
            return "malformed node credentials"
        expected = _mac(self._credentials.key, b"call", node, instance, method, stamp, nonce)
        if not hmac.compare_digest(expected, given):
            return f"the caller claiming to be node {node} did not prove the cluster secret"
        if abs(now - signed) > CALL_SKEW_S:
            return (f"node {node} signed its call {now - signed:+.0f} s from this node's clock "
                    f"(at most {CALL_SKEW_S:g} s apart)")
        seen = self._seen
        while seen and next(iter(seen.values())) < now:
            seen.popitem(last=False)
        if nonce in seen:
            return "a call replayed"
        seen[nonce] = signed + 2 * CALL_SKEW_S
        if not self._registered(node, instance):
            return f"node {node} is not registered in the cluster under that instance"
        return None

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        metadata = {key: value for key, value in (handler_call_details.invocation_metadata or ())
                    if isinstance(value, str)}
        reason = self.check(handler_call_details.method, metadata)
        handler = await continuation(handler_call_details)
        if reason is None or handler is None:
            return handler

        async def deny(_request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
