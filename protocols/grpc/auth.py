"""Authentication of gRPC calls: credentials read from the call's metadata (`authorization: Basic`
or `Bearer`), checked at the front door (`Edge.authenticate`) by `AuthInterceptor`, and the
caller's user, peer and `Principal` as the servicers see them.
"""

from __future__ import annotations

import base64
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from ...core.edge import Principal, Verdict

if TYPE_CHECKING:
    from .server import GrpcServer




def user_of(context: grpc.aio.ServicerContext) -> str | None:
    """The user name the call authenticated as (None: anonymous or a bearer token)."""
    try:
        credentials = credentials_from_metadata(context.invocation_metadata())
    except Exception:  # noqa: BLE001 - no metadata: anonymous
        return None
    return credentials[0] if credentials is not None else None


def peer_of(context: grpc.aio.ServicerContext) -> str:
    try:
        return context.peer() or ""
    except Exception:  # noqa: BLE001 - a peer name is only informative
        return ""


def principal_of(user: str | None) -> Principal:
    """A gRPC caller as authorization sees it: by user (ACL rules see no client id)."""
    return Principal("grpc", user)


def _refuse(code: grpc.StatusCode, reason: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, reason)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, reason)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(streaming)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


def credentials_from_metadata(metadata: Any) -> tuple[str | None, bytes | None] | None:
    """(username, password) from `authorization: Basic ...` or `Bearer TOKEN` (a token is a
    password without a username); None when the call carries no authorization."""
    for key, value in metadata or ():
        if key != "authorization":
            continue
        text = value.decode() if isinstance(value, bytes) else str(value)
        scheme, _, rest = text.strip().partition(" ")
        if scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(rest.strip(), validate=True).decode()
            except ValueError:
                return ("", b"")
            username, _, password = decoded.partition(":")
            return (username, password.encode())
        if scheme.lower() == "bearer":
            return (None, rest.strip().encode())
        return ("", b"")
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks credentials at the front door (`Edge.authenticate`), passing the peer address.

    A call without credentials is refused at once when anonymous access is off; a call with
    credentials is checked when it starts, where the peer address is known."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        edge = self.server.edge
        credentials = credentials_from_metadata(handler_call_details.invocation_metadata)
        if credentials is None:
            if not self.server.settings.allow_anonymous:
                return _refuse(grpc.StatusCode.UNAUTHENTICATED, "credentials required", handler)
            if not edge.secured:
                return handler
            # Asked of the security model per call (it notices a user just added or removed).
            verdict = edge.authenticate(Principal("grpc"), None)
            if verdict is None:
                return handler
            if isinstance(verdict, str):
                return _refuse(grpc.StatusCode.UNAUTHENTICATED, "credentials required", handler)
            return _checked(handler, lambda peer: verdict)
        if not edge.secured:
            return handler
        username, password = credentials
        return _checked(
            handler, lambda peer: edge.authenticate(Principal("grpc", username, "", peer), password)
        )


def _checked(handler: grpc.RpcMethodHandler,
             check: Callable[[str], Verdict]) -> grpc.RpcMethodHandler:
    """`handler`, preceded by `check(peer)`: a refusal ends the call with UNAUTHENTICATED.
    A password is hashed off the event loop: the call waits for the verdict."""

    async def refused(context: grpc.aio.ServicerContext) -> bool:
        refusal = check(peer_of(context))
        if refusal is not None and not isinstance(refusal, str):
            refusal = await refusal
        if refusal is None:
            return False
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"authentication failed: {refusal}")
        return True

    def wrap(behaviour: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behaviour):
            async def generator(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if await refused(context):
                    return
                async for response in behaviour(request, context):
                    yield response
            return generator

        async def coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if await refused(context):
                return None
            return await behaviour(request, context)
        return coroutine

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **kwargs)
    return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **kwargs)
