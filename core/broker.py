"""The core broker: routes published messages to streams and shards and dispatches them live.

The hot path is `publish`: resolve the topic's stream and shard (cached per topic), assign the
offset, and hand the message to every matching subscription's chosen consumer — with no await
and no task per message. Reliable streams append to the shard's log first and dispatch at once
when the log promises never to reuse the offset (`deliverable_end`: not after a failed commit,
not after a crash), else once the commit group is durable; either way the caller gets the
commit future to hold its acknowledgement on (acknowledged means durable).

`Broker` holds the state and the publish and dispatch path; its other concerns are parts:
`stream_catalog.py` (streams, routing rules, schemas), `subscription_registry.py`
(subscriptions, filters, the match cache), `shard_appends.py` (storing in shard logs and
commit groups), `kept_state.py` (retained messages, internal state); `broker_stats.py` counts.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Container, Sequence

from ..storage.interfaces import ArchiveSource, ShardStorage
from .backpressure import BackPressure
from .broker_stats import BrokerStats
from .delayed import DelayedDelivery, Held, deliver_at
from .durable import CursorSink
from .errors import PublishRejected
from .kept_state import INTERNAL_PREFIX, INTERNAL_PRODUCER, KeptState
from .message import Message, now_ms
from .placement import DurableWatcher, Fanout, ShardPlacement
from .ports import DelayedStore
from .records import encode_records
from .resends import ResendCheck, is_resent
from .retained import RetainedStore
from .schema_registry import SchemaRegistry
from .shard_appends import CommitGroup, PublishOutcome, ShardAppends
from .store_ports import PortSlot, StateKeeper
from .stream_catalog import StreamCatalog
from .streams import Schema, Shard, Stream, StreamConfig, StreamRouter, TopologySink
from .subscription_registry import MATCH_CACHE_LIMIT, Matches, SubscriptionRegistry
from .subscriptions import EXCLUSIVE, SHARED, Consumer, Subscription
from .trie import TopicTrie

__all__ = ["INTERNAL_PREFIX", "MATCH_CACHE_LIMIT", "Broker", "BrokerStats", "CommitGroup", "Matches",
           "PublishOutcome"]

log = logging.getLogger(__name__)

BYTES = Schema.BYTES  # (a plain name: an Enum member lookup costs a call on CPython 3.11)

# How `publish_many` finishes a message after the appends: dispatched once appended to its
# shard's log, dispatched from memory (a non-reliable shard), or delivered as transient.
_STORED, _MEMORY, _TRANSIENT = 0, 1, 2


class Broker(StreamCatalog, SubscriptionRegistry, ShardAppends, KeptState):
    def __init__(
        self,
        storage: ShardStorage | None = None,
        default_stream: StreamConfig | None = None,
        *,
        restored_cursors_wait: bool = False,
        cursor_sink: CursorSink | None = None,
        keeper: PortSlot[StateKeeper] | None = None,
        topology: PortSlot[TopologySink] | None = None,
        archive: PortSlot[ArchiveSource] | None = None,
        delayed_store: DelayedStore | None = None,
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
        # Told of stream and route changes (the composition root persists them); filled once
        # the streams of the configuration exist (`core/store_ports.py`).
        self.topology: PortSlot[TopologySink] = topology if topology is not None else PortSlot()
        # Told of every change of a retained message or internal state, and of durable
        # subscriptions defined, changed and removed, to keep them across a restart (the
        # composition root's store fills it once it has restored them: `core/store_ports.py`).
        self.keeper: PortSlot[StateKeeper] = keeper if keeper is not None else PortSlot()
        # Where durable subscriptions save their cursors (None: nowhere).
        self.cursor_sink = cursor_sink
        # Where tiered replay reads what the journal no longer holds (filled when archiving).
        self.archive_source: PortSlot[ArchiveSource] = archive if archive is not None else PortSlot()
        default = default_stream or StreamConfig("default")
        self.router = StreamRouter(default.name)
        self.create_stream(default)
        # A commit group's future → its shard, when its first append came and its messages.
        self._awaiting_commit: dict[asyncio.Future[None], CommitGroup] = {}
        # Shards with messages held until their commit (later ones must not overtake them).
        self._held: dict[Shard, int] = {}
        # Delayed messages held in `delayed_store` (None: in memory), read back by
        # `delayed.restore()` at start.
        self.delayed = DelayedDelivery(delayed_store, self.publish)
        # Cluster mode only, while the node's data plane takes part (`join_cluster`; None on a
        # single node): where shards are served, which other nodes want a stored message, who
        # is told when local subscriptions change and when a retained message changes here.
        self.placement: ShardPlacement | None = None
        # The look-up of messages sent again in the shards stored here (`core/resends.py`).
        self.resends = ResendCheck()
        self.fanout: Fanout | None = None
        self.on_routes_changed: Callable[[], None] | None = None
        self._cluster_retained: Callable[[str, Message | None], None] | None = None
        # Cluster mode, from the restore until the node knows the shard map: cursors of reliable
        # shards restored from the store wait unplaced (`ShardCursor.placed`) until the cluster
        # places them (`DurableSubscription.place_restored`) and says so
        # (`restored_cursors_placed`). False on a single node.
        self.restored_cursors_wait = restored_cursors_wait
        # Told after the keeper of durable subscriptions defined and removed (a cluster's
        # handover of durable subscriptions: `watch_durables`).
        self._durable_watchers: list[DurableWatcher] = []

    @property
    def archive(self) -> ArchiveSource | None:
        """Where tiered replay reads what the journal no longer holds; None when not archiving."""
        return self.archive_source.current

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
        if placement is not None and not placement.stores(shard.stream, shard.index):
            return placement.forward(message)
        if message.native_properties is not None and is_resent(message):
            # sent again: a copy already stored is acknowledged where it is (`core/resends.py`)
            if self.resends.stored_at(message, shard) is not None:
                return None
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
        effect). A refusal by the journal itself does not stop the others.

        Messages sent again (`core/resends.py`: a client's retry) are looked for first, so a
        list holding one goes through `publish` one message at a time."""
        count = len(messages)
        if count == 1 or any(m.native_properties is not None and is_resent(m) for m in messages):
            return self._publish_each(messages, counted, stop_at_refusal)
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
                    if placement is not None and not placement.stores(shard.stream, shard.index):
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

    def _publish_each(self, messages: Sequence[Message], counted: bool,
                      stop_at_refusal: bool) -> list[PublishOutcome]:
        outcomes: list[PublishOutcome] = []
        for message in messages:
            try:
                outcomes.append(self.publish(message, counted=counted))
            except PublishRejected as exc:
                outcomes.append(exc)
                if stop_at_refusal:
                    break
        return outcomes

    def _route(self, message: Message, counted: bool) -> Shard | Held:
        """The first steps of a publish: reserved topics refused, delayed messages held (Held,
        with the receipt to acknowledge on),
        the stream's schema checked, the stream and shard chosen (set on the message) and the
        message counted. Raises PublishRejected."""
        topic = message.topic
        if topic[:1] == "$" or message.headers:
            if topic.startswith(INTERNAL_PREFIX) and message.producer_protocol != INTERNAL_PRODUCER:
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

    def _wanted_durably(self, topic: str) -> bool:
        """Whether a durable subscription (one that replays the journal) matches `topic`.

        In a cluster a durable subscription on another node counts too: it needs the message's
        offset in this journal (its cursor drops a push without one)."""
        if any(sub.durable for sub, _ in self.match(topic)):
            return True
        fanout = self.fanout
        return fanout is not None and fanout.wanted_durably_elsewhere(topic)

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
