"""Conversions between the gRPC API's messages and the core's values, and errors turned into
statuses.

The enum tables (dispatch modes, schemas, subscription types) in both directions, `Refusal` (a
gRPC status and its reason) with the translation of core errors into statuses, and the checks
of text a client sends. Core errors are translated here, at the edge, into gRPC status codes
with a message (see the table in `shardgate.proto`): nothing a client sends should end in
UNKNOWN/INTERNAL or a hang.
"""

from __future__ import annotations

import contextlib
from typing import Any

import grpc

from ...core.durable import DurableSubscription
from ...core.errors import (
    CoreError,
    InvalidStreamConfig,
    PublishRejected,
    StoreFull,
    StreamExists,
    StreamNotFound,
    SubscriptionBusy,
)
from ...core.schema_registry import SchemaRegistryUnavailable
from ...core.streams import DispatchMode, Schema
from ...core.subscriptions import Subscription, SubscriptionType
from ...core.topics import TopicError
from ...proto import shardgate_pb2 as pb
from .consumer import GrpcSubscriptionState

MODES = {
    pb.DISPATCH_MODE_UNSPECIFIED: DispatchMode.NON_RELIABLE,
    pb.DISPATCH_MODE_NON_RELIABLE: DispatchMode.NON_RELIABLE,
    pb.DISPATCH_MODE_RELIABLE: DispatchMode.RELIABLE,
}
MODES_OUT = {DispatchMode.NON_RELIABLE: pb.DISPATCH_MODE_NON_RELIABLE,
             DispatchMode.RELIABLE: pb.DISPATCH_MODE_RELIABLE}
SCHEMAS = {
    pb.SCHEMA_UNSPECIFIED: Schema.BYTES,
    pb.SCHEMA_BYTES: Schema.BYTES,
    pb.SCHEMA_STRING: Schema.STRING,
    pb.SCHEMA_INT64: Schema.INT64,
    pb.SCHEMA_JSON: Schema.JSON,
}
SCHEMAS_OUT = {schema: code for code, schema in SCHEMAS.items() if code != pb.SCHEMA_UNSPECIFIED}
SUB_TYPES = {
    pb.SUBSCRIPTION_TYPE_UNSPECIFIED: SubscriptionType.EXCLUSIVE,
    pb.SUBSCRIPTION_TYPE_EXCLUSIVE: SubscriptionType.EXCLUSIVE,
    pb.SUBSCRIPTION_TYPE_SHARED: SubscriptionType.SHARED,
    pb.SUBSCRIPTION_TYPE_FAILOVER: SubscriptionType.FAILOVER,
}
SUB_TYPES_OUT = {value: code for code, value in SUB_TYPES.items()
                 if code != pb.SUBSCRIPTION_TYPE_UNSPECIFIED}


class Refusal(Exception):
    """A request the API refuses: a gRPC status code and the reason."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def status_for(exc: CoreError) -> grpc.StatusCode:
    if isinstance(exc, StreamNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, StreamExists):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(exc, InvalidStreamConfig | TopicError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, SubscriptionBusy):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, StoreFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, PublishRejected | SchemaRegistryUnavailable):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.FAILED_PRECONDITION


@contextlib.contextmanager
def translated() -> Any:
    """Turn core errors raised inside the block into `Refusal`s."""
    try:
        yield
    except CoreError as exc:
        raise Refusal(status_for(exc), str(exc)) from exc


async def abort(context: grpc.aio.ServicerContext, refusal: Refusal) -> None:
    await context.abort(refusal.code, refusal.reason)


def check_text(what: str, text: str, limit: int = 0xFFFF) -> None:
    """Text every protocol can carry: no U+0000 (MQTT strings must not hold it
    [MQTT-1.5.4-2]) and at most `limit` bytes of UTF-8 (MQTT's and the record's u16 lengths)."""
    if "\x00" in text:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{what} contains U+0000")
    if len(text) > limit // 4 and len(text.encode()) > limit:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is longer than {limit} bytes")


def protocol_of(sub: Subscription) -> str:
    owner = sub.owner
    if isinstance(owner, GrpcSubscriptionState):
        return "grpc"
    module = type(owner).__module__ if owner is not None else ""
    for protocol in ("mqtt", "amqp"):
        if f".{protocol}." in module:
            return protocol
    return "core" if owner is None else type(owner).__name__.lower()


def lag_of(sub: Subscription) -> int:
    """Messages behind the cursors of a durable subscription (0 for a live-only one)."""
    return sub.lag() if isinstance(sub, DurableSubscription) else 0


def is_transient(sub: Subscription) -> bool:
    """A gRPC replay of a non-durable subscription: it ends with its consumers."""
    owner = sub.owner
    return isinstance(owner, GrpcSubscriptionState) and owner.transient


def seek_to(sub: DurableSubscription, position: pb.StartPosition) -> None:
    """Move the cursors of `sub` to `position` (latest when none is set)."""
    which = position.WhichOneof("position")
    if which == "offset":
        sub.seek(which, position.offset)
    elif which == "timestamp_ms":
        sub.seek(which, position.timestamp_ms)
    else:
        sub.seek(which or "latest")
