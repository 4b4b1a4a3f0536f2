"""The streams, routes and schemas a broker starts with: the built-in `sys` stream, those the
configuration file declares, and those created at run time (CLI, gRPC Admin) that the metadata
store kept, with the rule when both name the same thing (the configuration file wins, the
stored definition is set aside with a warning). Called once by the composition root
(`app.py`) while it builds the broker; nothing here runs afterwards.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .config import ConfigError, StreamEntry
from .core.broker import Broker
from .core.errors import CoreError
from .core.restoring import set_aside
from .core.streams import DispatchMode, RoutingRule, Schema, StreamConfig
from .persistence import stream_config
from .storage.metadata import SqliteMetadataStore

# The composition root's logger, as before this module was split from it.
log = logging.getLogger("shardgate.app")

SYS_STREAM = "sys"


def stream_definition(config: StreamConfig) -> str:
    """A stream's definition in a log line: `(reliable, 3 partitions, schema json, ...)`."""
    parts = [config.mode.value, f"{config.partitions} partitions", f"schema {config.schema.value}"]
    if config.retention_ms is not None:
        parts.append(f"retention_ms {config.retention_ms}")
    if config.retention_bytes is not None:
        parts.append(f"retention_bytes {config.retention_bytes}")
    if config.replicas is not None:
        parts.append(f"replicas {config.replicas}")
    if config.min_insync_replicas is not None:
        parts.append(f"min_insync_replicas {config.min_insync_replicas}")
    return "(" + ", ".join(parts) + ")"


def declare_configured_streams(broker: Broker, streams: list[StreamEntry]) -> dict[str, str]:
    """Create the built-in `sys` stream and the streams the configuration file declares, with
    their routes; returns the declared routes (pattern → stream)."""
    broker.create_stream(StreamConfig(SYS_STREAM, mode=DispatchMode.NON_RELIABLE))
    broker.add_route(RoutingRule("$SYS/#", SYS_STREAM))
    declared_routes: dict[str, str] = {}
    for entry in streams:
        declared = StreamConfig(
            entry.name, mode=DispatchMode(entry.mode), partitions=entry.partitions,
            schema=Schema(entry.schema),
            retention_ms=entry.retention_ms, retention_bytes=entry.retention_bytes,
            replicas=entry.replicas, min_insync_replicas=entry.min_insync_replicas,
        )
        routes = entry.routes or [entry.name, f"{entry.name}/#"]
        broker.create_stream(declared, routes=routes)
        declared_routes.update(dict.fromkeys(routes, entry.name))
    return declared_routes


def register_configured_schemas(broker: Broker, streams: list[StreamEntry], *,
                                in_cluster: bool = False) -> None:
    """Register the `schema_file` of each configured stream (no new version when it is
    the latest already); a file that cannot be read, an invalid schema or one that breaks
    the stream's compatibility mode stops the start with the stream named. In a cluster
    (`in_cluster`) the files are only read and checked here: they are registered once the
    node has joined (`register_configured_schemas_ordered`)."""
    for entry in streams:
        if not entry.schema_file:
            continue
        try:
            text = Path(entry.schema_file).read_text(encoding="utf-8")
            if in_cluster:
                broker.schemas.prepare(entry.name, entry.schema_type, text,
                                       entry.compatibility or None)
                continue
            broker.schemas.register(entry.name, entry.schema_type, text,
                                    entry.compatibility or None)
        except (OSError, UnicodeDecodeError, CoreError) as exc:
            raise ConfigError(f"stream {entry.name!r}: schema_file {entry.schema_file!r}: "
                              f"{exc}") from exc


async def register_configured_schemas_ordered(broker: Broker, streams: list[StreamEntry]) -> None:
    """In a cluster, once joined: register each configured `schema_file` through the
    cluster's compare-and-set in etcd (`register_ordered`), as the gRPC Admin service
    does, checked against the latest version etcd holds; a schema that breaks the
    stream's compatibility with it, or an etcd out of reach, stops the start."""
    for entry in streams:
        if not entry.schema_file:
            continue
        try:
            text = Path(entry.schema_file).read_text(encoding="utf-8")
            await broker.schemas.register_ordered(entry.name, entry.schema_type, text,
                                                  entry.compatibility or None)
        except (OSError, UnicodeDecodeError, CoreError) as exc:
            raise ConfigError(f"stream {entry.name!r}: schema_file {entry.schema_file!r}: "
                              f"{exc}") from exc


def restore_runtime_topology(broker: Broker, metadata: SqliteMetadataStore,
                             declared_routes: dict[str, str]) -> None:
    """Bring back the streams and routes created at run time (CLI, gRPC Admin), kept in
    the metadata store. The rule when both define the same name: the configuration file
    wins for the streams and route patterns it declares; the stored definition is set
    aside (and kept in the store) with a warning."""
    builtin = {broker.router.default_stream, SYS_STREAM}
    for record in metadata.list_streams():
        if record.name in builtin:
            continue
        try:
            stored = stream_config(record)
            existing = broker.streams.get(record.name)
            if existing is None:
                broker.create_stream(stored)
        except (CoreError, ValueError) as exc:
            set_aside(log, f"stream {record.name!r}", record, exc)
            continue
        if existing is None:
            log.info("restored stream %r (%s, %d partitions) created at run time",
                     stored.name, stored.mode.value, stored.partitions)
        elif stream_definition(existing.config) != stream_definition(stored):
            log.warning(
                "stream %r is declared in the configuration file and was also created or "
                "changed at run time; the configuration file wins: using %s, not the stored %s",
                record.name, stream_definition(existing.config), stream_definition(stored),
            )
    for route in metadata.list_routes():
        owner = declared_routes.get(route.pattern)
        if owner is not None:
            if owner != route.stream:
                log.warning(
                    "route %r goes to stream %r in the configuration file and to %r at run "
                    "time; the configuration file wins", route.pattern, owner, route.stream,
                )
            continue
        if route.stream not in broker.streams:
            log.warning("route %r in the metadata store names stream %r, which does not "
                        "exist; skipped", route.pattern, route.stream)
            continue
        try:
            broker.add_route(RoutingRule(route.pattern, route.stream))
        except (CoreError, ValueError) as exc:
            set_aside(log, f"route {route.pattern!r}", route, exc)
