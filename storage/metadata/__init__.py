"""The metadata store: streams, routes, subscriptions, cursors, MQTT sessions, retained and
delayed messages, users.

`MetadataStore` (interface.py) is the boundary; `SqliteMetadataStore` (sqlite.py) is the
embedded engine. Records are plain dataclasses (records.py); nothing here imports
`shardgate.core`.
"""

from shardgate.storage.metadata.interface import MetadataError, MetadataStore, SchemaVersionError
from shardgate.storage.metadata.records import (
    SESSION_NEVER_EXPIRES,
    CursorRecord,
    DelayedRecord,
    RouteRecord,
    SessionRecord,
    StreamRecord,
    SubscriptionRecord,
    UserRecord,
)
from shardgate.storage.metadata.schema import SCHEMA_VERSION
from shardgate.storage.metadata.sqlite import SqliteMetadataStore

__all__ = [
    "SCHEMA_VERSION",
    "SESSION_NEVER_EXPIRES",
    "CursorRecord",
    "DelayedRecord",
    "MetadataError",
    "MetadataStore",
    "RouteRecord",
    "SchemaVersionError",
    "SessionRecord",
    "SqliteMetadataStore",
    "StreamRecord",
    "SubscriptionRecord",
    "UserRecord",
]
