"""The broker's streams and routing rules: create, update and delete streams (their shards and
logs), the rules that route a topic to a stream (resolved once per topic, cached), the schemas
registered per stream and the payload checks of a publish.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from ..storage.interfaces import ShardLog, ShardStorage
from .broker_stats import BrokerStats
from .durable import DurableSubscription
from .errors import PublishRejected, SchemaMismatch, StreamExists, StreamNotFound
from .kept_state import INTERNAL_PREFIX
from .message import Message
from .schema_registry import SchemaRegistry, SchemaVersion
from .schemas import check_payload
from .store_ports import PortSlot
from .streams import (
    DispatchMode,
    RoutingRule,
    Shard,
    Stream,
    StreamConfig,
    StreamRouter,
    TopologySink,
)
from .subscription_registry import MATCH_CACHE_LIMIT
from .subscriptions import Subscription

log = logging.getLogger("shardgate.core.broker")

SCHEMAS_PREFIX = INTERNAL_PREFIX + "schemas/"


class StreamCatalog:
    """The stream catalog part of `Broker` (`core/broker.py`), which holds the state."""

    _streams: dict[str, Stream]
    _topic_stream_cache: dict[str, Stream]
    internal_state: dict[str, Message]
    router: StreamRouter
    schemas: SchemaRegistry
    stats: BrokerStats
    storage: ShardStorage | None
    subscriptions: dict[str, Subscription]
    topology: PortSlot[TopologySink]

    if TYPE_CHECKING:  # provided by the other parts of Broker (`core/broker.py`)
        def keep_internal(self, message: Message) -> None: ...

    @property
    def streams(self) -> dict[str, Stream]:
        return dict(self._streams)

    def save_cursors(self) -> None:
        for sub in self.subscriptions.values():
            if isinstance(sub, DurableSubscription):
                sub.save()

    def stream(self, name: str) -> Stream:
        try:
            return self._streams[name]
        except KeyError:
            raise StreamNotFound(f"stream {name!r} does not exist") from None

    def swap_shard_log(self, stream: str, index: int, shard_log: ShardLog) -> None:
        """Give a reliable shard another log over the same records (in a cluster, the
        replicated log of a shard placed on several nodes, or its plain journal log again):
        from now on appends and reads go to it, and durable cursors that read the old one
        read it instead. Also takes the shard's next offset from the log (its records may
        have come from elsewhere meanwhile: a follower's fetches)."""
        shard = self.stream(stream).shards[index]
        previous = shard.log
        if previous is None:
            raise PublishRejected(f"{stream}/{index} is not a reliable shard")
        shard.log = shard_log
        shard.next_offset = shard_log.next_offset
        if previous is shard_log:
            return
        for sub in list(self.subscriptions.values()):
            if isinstance(sub, DurableSubscription):
                cursor = sub.cursors.get((stream, index))
                if cursor is not None and cursor.log is previous:
                    cursor.log = shard_log

    def create_stream(self, config: StreamConfig, routes: list[str] | None = None) -> Stream:
        if config.name in self._streams:
            raise StreamExists(f"stream {config.name!r} already exists")
        shards = []
        for index in range(config.partitions):
            shard_log = None
            if config.mode is DispatchMode.RELIABLE:
                if self.storage is None:
                    raise PublishRejected("reliable streams need a journal; none is configured")
                shard_log = self.storage.open_shard(config.name, index)
            shards.append(Shard(config.name, index, shard_log))
        stream = Stream(config, shards)
        self._streams[config.name] = stream
        if (sink := self.topology.current) is not None:
            sink.stream_saved(config)
        for pattern in routes or ():
            self.add_route(RoutingRule(pattern, config.name))
        self._topic_stream_cache.clear()
        return stream

    def update_stream(
        self, name: str, *, retention_ms: int | None = None, retention_bytes: int | None = None
    ) -> Stream:
        """Change a stream's retention (0 removes a limit; None leaves it)."""
        stream = self.stream(name)
        if retention_ms is not None:
            stream.config.retention_ms = retention_ms or None
        if retention_bytes is not None:
            stream.config.retention_bytes = retention_bytes or None
        if (sink := self.topology.current) is not None:
            sink.stream_saved(stream.config)
        return stream

    def _schemas_changed(self, stream: str, versions: list[SchemaVersion]) -> None:
        payload = json.dumps([v.to_dict() for v in versions]).encode() if versions else b""
        self.keep_internal(Message(f"{SCHEMAS_PREFIX}{stream}", payload))

    def restore_schemas(self) -> int:
        """Load the registered schemas kept as internal state (at start, after the store's
        internal state is back); returns how many streams have one. A record that does not
        load is logged and skipped."""
        count = 0
        for topic, message in list(self.internal_state.items()):
            if not topic.startswith(SCHEMAS_PREFIX):
                continue
            try:
                versions = [SchemaVersion.from_dict(v) for v in json.loads(message.payload)]
                self.schemas.load(topic[len(SCHEMAS_PREFIX):], versions)
                count += 1
            except Exception as exc:  # noqa: BLE001 - one bad record must not stop the start
                log.error("registered schemas of %r not loaded: %s", topic, exc)
        return count

    def delete_stream(self, name: str) -> None:
        if name == self.router.default_stream:
            raise StreamExists("the default stream cannot be deleted")
        stream = self.stream(name)
        self.schemas.delete(name)
        del self._streams[name]
        self.router.remove_stream(name)
        self._topic_stream_cache.clear()
        if (sink := self.topology.current) is not None:
            sink.stream_deleted(name)
        if self.storage is not None and stream.reliable:
            for shard in stream.shards:
                self.storage.delete_shard(name, shard.index)

    def add_route(self, rule: RoutingRule) -> None:
        self.stream(rule.stream)
        self.router.add_rule(rule)
        self._topic_stream_cache.clear()
        if (sink := self.topology.current) is not None:
            sink.route_saved(rule)

    def remove_route(self, topic_filter: str) -> bool:
        """Remove the routing rule of `topic_filter`; whether there was one."""
        removed = self.router.remove_rule(topic_filter)
        self._topic_stream_cache.clear()
        if removed and (sink := self.topology.current) is not None:
            sink.route_removed(topic_filter)
        return removed

    def stream_for_topic(self, topic: str) -> Stream:
        stream = self._topic_stream_cache.get(topic)
        if stream is None:
            stream = self._streams[self.router.resolve(topic)]
            if len(self._topic_stream_cache) > MATCH_CACHE_LIMIT:
                self._topic_stream_cache.clear()
            self._topic_stream_cache[topic] = stream
        return stream

    def _check_schema(self, config: StreamConfig, message: Message) -> None:
        """Raise SchemaMismatch (counted as rejected for "schema") when the payload does not
        fit the stream's schema."""
        try:
            check_payload(config.schema, message.payload, config.name)
        except SchemaMismatch as exc:
            self.stats.rejected_by_reason["schema"] += 1
            self.schemas.refused(config.name, exc)  # logged there, rate-limited
            raise

    def _check_registered(self, stream: str, payload: bytes) -> None:
        """Refuse a payload that the stream's registered schema does not accept (counted,
        logged rate-limited)."""
        check = self.schemas.checks.get(stream)
        if check is None:
            return
        try:
            check(payload)
        except SchemaMismatch as exc:
            self.schemas.refused(stream, exc)
            raise
