"""The cluster port's node authentication (`shardgate/cluster/link_auth.py`): the handshake as
bytes in and out, the signed gRPC calls of every kind on a real loopback server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from shardgate.cluster.link_auth import (
    CALL_SKEW_S,
    AcceptorHandshake,
    CallAuthenticator,
    DialerHandshake,
    HandshakeError,
    NodeCredentials,
    call_metadata,
    cluster_channel,
    secret_check,
    secret_matches,
)

SECRET = b"s" * 32


def payload(message: bytes) -> bytes:
    return message[4:]


def test_both_ends_prove_the_secret_and_the_acceptor_learns_who_dialed() -> None:
    dialer = DialerHandshake(NodeCredentials("n2", "i2", SECRET), "n1")
    acceptor = AcceptorHandshake(NodeCredentials("n1", "i1", SECRET))
    challenge = acceptor.challenge(payload(dialer.hello()))
    proof = dialer.answer(payload(challenge))
    assert acceptor.verify(payload(proof)) == ("n2", "i2")


@pytest.mark.parametrize("dialer_secret,acceptor_secret", [(b"x" * 32, SECRET), (SECRET, b"x" * 32)])
def test_another_secret_on_either_side_is_found_out(dialer_secret: bytes, acceptor_secret: bytes) -> None:
    dialer = DialerHandshake(NodeCredentials("n2", "i2", dialer_secret), "n1")
    acceptor = AcceptorHandshake(NodeCredentials("n1", "i1", acceptor_secret))
    challenge = acceptor.challenge(payload(dialer.hello()))
    with pytest.raises(HandshakeError, match="did not prove the cluster secret"):
        dialer.answer(payload(challenge))  # the dialer checks the acceptor first


def test_a_proof_for_one_connection_does_not_open_another() -> None:
    dialer = DialerHandshake(NodeCredentials("n2", "i2", SECRET), "n1")
    first = AcceptorHandshake(NodeCredentials("n1", "i1", SECRET))
    hello = payload(dialer.hello())
    proof = dialer.answer(payload(first.challenge(hello)))
    replayed = AcceptorHandshake(NodeCredentials("n1", "i1", SECRET))
    replayed.challenge(hello)  # a new nonce of the acceptor
    with pytest.raises(HandshakeError):
        replayed.verify(payload(proof))


def test_the_dialer_refuses_a_node_it_did_not_dial() -> None:
    dialer = DialerHandshake(NodeCredentials("n2", "i2", SECRET), "n1")
    acceptor = AcceptorHandshake(NodeCredentials("n3", "i3", SECRET))
    with pytest.raises(HandshakeError, match="dialed node n1 but node n3 answered"):
        dialer.answer(payload(acceptor.challenge(payload(dialer.hello()))))


@pytest.mark.parametrize("garbage", [b"", b"not json", b"[]", b'{"node": "n1"}',
                                     b'{"node": "n1", "instance": "", "nonce": "zz"}'])
def test_a_malformed_hello_is_a_handshake_error(garbage: bytes) -> None:
    with pytest.raises(HandshakeError):
        AcceptorHandshake(NodeCredentials("n1", "", SECRET)).challenge(garbage)


def test_the_registration_check_tells_secrets_apart_without_showing_them() -> None:
    check = secret_check(SECRET)
    assert SECRET.hex() not in check and SECRET.decode() not in check
    assert secret_matches(SECRET, check)
    assert not secret_matches(b"x" * 32, check)
    assert not secret_matches(SECRET, "")
    assert secret_check(SECRET) != check  # salted


def test_a_signed_call_is_refused_when_stale_replayed_or_unregistered() -> None:
    me = NodeCredentials("n2", "i2", SECRET)
    gate = CallAuthenticator(NodeCredentials("n1", "i1", SECRET), lambda node, instance: node == "n2")
    metadata = dict(call_metadata(me, "/s/M", now_ms=1_000_000_000))
    now = 1_000_000.0
    assert gate.check("/s/M", metadata, now) is None
    assert gate.check("/s/M", metadata, now) == "a call replayed"
    assert "did not prove" in (gate.check("/s/Other", dict(call_metadata(me, "/s/M")), now) or "")
    stale = dict(call_metadata(me, "/s/M", now_ms=int((now - CALL_SKEW_S - 1) * 1000)))
    assert "from this node's clock" in (gate.check("/s/M", stale, now) or "")
    stranger = dict(call_metadata(NodeCredentials("n9", "", SECRET), "/s/M", now_ms=int(now * 1000)))
    assert "not registered" in (gate.check("/s/M", stranger, now) or "")


async def test_calls_of_every_kind_are_signed_and_checked() -> None:
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"u:" + request

    async def stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for request in requests:
            yield b"s:" + request

    server = grpc.aio.server(interceptors=[CallAuthenticator(NodeCredentials("n1", "i1", SECRET),
                                                             lambda node, instance: node == "n2")])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", {
        "U": grpc.unary_unary_rpc_method_handler(unary),
        "S": grpc.stream_stream_rpc_method_handler(stream)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with cluster_channel(f"127.0.0.1:{port}", NodeCredentials("n2", "i2", SECRET), []) as channel:
            assert await asyncio.wait_for(channel.unary_unary("/t.S/U")(b"a"), 10) == b"u:a"
            call = channel.stream_stream("/t.S/S")(metadata=(("x-other", "kept"),))
            await call.write(b"b")
            assert await asyncio.wait_for(call.read(), 10) == b"s:b"
            await call.done_writing()
            assert await call.code() is grpc.StatusCode.OK
        async with cluster_channel(f"127.0.0.1:{port}", NodeCredentials("n2", "i2", b"x" * 32), []) as channel:
            call = channel.stream_stream("/t.S/S")()
            await call.write(b"c")
            assert await asyncio.wait_for(call.code(), 10) is grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(None)
