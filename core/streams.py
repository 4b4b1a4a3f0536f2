"""Streams and shards: where a topic's messages are ordered and (for reliable streams) kept.

A stream is a named set of shards with a dispatch mode. Topic names resolve to a stream by
routing rules (topic filters, most specific first); unmatched topics go to the default stream.
Within a stream a message's shard is chosen by a stable hash of its key, or of its topic, so
every topic (or key) keeps its order.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from ..storage.interfaces import ShardLog
from .errors import InvalidStreamConfig
from .topics import filter_matches, validate_topic_filter

STREAM_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")

#: The most replicas a stream may ask for. What a stream without the settings gets, and how the
#: live node count caps them, is the cluster's (`shardgate/cluster/replication.py`): a single
#: node keeps one copy whatever the stream says.
MAX_REPLICAS = 16


class DispatchMode(StrEnum):
    NON_RELIABLE = "non-reliable"
    RELIABLE = "reliable"


class Schema(StrEnum):
    BYTES = "bytes"
    STRING = "string"
    INT64 = "int64"
    JSON = "json"


@dataclass(slots=True)
class StreamConfig:
    name: str
    mode: DispatchMode = DispatchMode.NON_RELIABLE
    partitions: int = 1
    schema: Schema = Schema.BYTES
    retention_ms: int | None = None
    retention_bytes: int | None = None
    # None: the cluster's defaults (a single node ignores both)
    replicas: int | None = None
    min_insync_replicas: int | None = None

    def __post_init__(self) -> None:
        if not STREAM_NAME.match(self.name):
            raise InvalidStreamConfig(
                f"stream name {self.name!r} must be 1-128 of [A-Za-z0-9_.-], not starting with . or -"
            )
        if not 1 <= self.partitions <= 1024:
            raise InvalidStreamConfig("partitions must be between 1 and 1024")
        if self.replicas is not None and not 1 <= self.replicas <= MAX_REPLICAS:
            raise InvalidStreamConfig(f"replicas must be between 1 and {MAX_REPLICAS}")
        if self.min_insync_replicas is not None:
            if not 1 <= self.min_insync_replicas <= MAX_REPLICAS:
                raise InvalidStreamConfig(
                    f"min_insync_replicas must be between 1 and {MAX_REPLICAS}")
            if self.replicas is not None and self.min_insync_replicas > self.replicas:
                raise InvalidStreamConfig(
                    f"min_insync_replicas ({self.min_insync_replicas}) cannot exceed "
                    f"replicas ({self.replicas})")
        self.mode = DispatchMode(self.mode)
        self.schema = Schema(self.schema)


@dataclass(slots=True)
class RoutingRule:
    topic_filter: str
    stream: str

    def __post_init__(self) -> None:
        validate_topic_filter(self.topic_filter)

    @property
    def specificity(self) -> tuple[int, int]:
        """Rules with more literal levels win; then longer filters."""
        levels = self.topic_filter.split("/")
        literal = sum(1 for level in levels if level not in ("+", "#"))
        return (literal, len(self.topic_filter))


class Shard:
    """One ordered log of a stream. Non-reliable shards count offsets in memory only."""

    __slots__ = ("stream", "index", "log", "next_offset")

    def __init__(self, stream: str, index: int, log: ShardLog | None) -> None:
        self.stream = stream
        self.index = index
        self.log = log
        self.next_offset = log.next_offset if log is not None else 0


class Stream:
    __slots__ = ("config", "shards")

    def __init__(self, config: StreamConfig, shards: list[Shard]) -> None:
        self.config = config
        self.shards = shards

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def reliable(self) -> bool:
        return self.config.mode is DispatchMode.RELIABLE

    def shard_for(self, topic: str, key: bytes | None) -> Shard:
        if len(self.shards) == 1:
            return self.shards[0]
        basis = key if key is not None else topic.encode()
        return self.shards[zlib.crc32(basis) % len(self.shards)]


class TopologySink(Protocol):
    """Told of every change to streams and routing rules made after start-up (the composition
    root keeps them in the metadata store, so they survive a restart)."""

    def stream_saved(self, config: StreamConfig) -> None: ...

    def stream_deleted(self, name: str) -> None: ...

    def route_saved(self, rule: RoutingRule) -> None: ...

    def route_removed(self, topic_filter: str) -> None: ...


class StreamRouter:
    """Resolves topic names to stream names by routing rules. Uncached: `Broker` keeps the
    topic -> stream cache, so a second per-topic map here would only double the memory."""

    def __init__(self, default_stream: str) -> None:
        self.default_stream = default_stream
        self._rules: list[RoutingRule] = []

    @property
    def rules(self) -> list[RoutingRule]:
        return list(self._rules)

    def add_rule(self, rule: RoutingRule) -> None:
        self._rules = [r for r in self._rules if r.topic_filter != rule.topic_filter]
        self._rules.append(rule)
        self._rules.sort(key=lambda r: r.specificity, reverse=True)

    def remove_rule(self, topic_filter: str) -> bool:
        before = len(self._rules)
        self._rules = [r for r in self._rules if r.topic_filter != topic_filter]
        return len(self._rules) != before

    def remove_stream(self, stream: str) -> None:
        self._rules = [r for r in self._rules if r.stream != stream]

    def resolve(self, topic: str) -> str:
        for rule in self._rules:
            if filter_matches(rule.topic_filter, topic):
                return rule.stream
        return self.default_stream
