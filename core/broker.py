"""The core broker: routes published messages to streams and shards and dispatches them live.

The hot path is `publish`: resolve the topic's stream and shard (cached per topic), assign the
offset, and hand the message to every matching subscription's chosen consumer — with no await
and no task per message. Reliable streams append to the shard's log first and dispatch at once
when the log promises never to reuse the offset (`deliverable_end`: not after a failed commit,
not after a crash), else once the commit group is durable; either way the caller gets the
commit future to hold its acknowledgement on (acknowledged means durable).
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import time
from collections import defaultdict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

from ..storage.interfaces import (
    ArchiveSource,
    LatencyHistogram,
    ShardLog,
    ShardStorage,
    StorageError,
    StorageFull,
    StorageUnavailable,
)
from .backpressure import BackPressure
from .delayed import DelayedDelivery, Held, deliver_at
from .durable import CursorSink, DurableOptions, DurableSubscription
from .errors import (
    PublishRejected,
    SchemaMismatch,
    ShardUnavailable,
    StoreFull,
    StreamExists,
    StreamNotFound,
    SubscriptionBusy,
    SubscriptionNotFound,
)
from .message import Message, now_ms
from .placement import DurableWatcher, Fanout, ShardPlacement
from .records import encode_message, encode_records
from .retained import RetainedStore
from .schema_registry import SchemaRegistry, SchemaVersion
from .schemas import check_payload
from .streams import (
    DispatchMode,
    RoutingRule,
    Schema,
    Shard,
    Stream,
    StreamConfig,
    StreamRouter,
    TopologySink,
)
from .subscriptions import EXCLUSIVE, SHARED, Consumer, Subscription, SubscriptionType
from .trie import TopicTrie

log = logging.getLogger(__name__)

BYTES = Schema.BYTES  # (a plain name: an Enum member lookup costs a call on CPython 3.11)

MATCH_CACHE_LIMIT = 50_000
INTERNAL_PREFIX = "$internal/"
SCHEMAS_PREFIX = INTERNAL_PREFIX + "schemas/"

# What `publish_many` returns per message: None (stored and dispatched, or held for later), the
# commit future to wait on before acknowledging, or the error that refused the message.
PublishOutcome = asyncio.Future[None] | PublishRejected | None
# How `publish_many` finishes a message after the appends: dispatched once appended to its
# shard's log, dispatched from memory (a non-reliable shard), or delivered as transient.
_STORED, _MEMORY, _TRANSIENT = 0, 1, 2

# One entry per matched subscription: the subscription and the filters of it that matched.
Matches = list[tuple[Subscription, tuple[str, ...]]]


@dataclass(slots=True)
class BrokerStats:
    started_at: float = field(default_factory=time.time)
    messages_in: int = 0
    bytes_in: int = 0
    messages_out: int = 0
    bytes_out: int = 0
    messages_dropped: int = 0
    messages_without_subscriber: int = 0
    # Plain dict counters for metrics, read at scrape time: per producer or client protocol
    # ("mqtt", "amqp", "grpc", ...; "" for the broker's own messages) and per stream.
    in_by_protocol: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_in_by_protocol: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    in_by_stream: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_in_by_stream: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    out_by_protocol: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_out_by_protocol: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    out_by_stream: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_out_by_stream: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Drops counted through `drop` (messages_dropped also holds those counted directly).
    dropped_by_reason: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Publishes refused before they were stored, by reason ("schema": the payload does not fit
    # its stream's schema).
    rejected_by_reason: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Append to durable, once per commit group, from the group's first append (reliable streams).
    commit_latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def sent(self, protocol: str, message: Message) -> None:
        """Count `message` as delivered to a client over `protocol` (the broker's own `$SYS`
        statistics are not messages: they count neither in nor out)."""
        if message.producer_protocol == "sys":
            return
        size = len(message.payload)
        self.messages_out += 1
        self.bytes_out += size
        self.out_by_protocol[protocol] += 1
        self.bytes_out_by_protocol[protocol] += size
        self.out_by_stream[message.stream] += 1
        self.bytes_out_by_stream[message.stream] += size

    def sent_many(self, protocol: str, stream: str, count: int, size: int) -> None:
        """Count `count` messages of `stream`, `size` bytes in all, as delivered over
        `protocol` (what `sent` counts for each; the caller leaves out `$SYS` statistics)."""
        self.messages_out += count
        self.bytes_out += size
        self.out_by_protocol[protocol] += count
        self.bytes_out_by_protocol[protocol] += size
        self.out_by_stream[stream] += count
        self.bytes_out_by_stream[stream] += size

    def received(self, protocol: str, stream: str, count: int, size: int) -> None:
        """Count `count` messages of `size` bytes in all, taken from `protocol` into `stream`."""
        self.messages_in += count
        self.bytes_in += size
        self.in_by_protocol[protocol] += count
        self.bytes_in_by_protocol[protocol] += size
        self.in_by_stream[stream] += count
        self.bytes_in_by_stream[stream] += size

    def drop(self, reason: str, count: int = 1) -> None:
        """Count `count` messages dropped for `reason` (e.g. "slow_subscriber", "queue_full")."""
        self.messages_dropped += count
        self.dropped_by_reason[reason] += count


@dataclass(slots=True, eq=False)
class CommitGroup:
    """Messages appended to one shard's pending commit group, delivered once it is durable."""

    shard: Shard
    first_append: float
    # The messages held until the group is durable (those beyond the log's deliverable end).
    messages: list[Message] = field(default_factory=list)
    # The offset of the last stored message held (transient ones have none).
    last_offset: int = -1


