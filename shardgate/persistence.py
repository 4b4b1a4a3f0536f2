"""The broker's state kept in the metadata store: cursors saved in batches, retained messages
and internal state, durable subscriptions (`Persistence`, the broker's `StateKeeper`), and
streams and routes declared at run time (CLI, gRPC Admin: `MetadataTopologySink`)."""

from __future__ import annotations

import abc
import asyncio
import gc
import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from .core.broker import INTERNAL_PREFIX, Broker
from .core.durable import DurableSubscription
from .core.errors import CoreError
from .core.message import Message, now_ms
from .core.records import decode_to_message, encode_message, forget_producer_tails
from .core.restoring import set_aside
from .core.streams import DispatchMode, RoutingRule, Schema, StreamConfig
from .core.subscriptions import Subscription, SubscriptionType
from .protocols.mqtt.encoders import forget_topic_fields
from .storage.allocators import return_freed_memory
from .storage.interfaces import IdleReleasable
from .storage.metadata import (
    MetadataStore,
    RouteRecord,
    StreamRecord,
    SubscriptionRecord,
)
from .storage.metadata.ports import MetadataPorts

log = logging.getLogger(__name__)

CURSOR_SAVE_INTERVAL_S = 0.2
RETENTION_EVERY_TICKS = 50  # every 10 s
IDLE_CHECK_EVERY_TICKS = 25  # every 5 s: a broker idle for one whole period gives memory back


def release_idle_memory(broker: Broker) -> None:
    """What a burst of load left behind, handed back once the broker is idle: the per-topic
    and per-producer caches and `re`'s compiled patterns (rebuilt on demand), unreachable
    cycles, Arrow's pool and the free pages of glibc's heap (which otherwise keep what the peak
    needed for good). A cache entry made under load and kept would hold a pool of Python's
    small-object heap, and with it its 1 MiB arena, for good."""
    broker.forget_cached_matches()
    forget_producer_tails()
    forget_topic_fields()
    for stream in list(broker.streams.values()):
        for shard in stream.shards:
            if isinstance(shard.log, IdleReleasable):
                shard.log.forget_caches()
    forget_abc_caches()
    re.purge()  # `re` keeps up to 512 compiled patterns: the load's subscriptions' filters
    gc.collect()
    return_freed_memory()
    # `release_free_pools` (storage/allocators.py) is not called here: it marks pool headers
    # while the GIL is released by its madvise call, and a worker thread taking that pool at
    # the same moment has not been ruled out.


def forget_abc_caches() -> None:
    """Empty every abstract base class's isinstance caches (`ABCMeta._abc_caches_clear`; the
    registrations stay). A type first checked against an ABC under load, such as
    `isinstance(arg, Mapping)` in every log record, adds a weak reference to the negative cache
    of that ABC and of each ABC below it: objects made mid-load that would live for good."""
    pending: list[type] = [object]
    seen: set[type] = set()
    while pending:
        cls = pending.pop()
        subclasses: list[type] = type.__subclasses__(cls)
        for sub in subclasses:
            if sub not in seen:
                seen.add(sub)
                pending.append(sub)
        if isinstance(cls, abc.ABCMeta):
            cls._abc_caches_clear()  # type: ignore[attr-defined]


def stream_record(config: StreamConfig, created_ms: int | None = None) -> StreamRecord:
    return StreamRecord(
        config.name, config.mode.value, config.partitions, config.retention_ms,
        config.retention_bytes, config.schema.value, None, created_ms or now_ms(),
        config.replicas, config.min_insync_replicas,
    )


def stream_config(record: StreamRecord) -> StreamConfig:
    return StreamConfig(
        record.name, mode=DispatchMode(record.mode), partitions=record.partitions,
        schema=Schema(record.schema),
        retention_ms=record.retention_ms, retention_bytes=record.retention_bytes,
        replicas=record.replicas, min_insync_replicas=record.min_insync_replicas,
    )


