"""Shardgate's Python SDK over the native gRPC API: async first, with a blocking wrapper.

- `Client(url)`: one channel (`--url`/`SHARDGATE_URL`/127.0.0.1:6650), `async with` it.
- `client.producer()`: `send()` (batched stream, acked), `send_nowait()`, `publish()` (unary).
- `client.consumer(subscription, filters, type=..., position=...)`: an async iterator of
  `ReceivedMessage`s with `ack()` / `nack(delay_s)`, reconnecting on its own.
- `client.admin`: streams, routes, subscriptions, clients, broker info.
- `SyncClient`: the same without `await`.
- `schemas`: payload helpers for String, Int64 and JSON streams.

Errors are `ShardgateError` subclasses named after the gRPC status (`NotFound`,
`FailedPrecondition`, `InvalidArgument`, `PermissionDenied`, `Unavailable`...).
"""

from __future__ import annotations

from . import schemas
from .admin import Admin
from .client import DEFAULT_URL, Client, resolve_url
from .consumer import Consumer
from .errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    ShardgateError,
    Unauthenticated,
    Unavailable,
)
from .producer import Producer
from .sync import SyncClient, SyncConsumer, SyncProducer
from .types import (
    BrokerInfo,
    ClientInfo,
    ConsumerInfo,
    Listing,
    Mode,
    Position,
    Receipt,
    ReceivedMessage,
    Schema,
    SchemaInfo,
    ShardInfo,
    StreamInfo,
    SubscriptionInfo,
    SubscriptionType,
)

__all__ = [
    "DEFAULT_URL", "Admin", "AlreadyExists", "BrokerInfo", "Client", "ClientInfo", "Consumer",
    "ConsumerInfo", "FailedPrecondition", "InvalidArgument", "Listing", "Mode", "NotFound", "OutOfRange",
    "PermissionDenied", "Position", "Producer", "Receipt", "ReceivedMessage", "ResourceExhausted", "Schema",
    "SchemaInfo", "ShardInfo", "ShardgateError", "StreamInfo", "SubscriptionInfo", "SubscriptionType",
    "SyncClient", "SyncConsumer", "SyncProducer", "Unauthenticated", "Unavailable", "resolve_url",
    "schemas",
]