class Broker:
    def __init__(
        self,
        storage: ShardStorage | None = None,
        default_stream: StreamConfig | None = None,
        *,
        restored_cursors_wait: bool = False,
    ) -> None:
        self.storage = storage
        self.stats = BrokerStats()
        # who is publishing now, and the queues that hold publishers (core/backpressure.py)
        self.back_pressure = BackPressure()
        self.retained: RetainedStore[Message] = RetainedStore()
        # Protocol state the broker keeps for itself (e.g. AMQP's durable topology), by topic
        # under `$internal/`: persisted like retained messages, never delivered or retained for
        # clients, never journaled.
        self.internal_state: dict[str, Message] = {}
        # Registered schemas per stream (`schema_registry.py`), persisted as internal state
        # under `$internal/schemas/<stream>`; `restore_schemas` reads them back.
        self.schemas = SchemaRegistry(on_change=self._schemas_changed)
        self.subscriptions: dict[str, Subscription] = {}
        self._streams: dict[str, Stream] = {}
        self._trie: TopicTrie[Subscription] = TopicTrie()
        self._match_cache: dict[str, Matches] = {}
        # The distinct values of `_match_cache`, so that topics matched by the same filters
        # share one list (with an id in every topic, most entries would otherwise be a list,
        # its pairs and their filter tuples of their own).
        self._match_results: dict[tuple[tuple[Subscription, tuple[str, ...]], ...], Matches] = {}
        self._topic_stream_cache: dict[str, Stream] = {}
        # Told of stream and route changes (the composition root persists them); set once the
        # streams of the configuration exist.
        self.topology_sink: TopologySink | None = None
        default = default_stream or StreamConfig("default")
        self.router = StreamRouter(default.name)
        self.create_stream(default)
        # A commit group's future → its shard, when its first append came and its messages.
        self._awaiting_commit: dict[asyncio.Future[None], CommitGroup] = {}
        # Shards with messages held until their commit (later ones must not overtake them).
        self._held: dict[Shard, int] = {}
        # Told of every change of a retained message (the composition root persists them).
        self.on_retained_change: Callable[[str, Message | None], None] | None = None
        # Where durable subscriptions save their cursors.
        self.cursor_sink: CursorSink | None = None
        # Where tiered replay reads what the journal no longer holds (set when archiving).
        self.archive: ArchiveSource | None = None
        # Told when a subscription is removed (the composition root forgets durable ones).
        self.on_subscription_removed: Callable[[Subscription], None] | None = None
        self.delayed = DelayedDelivery(None, self.publish)
        # Cluster mode only, while the node's data plane takes part (`join_cluster`; None on a
        # single node): where shards are served, which other nodes want a stored message, who
        # is told when local subscriptions change and when a retained message changes here.
        self.placement: ShardPlacement | None = None
        self.fanout: Fanout | None = None
        self.on_routes_changed: Callable[[], None] | None = None
        self._cluster_retained: Callable[[str, Message | None], None] | None = None
        # Cluster mode, from the restore until the node knows the shard map: cursors of reliable
        # shards restored from the store wait unplaced (`ShardCursor.placed`) until the cluster
        # places them (`DurableSubscription.place_restored`) and says so
        # (`restored_cursors_placed`). False on a single node.
        self.restored_cursors_wait = restored_cursors_wait
        # Told when a durable subscription is created or its filters change, so that its
        # definition is saved before the protocol confirms it (declare-ok, SUBACK, ...).
        self.on_durable_defined: Callable[[DurableSubscription], None] | None = None
        # Told after `on_durable_defined` / `on_subscription_removed` (a cluster's handover of
        # durable subscriptions: `watch_durables`).
        self._durable_watchers: list[DurableWatcher] = []

    # ---------------------------------------------------------------- streams and routing
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
        if self.topology_sink is not None:
            self.topology_sink.stream_saved(config)
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
        if self.topology_sink is not None:
            self.topology_sink.stream_saved(stream.config)
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
        if self.topology_sink is not None:
            self.topology_sink.stream_deleted(name)
        if self.storage is not None and stream.reliable:
            for shard in stream.shards:
                self.storage.delete_shard(name, shard.index)

    def add_route(self, rule: RoutingRule) -> None:
        self.stream(rule.stream)
        self.router.add_rule(rule)
        self._topic_stream_cache.clear()
        if self.topology_sink is not None:
            self.topology_sink.route_saved(rule)

    def remove_route(self, topic_filter: str) -> bool:
        """Remove the routing rule of `topic_filter`; whether there was one."""
        removed = self.router.remove_rule(topic_filter)
        self._topic_stream_cache.clear()
        if removed and self.topology_sink is not None:
            self.topology_sink.route_removed(topic_filter)
        return removed

    def stream_for_topic(self, topic: str) -> Stream:
        stream = self._topic_stream_cache.get(topic)
        if stream is None:
            stream = self._streams[self.router.resolve(topic)]
            if len(self._topic_stream_cache) > MATCH_CACHE_LIMIT:
                self._topic_stream_cache.clear()
            self._topic_stream_cache[topic] = stream
        return stream

    # ---------------------------------------------------------------- subscriptions
    def subscription(
        self,
        name: str,
        type: SubscriptionType = SubscriptionType.EXCLUSIVE,
        *,
        durable: bool = False,
        create: bool = True,
        owner: object = None,
    ) -> Subscription:
        sub = self.subscriptions.get(name)
        if sub is None:
            if not create:
                raise SubscriptionNotFound(f"subscription {name!r} does not exist")
            if durable:
                return self.durable_subscription(name, type, owner=owner)
            sub = self.subscriptions[name] = Subscription(name, type, False, owner)
        return sub

    def durable_subscription(
        self,
        name: str,
        type: SubscriptionType = SubscriptionType.EXCLUSIVE,
        *,
        options: DurableOptions | None = None,
        owner: object = None,
        initial_position: str | int = "latest",
    ) -> DurableSubscription:
        """Get or create a durable subscription (cursors, acks, redelivery)."""
        sub = self.subscriptions.get(name)
        if isinstance(sub, DurableSubscription):
            return sub
        if sub is not None:
            raise SubscriptionBusy(f"subscription {name!r} exists and is not durable")
        sub = DurableSubscription(self, name, type, options, owner, initial_position, self.cursor_sink)
        self.subscriptions[name] = sub
        if initial_position != "latest":
            sub.open_cursors()
        self._durable_defined(sub)
        return sub

    def _durable_defined(self, sub: Subscription) -> None:
        if isinstance(sub, DurableSubscription):
            if self.on_durable_defined is not None:
                self.on_durable_defined(sub)
            for watcher in self._durable_watchers:
                watcher.durable_defined(sub)

    def durable_changed(self, sub: DurableSubscription) -> None:
        """`sub`'s definition changed in a way only its owner knows (its options): saved again,
        as when its filters change."""
        self._durable_defined(sub)

    def watch_durables(self, watcher: DurableWatcher) -> None:
        """Tell `watcher` of every durable subscription defined, changed or removed from now
        on, after the store was told (`on_durable_defined`, `on_subscription_removed`)."""
        self._durable_watchers.append(watcher)

    def restored_cursors_placed(self) -> None:
        """The cluster knows the shard map: restored cursors no longer wait to be placed."""
        self.restored_cursors_wait = False

    def add_filter(self, sub: Subscription, topic_filter: str, options: object = None) -> bool:
        """Add (or update the options of) a filter; True if the filter is new to `sub`."""
        new = topic_filter not in sub.filters
        if new:
            # First: a filter the trie refuses (TopicError) never becomes part of `sub`, so
            # it is never saved with it either.
            self._trie.add(topic_filter, sub)
        sub.filters[topic_filter] = options
        if new:
            sub.filters_changed()
            self._forget_matches()
            if self.on_routes_changed is not None:
                self.on_routes_changed()
            self._durable_defined(sub)
        return new

    def remove_filter(self, sub: Subscription, topic_filter: str) -> bool:
        if topic_filter not in sub.filters:
            return False
        del sub.filters[topic_filter]
        self._trie.remove(topic_filter, sub)
        sub.filters_changed()
        self._forget_matches()
        if self.on_routes_changed is not None:
            self.on_routes_changed()
        self._durable_defined(sub)
        return True

    def remove_subscription(self, name: str, *, forget: bool = True) -> Subscription | None:
        """Remove subscription `name`; a durable one is forgotten by its store and watchers
        too, unless `forget` is False (one that was never fully restored: its stored record
        stays as it was)."""
        sub = self.subscriptions.pop(name, None)
        if isinstance(sub, DurableSubscription):
            sub.close()
            if forget and self.on_subscription_removed is not None:
                self.on_subscription_removed(sub)
            for watcher in self._durable_watchers if forget else ():
                watcher.durable_removed(sub)
        if sub is not None:
            for topic_filter in list(sub.filters):
                self._trie.remove(topic_filter, sub)
            sub.filters.clear()
            sub.filters_changed()
            self._forget_matches()
            if self.on_routes_changed is not None:
                self.on_routes_changed()
        return sub

    def attach(self, sub: Subscription, consumer: Consumer) -> None:
        sub.attach(consumer)
        sub.wake()
        if self.on_routes_changed is not None:
            self.on_routes_changed()

    def detach(self, sub: Subscription, consumer: Consumer) -> None:
        sub.detach(consumer)
        if self.on_routes_changed is not None:
            self.on_routes_changed()

    def routes_ready(self) -> asyncio.Future[None] | None:
        """None when a subscription made now is already known wherever a message for it may
        be stored (always on a single node); else a future that resolves once it is (a
        cluster's other nodes: `Fanout.routes_ready`)."""
        fanout = self.fanout
        return None if fanout is None else fanout.routes_ready()

    @property
    def subscription_count(self) -> int:
        return len(self._trie)

    def forget_cached_matches(self) -> None:
        """Drop the per-topic caches (topic → stream, topic → subscriptions, and each durable
        subscription's), which are rebuilt on demand: an idle broker gives their memory back."""
        self._match_cache = {}
        self._match_results = {}
        self._topic_stream_cache = {}
        for sub in list(self.subscriptions.values()):
            if isinstance(sub, DurableSubscription):
                sub.forget_cached_matches()

    def _forget_matches(self) -> None:
        self._match_cache.clear()
        self._match_results.clear()

    def match(self, topic: str) -> Matches:
        matches = self._match_cache.get(topic)
        if matches is None:
            grouped: dict[Subscription, list[str]] = {}
            for topic_filter, sub in self._trie.match(topic):
                grouped.setdefault(sub, []).append(topic_filter)
            matches = [(sub, tuple(filters)) for sub, filters in grouped.items()]
            found = tuple(matches)
            shared = self._match_results.get(found)
            if shared is None:
                self._match_results[found] = matches
            else:
                matches = shared
            if len(self._match_cache) >= MATCH_CACHE_LIMIT:
                self._forget_matches()
            self._match_cache[topic] = matches
        return matches

    # ---------------------------------------------------------------- publish
    def publish(self, message: Message, *, counted: bool = True) -> asyncio.Future[None] | None:
        """Accept a message. Returns None when it is already stored and dispatched, or a future
        that resolves once it is durable (then it is dispatched); the future fails with
        PublishRejected if the store could not take it. `counted=False`: a message another
        node took from its client and forwarded here (counted there, once)."""
        shard = self._route(message, counted)
        if isinstance(shard, Held):
            return shard.receipt  # held for delayed delivery
        placement = self.placement
        if placement is not None and not placement.serves(shard.stream, shard.index):
            return placement.forward(message)
        if message.retain:
            self._retain(message)
        if shard.log is None:
            message.offset = shard.next_offset
            shard.next_offset += 1
            self.dispatch(message)
            return None
        if message.transient and not self._wanted_durably(message.topic):
            return self._deliver_transient(shard, message)
        return self._append_reliable(shard, message)

    def publish_many(
        self, messages: Sequence[Message], *, counted: bool = True, stop_at_refusal: bool = False
    ) -> list[PublishOutcome]:
        """Accept several messages (e.g. every PUBLISH of one socket read) as `publish` accepts
        each, with ONE journal append per reliable shard. Returns one outcome per message, in
        order: None (stored and dispatched, or held for delayed delivery), the commit future
        to wait on before acknowledging (shared by the messages of one commit group), or the
        `PublishRejected` that refused that message alone: a rejected message does not affect
        the others.

        Per message it is `publish`: authorisation is the caller's, then delayed delivery,
        schema check, statistics (once), cluster forward, retained, transient handling. The
        messages of a shard are stored and dispatched in their order; messages of different
        shards are dispatched in the order of the list too, after the appends.

        `stop_at_refusal`: the first message refused before the appends (schema, reserved
        topic, forward) ends the list there: the messages after it are not processed at all
        (not counted, retained, stored or dispatched) and the outcomes returned stop at it
        (a client that is disconnected for a refusal expects nothing after it to take
        effect). A refusal by the journal itself does not stop the others."""
        count = len(messages)
        if count == 1:
            try:
                return [self.publish(messages[0], counted=counted)]
            except PublishRejected as exc:
                return [exc]
        outcomes: list[PublishOutcome] = [None] * count
        # What happens to each message once the appends are done, in the list's order: the
        # shard it is stored in or dispatched from, and how (_STORED, _MEMORY, _TRANSIENT).
        steps: list[tuple[int, Shard, int]] = []
        # Reliable shards: the indices of their messages to append, and the messages.
        appends: dict[Shard, tuple[list[int], list[Message]]] = {}
        placement = self.placement
        # A read mostly repeats one topic: after a message routed with nothing particular (no
        # `$`, key or headers, a bytes schema, served here), the next ones of the same topic
        # and protocol take its shard without routing again and are counted together.
        plain_topic: str | None = None
        plain_protocol = plain_name = ""
        plain_shard: Shard | None = None
        plain_count = plain_bytes = 0
        # The plain shard's lists in `appends`, once one of its messages is to be stored: the
        # next ones (neither retained nor transient) join them directly.
        plain_pending: tuple[list[int], list[Message]] | None = None
        for index, message in enumerate(messages):
            try:
                if (
                    message.topic == plain_topic and message.key is None and not message.headers
                    and message.producer_protocol == plain_protocol
                ):
                    shard = plain_shard
                    assert shard is not None
                    message.stream = plain_name
                    message.shard = shard.index
                    plain_count += 1
                    plain_bytes += len(message.payload)
                    if plain_pending is not None and not message.retain and not message.transient:
                        plain_pending[0].append(index)
                        plain_pending[1].append(message)
                        steps.append((index, shard, _STORED))
                        continue
                else:
                    routed = self._route(message, counted)
                    if isinstance(routed, Held):
                        outcomes[index] = routed.receipt  # held for delayed delivery
                        continue
                    shard = routed
                    if placement is not None and not placement.serves(shard.stream, shard.index):
                        outcomes[index] = placement.forward(message)
                        continue
                    if (
                        message.key is None and not message.headers
                        and message.topic[:1] != "$" and message.producer_protocol != "sys"
                        and self._streams[shard.stream].config.schema is Schema.BYTES
                    ):
                        if plain_count and counted:
                            self.stats.received(plain_protocol, plain_name, plain_count, plain_bytes)
                        plain_topic, plain_protocol = message.topic, message.producer_protocol
                        plain_shard, plain_name = shard, message.stream
                        plain_count = plain_bytes = 0
                        plain_pending = None
                if shard.log is None:
                    step = _MEMORY
                elif message.transient and not self._wanted_durably(message.topic):
                    step = _TRANSIENT
                else:
                    pending = appends.get(shard)
                    if pending is None:
                        pending = appends[shard] = ([], [])
                    pending[0].append(index)
                    pending[1].append(message)
                    step = _STORED
                    if shard is plain_shard:
                        plain_pending = pending
                if message.retain:
                    self._retain(message)
            except PublishRejected as exc:
                outcomes[index] = exc
                if stop_at_refusal:
                    del outcomes[index + 1:]
                    break
                continue
            steps.append((index, shard, step))
        if plain_count and counted:
            self.stats.received(plain_protocol, plain_name, plain_count, plain_bytes)
        waiters: dict[Shard, asyncio.Future[None] | None] = {}
        for shard, (indices, group) in appends.items():
            try:
                records = encode_records(group)
            except (ValueError, OverflowError, struct.error):
                indices, group, records = self._encodable(indices, group, outcomes)
                if not group:
                    continue
            waiter = waiters[shard] = self._append_group(shard, group, records, indices, outcomes)
            if len(appends) == 1 and len(steps) == len(indices):
                # The common case (one shard, every message stored): dispatch them as a group.
                self._appended_group(shard, group, waiter, indices, outcomes)
                return outcomes
        for index, shard, step in steps:
            message = messages[index]
            if step == _STORED:
                if outcomes[index] is None:  # not refused by the journal
                    outcomes[index] = self._appended(shard, message, waiters[shard])
            elif step == _MEMORY:
                message.offset = shard.next_offset
                shard.next_offset += 1
                self.dispatch(message)
            else:
                outcomes[index] = self._deliver_transient(shard, message)
        return outcomes

    @staticmethod
    def _encodable(
        indices: list[int], group: list[Message], outcomes: list[PublishOutcome]
    ) -> tuple[list[int], list[Message], list[tuple[int, bytes]]]:
        """The messages of `group` that encode as records, with their records; the others
        are refused in `outcomes` (a field the record format cannot hold)."""
        kept_indices: list[int] = []
        kept: list[Message] = []
        records: list[tuple[int, bytes]] = []
        for index, message in zip(indices, group, strict=True):
            try:
                records.append((message.publish_time_ms, encode_message(message)))
            except (ValueError, OverflowError, struct.error) as exc:
                outcomes[index] = PublishRejected(f"the message cannot be stored: {exc}")
                continue
            kept_indices.append(index)
            kept.append(message)
        return kept_indices, kept, records

    def _check_schema(self, config: StreamConfig, message: Message) -> None:
        """Raise SchemaMismatch (counted as rejected for "schema") when the payload does not
        fit the stream's schema."""
        try:
            check_payload(config.schema, message.payload, config.name)
        except SchemaMismatch as exc:
            self.stats.rejected_by_reason["schema"] += 1
            self.schemas.refused(config.name, exc)  # logged there, rate-limited
            raise

    def _route(self, message: Message, counted: bool) -> Shard | Held:
        """The first steps of a publish: reserved topics refused, delayed messages held (Held,
        with the receipt to acknowledge on),
        the stream's schema checked, the stream and shard chosen (set on the message) and the
        message counted. Raises PublishRejected."""
        topic = message.topic
        if topic[:1] == "$" or message.headers:
            if topic.startswith(INTERNAL_PREFIX):
                raise PublishRejected(f"{INTERNAL_PREFIX} topics are reserved for the broker")
            at_ms = deliver_at(message)
            if at_ms is not None and at_ms > now_ms():
                # Refused now if it will not fit its stream's schema when it is due.
                held_in = self.stream_for_topic(message.topic).config
                if held_in.schema is not Schema.BYTES:
                    self._check_schema(held_in, message)
                self._check_registered(held_in.name, message.payload)
                return Held(self.delayed.hold(message, at_ms))
            topic = message.topic
        stream = self.stream_for_topic(topic)
        config = stream.config
        if config.schema is not BYTES:
            self._check_schema(config, message)
        if self.schemas.checks:
            self._check_registered(config.name, message.payload)
        shard = stream.shard_for(topic, message.key)
        message.stream = name = config.name
        protocol = message.producer_protocol
        if counted and protocol != "sys":  # the broker's own $SYS statistics are not messages
            stats = self.stats
            size = len(message.payload)
            stats.messages_in += 1
            stats.bytes_in += size
            stats.in_by_protocol[protocol] += 1
            stats.bytes_in_by_protocol[protocol] += size
            stats.in_by_stream[name] += 1
            stats.bytes_in_by_stream[name] += size
        message.shard = shard.index
        return shard

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

    def _wanted_durably(self, topic: str) -> bool:
        """Whether a durable subscription (one that replays the journal) matches `topic`.

        In a cluster a durable subscription on another node counts too: it needs the message's
        offset in this journal (its cursor drops a push without one)."""
        if any(sub.durable for sub, _ in self.match(topic)):
            return True
        fanout = self.fanout
        return fanout is not None and fanout.wanted_durably_elsewhere(topic)

    def _deliver_transient(self, shard: Shard, message: Message) -> asyncio.Future[None] | None:
        """A transient message that no durable subscription wants: not journaled (so not
        archived either) and without an offset. It is delivered at once (returns None), unless
        the shard's stored messages are being held until their commit: then it waits behind
        them, so that subscribers see the producer's order, and the commit future that
        releases it is returned (the caller learns when it was delivered)."""
        if shard in self._held:
            for waiter, group in reversed(self._awaiting_commit.items()):
                if group.shard is shard and group.messages:
                    group.messages.append(message)
                    return waiter
        self.dispatch(message)
        return None

    def _append_reliable(self, shard: Shard, message: Message) -> asyncio.Future[None] | None:
        shard_log = shard.log
        assert shard_log is not None
        try:
            message.offset = shard_log.append([(message.publish_time_ms, encode_message(message))])
        except StorageUnavailable as exc:
            raise ShardUnavailable(f"the shard cannot take the message now: {exc}") from exc
        except StorageFull as exc:
            raise StoreFull(f"the journal refused the message: {exc}") from exc
        except StorageError as exc:
            raise PublishRejected(f"the journal refused the message: {exc}") from exc
        shard.next_offset = message.offset + 1
        return self._appended(shard, message, shard_log.commit_waiter())

    def _append_group(
        self,
        shard: Shard,
        group: list[Message],
        records: list[tuple[int, bytes]],
        indices: list[int],
        outcomes: list[PublishOutcome],
    ) -> asyncio.Future[None] | None:
        """Append the records of `group` (messages of one shard, in order) with one call; a
        message the journal refuses gets its error in `outcomes`. Returns the commit waiter."""
        shard_log = shard.log
        assert shard_log is not None
        try:
            first = shard_log.append(records)
        except StorageError:
            # The journal takes a batch whole or not at all: offer them one by one, so that
            # what fits is stored and only the rest is refused, as single publishes would be.
            for message, record, index in zip(group, records, indices, strict=True):
                try:
                    message.offset = shard_log.append([record])
                except StorageUnavailable as exc:
                    outcomes[index] = ShardUnavailable(f"the shard cannot take the message now: {exc}")
                except StorageFull as exc:
                    outcomes[index] = StoreFull(f"the journal refused the message: {exc}")
                except StorageError as exc:
                    outcomes[index] = PublishRejected(f"the journal refused the message: {exc}")
                else:
                    shard.next_offset = message.offset + 1
        else:
            for message in group:
                message.offset = first
                first += 1
            shard.next_offset = first
        return shard_log.commit_waiter()

    def _appended_group(
        self,
        shard: Shard,
        group: list[Message],
        waiter: asyncio.Future[None] | None,
        indices: list[int],
        outcomes: list[PublishOutcome],
    ) -> None:
        """`_appended` for each message of `group` (appended to `shard` in order), setting its
        outcome; messages the journal refused (an outcome already) are skipped."""
        if waiter is None:
            for message, index in zip(group, indices, strict=True):
                if outcomes[index] is None:
                    self.dispatch(message)
            return
        commit_group = self._awaiting_commit.get(waiter)
        if commit_group is None:
            commit_group = self._awaiting_commit[waiter] = CommitGroup(shard, time.perf_counter())
            waiter.add_done_callback(self._on_commit)
        shard_log = shard.log
        assert shard_log is not None
        deliverable_end = shard_log.deliverable_end
        held = self._held
        if shard in held:
            self._release_reserved(shard, deliverable_end)
        now: list[Message] = []
        holding = shard in held
        for message, index in zip(group, indices, strict=True):
            if outcomes[index] is not None:
                continue  # refused by the journal
            outcomes[index] = waiter
            if message.offset < deliverable_end and not holding:
                now.append(message)  # see `_appended`
            else:
                if not commit_group.messages:
                    held[shard] = held.get(shard, 0) + 1
                holding = True
                commit_group.messages.append(message)
                commit_group.last_offset = message.offset
        if now:
            self.dispatch_all(now)

    def _appended(
        self, shard: Shard, message: Message, waiter: asyncio.Future[None] | None
    ) -> asyncio.Future[None] | None:
        """Dispatch `message`, just appended to `shard`'s log, now or once its commit group
        (`waiter`) is durable; returns the waiter (None: durable already)."""
        if waiter is None:  # durable already (an engine that writes synchronously)
            self.dispatch(message)
            return None
        group = self._awaiting_commit.get(waiter)
        if group is None:
            group = self._awaiting_commit[waiter] = CommitGroup(shard, time.perf_counter())
            waiter.add_done_callback(self._on_commit)
        shard_log = shard.log
        assert shard_log is not None
        deliverable_end = shard_log.deliverable_end
        if shard in self._held:
            self._release_reserved(shard, deliverable_end)
        if message.offset < deliverable_end and shard not in self._held:
            # Subscribers get it now; the publisher's acknowledgement (the returned future)
            # still waits for durability. The log never gives this offset to another record,
            # so what a subscriber saw is never contradicted, even if this commit fails.
            self.dispatch(message)
        else:
            # Beyond the log's reservation: delivered once durable, in order.
            if not group.messages:
                self._held[shard] = self._held.get(shard, 0) + 1
            group.messages.append(message)
            group.last_offset = message.offset
        return waiter

    def _release_reserved(self, shard: Shard, deliverable_end: int) -> None:
        """Dispatch now, oldest first, the held messages of `shard` that the log's durable
        reservation has come to cover (all below `deliverable_end`), as if they had been
        appended below it: without this, a shard that had to hold once (a fresh journal's
        first group) would keep holding behind each commit under a steady load."""
        held = self._held
        for group in list(self._awaiting_commit.values()):
            if group.shard is not shard or not group.messages:
                continue
            if group.last_offset >= deliverable_end:
                return  # this one and the later ones still wait, in order
            messages, group.messages = group.messages, []
            count = held.get(shard, 0) - 1
            if count > 0:
                held[shard] = count
            else:
                held.pop(shard, None)
            self.dispatch_all(messages)

    def _on_commit(self, waiter: asyncio.Future[None]) -> None:
        group = self._awaiting_commit.pop(waiter, None)
        if group is None:
            return
        shard = group.shard
        if group.messages:
            held = self._held.get(shard, 0) - 1
            if held > 0:
                self._held[shard] = held
            else:
                self._held.pop(shard, None)
        if not (waiter.cancelled() or waiter.exception() is not None):
            self.stats.commit_latency.observe(time.perf_counter() - group.first_append)
            self.dispatch_all(group.messages)
            if shard in self._held:  # later groups the reservation covers now go out too
                assert shard.log is not None
                self._release_reserved(shard, shard.log.deliverable_end)
            return
        error = "cancelled" if waiter.cancelled() else waiter.exception()
        log.error("journal commit failed on %s/%d: %s; %d held messages not delivered",
                  shard.stream, shard.index, error, len(group.messages))
        # The failed offsets are not handed out again (the log skips them), so what a
        # subscriber already saw is never contradicted; publishers got no acknowledgement.

    def dispatch(self, message: Message, share_groups: Container[str] | None = None) -> int:
        """Hand a stored message to each matching subscription; returns how many took it.

        In a cluster the fanout first pushes it to the other nodes that want it. A message
        pushed here by its shard's owner comes with `share_groups`: the shared subscriptions
        chosen on this node (the other shared ones were served elsewhere)."""
        matches = self.match(message.topic)
        fanout = self.fanout
        if fanout is not None and share_groups is None:
            share_groups = fanout.push(message, matches)
        if not matches:
            self.stats.messages_without_subscriber += 1
            return 0
        delivered = 0
        exclusive = EXCLUSIVE
        for sub, filters in matches:
            if (
                share_groups is not None
                and sub.type is SHARED
                and sub.name not in share_groups
            ):
                continue
            if sub.durable:
                sub.offer(message, filters)  # type: ignore[attr-defined]
                delivered += 1
                continue
            if sub.type is exclusive and sub.consumers:
                consumer: Consumer | None = sub.consumers[0]  # what `pick` chooses, inline
            else:
                consumer = sub.pick(message.shard)
            if consumer is None:
                self.stats.drop("no_consumer")  # a live subscription nobody consumes
                continue
            consumer.deliver(message, sub, filters)
            delivered += 1
        return delivered

    def dispatch_all(self, messages: list[Message]) -> None:
        """`dispatch` each of `messages`, in order (a commit group, the stored messages of a
        read): the subscriptions are looked up once per run of messages on one topic.

        A delivery may change the subscriptions (a slow subscriber disconnected): the run's
        lookup is reused only while the match cache still holds it."""
        if self.fanout is not None or len(messages) < 2:
            for message in messages:
                self.dispatch(message)
            return
        stats = self.stats
        exclusive = EXCLUSIVE
        topic: str | None = None
        matches: Matches = []
        for message in messages:
            if message.topic != topic or self._match_cache.get(topic) is not matches:
                topic = message.topic
                matches = self.match(topic)
            if not matches:
                stats.messages_without_subscriber += 1
                continue
            for sub, filters in matches:
                if sub.durable:
                    sub.offer(message, filters)  # type: ignore[attr-defined]
                    continue
                if sub.type is exclusive and sub.consumers:
                    consumer: Consumer | None = sub.consumers[0]  # `pick`, inline
                else:
                    consumer = sub.pick(message.shard)
                if consumer is None:
                    stats.drop("no_consumer")  # a live subscription nobody consumes
                    continue
                consumer.deliver(message, sub, filters)

    def keep_internal(self, message: Message) -> None:
        """Keep `message` as internal state under its topic (which must start with
        `$internal/`); an empty payload removes it. Persisted through `on_retained_change`."""
        if not message.topic.startswith(INTERNAL_PREFIX):
            raise ValueError(f"internal state lives under {INTERNAL_PREFIX}, not {message.topic!r}")
        if message.payload:
            self.internal_state[message.topic] = message
        elif self.internal_state.pop(message.topic, None) is None:
            return
        if self.on_retained_change is not None:
            self.on_retained_change(message.topic, message if message.payload else None)

    def forget_retained(self, topic: str) -> None:
        """Remove the retained message of `topic`, if any (its store is told)."""
        self._retain(Message(topic, b""))

    def _retain(self, message: Message) -> None:
        if message.payload:
            self.retained.set(message.topic, message)
            changed: Message | None = message
        else:
            if not self.retained.delete(message.topic):
                return
            changed = None
        if self.on_retained_change is not None:
            self.on_retained_change(message.topic, changed)
        if self._cluster_retained is not None:
            self._cluster_retained(message.topic, changed)

    def retain_from_peer(self, topic: str, message: Message | None) -> None:
        """Cluster mode: another node set (or cleared, None) the retained message of `topic`;
        kept here and stored, not told back to the cluster."""
        if message is not None:
            self.retained.set(topic, message)
        elif not self.retained.delete(topic):
            return
        if self.on_retained_change is not None:
            self.on_retained_change(topic, message)

    def join_cluster(self, placement: ShardPlacement, fanout: Fanout, *,
                     routes_changed: Callable[[], None],
                     retained_changed: Callable[[str, Message | None], None]) -> None:
        """Cluster mode: the node's data plane takes part from now on. Publishes consult
        `placement` (stored here or forwarded to the shard's owner), stored messages go through
        `fanout` to the other nodes that want them, `routes_changed` is told after each change
        of the local subscriptions and `retained_changed` after each retained message set or
        cleared here (after the store)."""
        self.placement = placement
        self.fanout = fanout
        self.on_routes_changed = routes_changed
        self._cluster_retained = retained_changed

    def leave_cluster(self, placement: ShardPlacement) -> None:
        """The data plane that joined as `placement` stopped: the node behaves as a single
        node again (every shard stored here; nothing pushed)."""
        if self.placement is not placement:
            return
        self.placement = None
        self.fanout = None
        self.on_routes_changed = None
        self._cluster_retained = None