class MetadataTopologySink:
    """Writes streams and routing rules created, changed or deleted at run time to the
    metadata store at once (an admin call answers only after its change is stored)."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store

    def stream_saved(self, config: StreamConfig) -> None:
        existing = self.store.get_stream(config.name)
        self.store.put_stream(stream_record(config, existing.created_ms if existing else None))

    def stream_deleted(self, name: str) -> None:
        self.store.delete_stream(name)

    def route_saved(self, rule: RoutingRule) -> None:
        self.store.put_route(RouteRecord(rule.topic_filter, rule.stream, 0))

    def route_removed(self, topic_filter: str) -> None:
        self.store.delete_route(topic_filter)


class Persistence:
    """Periodic saving of cursors, and what the broker keeps across restarts in the metadata
    store: retained messages, internal state and durable subscriptions. It is the broker's
    keeper (`core.store_ports.StateKeeper`) from its construction on; it saves what it is told
    once what was saved before is restored (retained messages after `restore_retained`, durable
    subscriptions after `restore_subscriptions`), so that restoring writes nothing back.

    The broker is built with the same cursor sink (`Broker(cursor_sink=ports)`) whose queued
    cursors `flush` writes."""

    def __init__(
        self, broker: Broker, store: MetadataStore, ports: MetadataPorts | None = None,
        owner_factories: Mapping[str, Callable[[Mapping[str, object]], object]] | None = None,
        *, remote_needs: Callable[[], Mapping[tuple[str, int], int]] | None = None,
    ) -> None:
        self.broker = broker
        self.store = store
        # How a saved subscription's owner comes back, by the "protocol" its options name.
        self.owner_factories = owner_factories if owner_factories is not None else {}
        # Where durable subscriptions queue their cursors (written in batches by `flush`).
        self.sink = ports if ports is not None else MetadataPorts(store)
        # What the broker tells this keeper is saved from the end of each restore on.
        self._keeping_retained = False
        self._keeping_subscriptions = False
        broker.keeper.install(self)
        self._task: asyncio.Task[None] | None = None
        self._last_activity: tuple[int, int, int, int] | None = None
        self._released = False
        self._saved: dict[str, tuple[str, tuple[str, ...], str]] = {}
        # The archiver, when one runs (`start`): the journal keeps what it has not archived yet.
        self.archiver: object | None = None
        # cursors kept elsewhere (a cluster's other nodes): per shard, the lowest offset they
        # still need, counted by retention as local cursors are
        self.remote_needs = remote_needs

    def restore_retained(self) -> int:
        count = 0
        for topic, data in self.store.list_retained():
            try:
                message = decode_to_message(data)
                if topic.startswith(INTERNAL_PREFIX):
                    self.broker.restore_internal(topic, message)
                    continue
                self.broker.retained.set(topic, message)
            except Exception as exc:
                set_aside(log, f"retained message of {topic!r}", data, exc)
                continue
            count += 1
        self.broker.restore_schemas()
        self._keeping_retained = True
        return count

    def retained_changed(self, topic: str, message: Message | None) -> None:
        if not self._keeping_retained or topic.startswith("$SYS/"):
            return
        try:
            if message is None:
                self.store.delete_retained(topic)
            else:
                self.store.put_retained(topic, encode_message(message))
        except Exception:
            log.exception("could not save the retained message of %r", topic)

    # ------------------------------------------------------------------ durable subscriptions
    def _owner_options(self, sub: DurableSubscription) -> dict[str, Any]:
        owner = sub.owner
        if owner is None:
            return {}
        saved_options = getattr(owner, "saved_options", None)
        if callable(saved_options):
            return dict(saved_options())
        return {"protocol": type(owner).__module__.split(".")[-2] if "." in type(owner).__module__ else ""}

    def save_subscriptions(self) -> None:
        """Save durable subscriptions other than MQTT sessions (those are saved with the
        session) whose definition changed."""
        for sub in list(self.broker.subscriptions.values()):
            if isinstance(sub, DurableSubscription):
                self._save_definition(sub)

    def durable_defined(self, sub: DurableSubscription) -> None:
        """Save a durable subscription and its cursors as soon as it is created or its
        filters change (a durable AMQP queue declared or bound, a gRPC durable subscription
        opened), before the client is told: a crash right after declare-ok and a confirmed
        publish must find the queue, positioned before that message, after the restart."""
        if (not self._keeping_subscriptions or sub.name.startswith("mqtt:")
                or getattr(sub.owner, "transient", False)):
            return
        self._save_definition(sub)
        # Cursors on every reliable shard from now on ("latest" is where it stands now), saved
        # with the definition: a message published after this answer is never skipped.
        sub.open_cursors()
        sub.save()
        self.sink.flush()

    def _signature(self, sub: DurableSubscription) -> tuple[str, tuple[str, ...], str]:
        """What a saved definition holds: a change of any part saves it again."""
        return (sub.type.value, tuple(sorted(sub.filters)),
                json.dumps(self._owner_options(sub), sort_keys=True, default=str))

    def _save_definition(self, sub: DurableSubscription) -> None:
        """Save `sub`'s definition if it changed since it was last saved."""
        if sub.name.startswith("mqtt:") or sub.name not in self.broker.subscriptions:
            return
        if getattr(sub.owner, "transient", False):  # a non-durable replay: never saved
            return
        signature = self._signature(sub)
        if self._saved.get(sub.name) == signature:
            return
        record = SubscriptionRecord(
            sub.name, sub.type.value, sorted(sub.filters), True, self._owner_options(sub), now_ms()
        )
        try:
            self.store.put_subscription(record)
            self._saved[sub.name] = signature
        except Exception:
            log.exception("could not save subscription %r", sub.name)

    def subscription_removed(self, sub: Subscription) -> None:
        if not self._keeping_subscriptions:
            return
        name = sub.name
        self._saved.pop(name, None)
        try:
            self.store.delete_subscription(name)
        except Exception:
            log.exception("could not delete subscription %r", name)

    def restore_subscriptions(self) -> int:
        """Bring back durable subscriptions (gRPC and others) with their cursors; their
        consumers attach when they reconnect. Nothing is saved or deleted meanwhile: a
        subscription that does not come back stays in the store as it was."""
        self._keeping_subscriptions = False
        count = 0
        for record in self.store.list_subscriptions():
            if record.name.startswith("mqtt:") or not record.durable:
                continue
            try:
                self._restore_subscription(record)
            except Exception as exc:
                set_aside(log, f"durable subscription {record.name!r}", record, exc)
                # not restored: gone from the broker (the stored record stays where it is)
                self.broker.remove_subscription(record.name)
                continue
            count += 1
        self._keeping_subscriptions = True
        return count

    def _restore_subscription(self, record: SubscriptionRecord) -> None:
        """One saved durable subscription back, with its cursors. A filter the topic layer
        refuses is set aside alone (the subscription, and the messages its cursors keep, come
        back without it); anything else wrong with the record sets it all aside."""
        kind = SubscriptionType(record.type)
        owner = None
        factory = self.owner_factories.get(str(record.options.get("protocol", "")))
        if factory is not None:
            owner = factory(record.options)
        sub = self.broker.durable_subscription(record.name, kind, owner=owner)
        for topic_filter in record.filters:
            try:
                self.broker.add_filter(sub, topic_filter)
            except CoreError as exc:
                set_aside(log, f"filter of durable subscription {record.name!r}", topic_filter, exc)
        for cursor in self.store.get_cursors(record.name):
            if cursor.acked:
                try:
                    sub.restore_cursor(cursor.stream, cursor.shard, cursor.acked)
                except Exception as exc:
                    set_aside(log, f"cursor of durable subscription {record.name!r}", cursor, exc)
        self._saved[record.name] = self._signature(sub)

    def start(self, archiver: object | None = None) -> None:
        """Save cursors and apply retention periodically from now on; `archiver`: the archiver
        that runs, if any (retention keeps what it has not archived, and what it writes counts
        as activity)."""
        self.archiver = archiver
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(CURSOR_SAVE_INTERVAL_S)
            self.flush(wait=False)
            ticks += 1
            if ticks % RETENTION_EVERY_TICKS == 0:
                self.apply_retention()
            if ticks % IDLE_CHECK_EVERY_TICKS == 0:
                self.check_idle()

    def check_idle(self) -> bool:
        """Release memory (once) when nothing came in or went out since the last check;
        returns whether it did. An archive file written since counts as activity: the tail of
        a load is archived up to a minute after it, after the release, and what that write
        left is handed back by the next one."""
        stats = self.broker.stats
        activity = (stats.messages_in, stats.messages_out, len(self.broker.subscriptions),
                    int(getattr(self.archiver, "files_written", 0)))
        idle = activity == self._last_activity
        self._last_activity = activity
        if not idle or self._released:
            self._released = self._released and idle
            return False
        release_idle_memory(self.broker)
        self._released = True
        return True

    def needed_offsets(self) -> dict[tuple[str, int], int]:
        """Per shard, the lowest offset a durable cursor or the archiver still needs."""
        needs: dict[tuple[str, int], int] = {}
        held = self.broker.held_offsets()
        for sub in list(self.broker.subscriptions.values()):
            if isinstance(sub, DurableSubscription):
                for key, cursor in sub.cursors.items():
                    floor = cursor.retention_floor(held.get(key))
                    if floor < needs.get(key, floor + 1):
                        needs[key] = floor
        if self.remote_needs is not None:
            for key, floor in self.remote_needs().items():
                if floor < needs.get(key, floor + 1):
                    needs[key] = floor
        archived = getattr(self.archiver, "archived_offset", None)
        if archived is not None:
            for stream in self.broker.streams.values():
                for shard in stream.shards:
                    if shard.log is not None:
                        key = (stream.name, shard.index)
                        done = archived(stream.name, shard.index)
                        needs[key] = min(needs.get(key, done), done)
        return needs

    def apply_retention(self) -> None:
        """Let the journal drop old segments, never below what is still needed."""
        needs = self.needed_offsets()
        for stream in self.broker.streams.values():
            for shard in stream.shards:
                shard_log = shard.log
                apply = getattr(shard_log, "apply_retention", None)
                if apply is None:
                    continue
                try:
                    apply(needs.get((stream.name, shard.index), shard_log.next_offset))  # type: ignore[union-attr]
                except Exception:
                    log.exception("retention failed on %s/%d", stream.name, shard.index)

    def flush(self, wait: bool = True) -> None:
        """Save changed definitions and the queued cursors; `wait` False: the cursors' fsync
        follows in the metadata store's sync thread instead of on the event loop (a periodic
        save acknowledges nothing)."""
        self.save_subscriptions()
        self.broker.save_cursors()
        self.sink.flush(wait)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.flush()
