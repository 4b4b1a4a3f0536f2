"""The SDK's exceptions: one per gRPC status the API uses, all under `ShardgateError`."""

from __future__ import annotations

import grpc


class ShardgateError(Exception):
    """A request failed; `code` is the gRPC status, `details` the server's reason."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class NotFound(ShardgateError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ShardgateError):
    code = grpc.StatusCode.ALREADY_EXISTS


class InvalidArgument(ShardgateError):
    """Bad names or filters, or a payload that does not fit the stream's schema."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(ShardgateError):
    """E.g. a second consumer on an Exclusive subscription."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ShardgateError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class OutOfRange(ShardgateError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unauthenticated(ShardgateError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ShardgateError):
    """The broker's ACL refuses this user the publish or subscribe."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(ShardgateError):
    """The broker cannot be reached (or is shutting down); retrying may help."""

    code = grpc.StatusCode.UNAVAILABLE


_BY_CODE: dict[grpc.StatusCode, type[ShardgateError]] = {
    cls.code: cls
    for cls in (NotFound, AlreadyExists, InvalidArgument, FailedPrecondition, ResourceExhausted,
                OutOfRange, Unauthenticated, PermissionDenied, Unavailable)
}
_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}

# Unary calls are retried only on these.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.ABORTED})
# A broken stream is reopened unless it ended with one of these: the broker's precise refusals,
# which reopening cannot fix. (A broker shutting down may end streams with CANCELLED or INTERNAL.)
FINAL = frozenset({
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED,
})


def error_for(code: grpc.StatusCode | int, details: str) -> ShardgateError:
    """The exception for a status code (a `grpc.StatusCode` or its integer value)."""
    if isinstance(code, int):
        code = _BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code, ShardgateError)
    return cls(details, code)


def from_rpc_error(exc: grpc.RpcError) -> ShardgateError:
    """Translate a grpc error raised by a stub call."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_for(code, details or code.name)
