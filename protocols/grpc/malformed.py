"""Malformed requests end with INVALID_ARGUMENT and one debug line, not UNKNOWN and a traceback.

grpc.aio deserializes a request inside the servicer call: bytes that are not the method's
protobuf message raise there, and grpc answers UNKNOWN and logs an ERROR with a traceback per
call (a stranger could fill the log). `MalformedRequestInterceptor` wraps every method's
request deserializer so that a failure yields a `Malformed` value instead, and the method itself
so that a `Malformed` request (the request of a unary call, or any item of a request stream)
ends the call with INVALID_ARGUMENT and the parser's reason.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)


class Malformed:
    """What the wrapped deserializer returns for bytes it cannot parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's bad input
            return Malformed(f"{type(exc).__name__}: {exc}")

    return parse


async def _refuse(context: grpc.aio.ServicerContext, malformed: Malformed) -> None:
    log.debug("gRPC %s: malformed request: %s", _peer(context), malformed.reason)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {malformed.reason}")


def _peer(context: grpc.aio.ServicerContext) -> str:
    try:
        return context.peer() or "-"
    except Exception:  # noqa: BLE001 - only informative
        return "-"


async def _checked_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Malformed):
            await _refuse(context, request)
        yield request


def _wrap(behaviour: Callable[..., Any], streaming_request: bool) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behaviour):
        async def generator(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if streaming_request:
                request = _checked_stream(request, context)
            elif isinstance(request, Malformed):
                await _refuse(context, request)
            async for response in behaviour(request, context):
                yield response
        return generator

    async def coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if streaming_request:
            request = _checked_stream(request, context)
        elif isinstance(request, Malformed):
            await _refuse(context, request)
        return await behaviour(request, context)
    return coroutine


def tolerant_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with its request parsing made tolerant and malformed requests refused."""
    kwargs = {"request_deserializer": _tolerant(handler.request_deserializer),
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_wrap(handler.stream_stream, True), **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_wrap(handler.stream_unary, True), **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_wrap(handler.unary_stream, False), **kwargs)
    return grpc.unary_unary_rpc_method_handler(_wrap(handler.unary_unary, False), **kwargs)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Installs `tolerant_handler` on every method (see the module docstring)."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return tolerant_handler(handler)
