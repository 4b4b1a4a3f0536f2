"""Durable subscriptions: per-shard cursors, acknowledgements, redelivery and dead letters.

A durable subscription does not copy messages for consumers that are away or busy: it keeps,
per shard, a cursor — the next offset to deliver (`position`) and the offsets delivered but not
yet acknowledged (`unacked`). While a cursor is *live* the subscription takes messages from the
live dispatch; when no consumer can take one, the cursor falls behind and the subscription
later replays the shard's log from `position`, filtering by its topic filters, until it has
caught up and is live again (through the journal's key index when it has one: only the records
of the topics the filters can match are read, `core/index_keys.py`). Replay and live dispatch meet by offset: a live message below
`position` was already replayed and is dropped, so there is no gap and no duplicate.

Unacknowledged messages are redelivered when a consumer gives them back (nack), when their ack
timeout passes, or when their consumer leaves; after `max_deliveries` they go to the dead-letter
topic `$dlq/<subscription>`. Progress (position and unacked offsets) is saved through a
`CursorSink` in batches; on restart the subscription resumes from what was saved, so a message
acknowledged before the crash may at worst be delivered again (at-least-once), never lost.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import operator
import struct
import sys
import time
import weakref
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeGuard

from ..storage.interfaces import (
    ArchiveSource,
    BlockReadable,
    KeyedReadable,
    KeyedSpans,
    RecordSpans,
    ShardLog,
    StorageError,
    StoredRecord,
)
from .filter_sets import FilterSet
from .index_keys import any_may_match
from .message import Message, now_ms
from .outbox import SLOW_SUBSCRIBER
from .records import READABLE_VERSIONS, RecordFormatError, decode_to_message, record_topic
from .subscriptions import Consumer, Subscription, SubscriptionType

if TYPE_CHECKING:
    from .broker import Broker


class PumpQueue:
    """The durable subscriptions of one event loop with replay work to do, served in turn
    (round robin) by one callback per loop turn within `TURN_PUMP_S`; a subscription whose
    pump leaves work over asks again and goes to the back."""

    __slots__ = ("_loop", "_waiting", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: deque[DurableSubscription] = deque()
        self._scheduled = False

    def add(self, subscription: DurableSubscription) -> None:
        self._waiting.append(subscription)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        waiting = self._waiting
        clock = time.perf_counter
        deadline = clock() + TURN_PUMP_S
        # Those that ask again while this runs wait for the next turn.
        for _ in range(len(waiting)):
            subscription = waiting.popleft()
            try:
                subscription._pump(deadline)
            except Exception:
                log.exception("replay of subscription %s failed", subscription.name)
            if clock() >= deadline:
                break
        if waiting and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run)


_pump_queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PumpQueue] = weakref.WeakKeyDictionary()


def pump_queue(loop: asyncio.AbstractEventLoop) -> PumpQueue:
    queue = _pump_queues.get(loop)
    if queue is None:
        queue = _pump_queues[loop] = PumpQueue(loop)
    return queue

log = logging.getLogger(__name__)

REPLAY_BATCH = 256
PUMP_BUDGET = 512
# Seconds between checks of the acknowledgement deadlines (a nack's delay has its own timer).
TIMER_S = 0.5
SCAN_BUDGET = 1024
"""Records a replaying cursor examines per event-loop turn, delivered or not: a session that
resumes far behind a busy shard whose records it mostly does not want yields to other work
(new connections, acknowledgements) between batches instead of scanning to the end at once.
The empty records of offsets a crash skipped (up to a reservation's worth after each crash) are
not counted: they cost nothing to pass, and a message confirmed behind them must reach its
queue at once."""
DEADLINE_EVERY = 16
"""Deliveries between two looks at the clock during a replay (see `DurableSubscription._pump`)."""
TURN_PUMP_S = 0.002
"""Replay of every durable subscription together takes at most about this long per event-loop
turn (then the rest waits for the next turn, after the turn's I/O): with many sessions
resuming at once, a CONNECT or an acknowledgement never waits behind all of their replays.
Under the soak the replay is a third of the loop's time, and a new connection waits through
one or two replay slices (the turn running as it connects, and the slice queued before its
`connection_made`): 2 ms rather than 4 took the soak's CONNECT -> CONNACK from p50 12-14 /
p99 24-34 ms to 9 / 20-24 on a loaded machine, with as many waves completed
(bench/RESULTS.md, 2026-11-24 16:00)."""
AHEAD_BYTES = 256 * 1024
"""At most this many record bytes are kept per cursor between turns (else read again)."""

_TOPIC_LENGTH = struct.Struct("<I")
# Whether a class conforms to a runtime-checkable protocol, found once per class: the replay
# asks it of every shard log and block it reads, and `isinstance` against such a protocol
# looks up each of its members every time (several microseconds on CPython 3.11).
_CONFORMS: dict[tuple[type, type], bool] = {}


def _conforms(value: object, protocol: type) -> bool:
    """`isinstance(value, protocol)` for a runtime-checkable protocol whose members are
    methods or properties of the class (so every instance of a class answers alike)."""
    known = _CONFORMS.get((type(value), protocol))
    if known is None:
        known = _CONFORMS[(type(value), protocol)] = isinstance(value, protocol)
    return known


def _is_keyed(block: object) -> TypeGuard[KeyedSpans]:
    return _conforms(block, KeyedSpans)


def _reads_keyed(shard_log: object) -> TypeGuard[KeyedReadable]:
    return _conforms(shard_log, KeyedReadable)


def _reads_blocks(shard_log: object) -> TypeGuard[BlockReadable]:
    return _conforms(shard_log, BlockReadable)
_TOPIC_LENGTH_AT = 12
"""A message record's topic length (u32) sits after its fixed head (version, flags, qos,
retain, i64 time: see `core/records.py`), the topic's UTF-8 bytes right after it."""


@dataclass(slots=True)
class DurableOptions:
    # Seconds before an unacknowledged message is redelivered; None: only on nack/leave.
    ack_timeout_s: float | None = 30.0
    # Deliveries before a message goes to the dead-letter topic; 0: never dead-letter.
    max_deliveries: int = 0
    # Redeliver a leaving consumer's unacknowledged messages to the others. MQTT sessions
    # resend their own in-flight messages instead.
    redeliver_on_leave: bool = True
    # Messages of non-reliable shards held while no consumer can take one (no credit, a full
    # window, nobody attached); beyond it the oldest is dropped and counted.
    max_held: int = 10_000
    # The consumers keep their own bounded queue with its own policy (MQTT sessions:
    # `max_queued_messages`, QoS 0 not queued offline; bridges: `max_queued`): messages of
    # non-reliable shards are handed to them as they come instead of being held here.
    consumers_queue: bool = False


class CursorSink(Protocol):
    """Where durable progress is saved (the metadata store, through the composition root)."""

    def save_cursor(self, subscription: str, stream: str, shard: int, floor: int, state: bytes) -> None: ...

    def flush(self) -> None:
        """Write what was saved so far, now."""


_CURSOR_HEAD = struct.Struct("<qI")


def encode_cursor_state(position: int, unacked: Sequence[int]) -> bytes:
    """Position, then the count and the offsets of the unacknowledged messages (little-endian
    int64s). An AMQP queue holds its whole backlog unacknowledged, so this is often tens of
    thousands of offsets: packed as one array, not as one argument each."""
    offsets = array("q", unacked)
    if sys.byteorder == "big":
        offsets.byteswap()
    return _CURSOR_HEAD.pack(position, len(offsets)) + offsets.tobytes()


def decode_cursor_state(data: bytes) -> tuple[int, list[int]]:
    position, count = struct.unpack_from("<qI", data, 0)
    return position, list(struct.unpack_from(f"<{count}q", data, 12))


class Delivery:
    __slots__ = ("message", "consumer", "count", "deadline")

    def __init__(self, message: Message, consumer: Consumer | None, count: int, deadline: float | None) -> None:
        self.message = message
        self.consumer = consumer
        self.count = count
        self.deadline = deadline


class ShardCursor:
    __slots__ = (
        "stream", "shard", "log", "position", "unacked", "live", "pending_redelivery", "skip",
        "archived", "fetching", "restored", "ahead", "resent_below", "placed",
    )

    def __init__(self, stream: str, shard: int, shard_log: ShardLog | None, position: int) -> None:
        self.stream = stream
        self.shard = shard
        self.log = shard_log
        self.position = position
        # Offset -> Delivery for messages handed out and not yet acknowledged.
        self.unacked: dict[int, Delivery] = {}
        self.live = shard_log is None
        # Offsets saved as unacknowledged before a restart, to read back and redeliver.
        self.pending_redelivery: list[int] = []
        # Offsets at or above `position` already handed out (restored in-flight state of a
        # consumer that resends them itself): replay passes over them.
        self.skip: set[int] = set()
        # Records fetched from the archive for a cursor below the journal's low watermark.
        self.archived: list[StoredRecord] = []
        self.fetching = False
        # Pending redeliveries below the journal's low watermark, read from the archive.
        self.restored: dict[int, Message] = {}
        # Journal records read but not yet gone through (the consumer's window filled): the
        # next turn resumes there instead of reading the same batch again.
        self.ahead: list[StoredRecord] | RecordSpans = []
        # Offsets below this were handed out before a restart (a cursor resumed from an older
        # floor): handing them out again is a redelivery.
        self.resent_below = 0
        # False for a cursor restored in a cluster before the shard map was known: it neither
        # replays nor takes live messages (its log is not known yet) until it is placed.
        self.placed = True

    def repoint(self, shard_log: ShardLog, *, replay: bool = False) -> None:
        """Read the shard from `shard_log` from now on (in a cluster, where the shard's
        records are found moved: its owner's journal, what was pushed here, this node's own
        journal). With `replay`, the cursor reads it again from its position (it stops taking
        live messages and forgets what it had read ahead), its subscription's pump brings it
        back to live."""
        self.log = shard_log
        if replay:
            self.live = False
            self.ahead = []

    @property
    def floor(self) -> int:
        """The lowest offset this cursor still needs."""
        lowest = self.position
        if self.unacked:
            lowest = min(lowest, min(self.unacked))
        if self.pending_redelivery:
            lowest = min(lowest, self.pending_redelivery[0])
        return lowest


class DurableSubscription(Subscription):
    __slots__ = (
        "broker", "options", "cursors", "_redeliver", "_delayed", "_pump_scheduled", "_dirty",
        "sink", "initial_position", "_filter_set", "_timer", "_timer_at", "_held", "_held_returned",
        "_key_cache",
    )

    def __init__(
        self,
        broker: Broker,
        name: str,
        type: SubscriptionType = SubscriptionType.EXCLUSIVE,
        options: DurableOptions | None = None,
        owner: object = None,
        initial_position: str | int = "latest",
        sink: CursorSink | None = None,
    ) -> None:
        super().__init__(name, type, durable=True, owner=owner)
        self.broker = broker
        self.options = options or DurableOptions()
        self.cursors: dict[tuple[str, int], ShardCursor] = {}
        self._redeliver: deque[tuple[ShardCursor, int]] = deque()
        self._delayed: list[tuple[float, int, str, int]] = []
        self._pump_scheduled = False
        self._dirty: set[tuple[str, int]] = set()
        self.sink = sink
        self.initial_position = initial_position
        # The filters compiled for matching topics (`core/filter_sets.py`), made when first
        # needed after a change of the filters.
        self._filter_set: FilterSet | None = None
        # Whether the filters can match a record of an index key (`core/index_keys.py`), for
        # replay reading through the journal's key index (keys are topic prefixes: few).
        self._key_cache: dict[bytes, bool] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # when `_timer` fires (monotonic)
        # Messages of non-reliable shards (no log to replay them from) waiting for a consumer
        # with room, oldest first: see `_hold`.
        self._held: deque[tuple[Message, tuple[str, ...]]] = deque()
        # How many of the first held were given back by a consumer (they go before the rest).
        self._held_returned = 0

    # ------------------------------------------------------------------ cursors
    def open_cursors(self, positions: str | int | None = None) -> None:
        """Create cursors on every shard of every reliable stream (for `earliest`, an offset
        or a timestamp start). Cursors of shards first seen live start at that message."""
        position = self.initial_position if positions is None else positions
        for stream in self.broker.streams.values():
            for shard in stream.shards:
                key = (stream.name, shard.index)
                if key in self.cursors:
                    continue
                shard_log = self._replay_log(stream.name, shard.index, shard.log, position)
                self.cursors[key] = self._new_cursor(stream.name, shard.index, shard_log, position)
        self.schedule_pump()

    def _replay_log(self, stream: str, shard: int, local: ShardLog | None,
                    position: str | int = "latest") -> ShardLog | None:
        """The log to replay `stream`/`shard` from: its own, or in a cluster, for a reliable
        shard another node owns, what this node received of it, or the owner's log itself for
        a cursor that starts before now (`earliest`, an offset or a -timestamp)."""
        placement = self.broker.placement
        if local is None or placement is None or placement.serves(stream, shard):
            return local
        if position != "latest":
            if position == "earliest":
                start, since_ms = 0, None
            elif isinstance(position, int) and position < 0:
                start, since_ms = 0, -position
            else:
                start, since_ms = int(position), None
            owner_log = placement.owner_log(stream, shard, start, lambda: list(self.filters), since_ms)
            if owner_log is not None:
                return owner_log
        return placement.received_log(stream, shard)

    def _new_cursor(self, stream: str, shard: int, shard_log: ShardLog | None, position: str | int) -> ShardCursor:
        if shard_log is None:
            start = 0
        elif position == "earliest":
            start = shard_log.low_watermark
        elif position == "latest":
            start = shard_log.next_offset
        elif isinstance(position, int) and position < 0:
            start = shard_log.offset_for_timestamp(-position)  # negative: a timestamp in ms
        else:
            start = int(position)
        cursor = ShardCursor(stream, shard, shard_log, start)
        self._dirty.add((stream, shard))
        return cursor

    def restore_cursor(self, stream: str, shard: int, state: bytes) -> None:
        broker_stream = self.broker.streams.get(stream)
        if broker_stream is None or shard >= len(broker_stream.shards):
            return
        shard_log = self._replay_log(stream, shard, broker_stream.shards[shard].log)
        position, unacked = decode_cursor_state(state)
        unplaced = shard_log is not None and self.broker.restored_cursors_wait
        if shard_log is not None and not unplaced:
            # Saved progress may run ahead of a log that lost its unsynced tail in a crash.
            position = min(position, shard_log.next_offset)
            unacked = [o for o in unacked if o < position]
        cursor = ShardCursor(stream, shard, shard_log, position)
        cursor.pending_redelivery = sorted(unacked)
        # In a cluster, whose journal holds this shard is known once the node has joined:
        # until then the cursor keeps its saved state as it is and waits (`place_restored`).
        cursor.placed = not unplaced
        self.cursors[(stream, shard)] = cursor

    def unplaced_cursors(self) -> list[ShardCursor]:
        return [cursor for cursor in self.cursors.values() if not cursor.placed]

    def place_restored(self, cursor: ShardCursor, owner_log: Callable[[int], ShardLog] | None) -> None:
        """Place a cursor restored before the shard map was known. `owner_log` None: this node
        owns the shard, and the cursor continues over its own journal as on a single node.
        Otherwise the shard's log is on another node: `owner_log(start)` reads it from there,
        and the cursor resumes at its saved floor (what was pushed here before the restart went
        with the process), so what was handed out and not acknowledged comes again, marked as
        handed out before, with what was acknowledged after the first of it (at least once)."""
        if cursor.placed or self.cursors.get((cursor.stream, cursor.shard)) is not cursor:
            return
        # Handed out before the restart and resent by their consumer itself (`adopt`): the
        # replay passes over them.
        held = cursor.unacked
        if owner_log is None:
            stream = self.broker.streams.get(cursor.stream)
            local = stream.shards[cursor.shard].log if stream is not None and cursor.shard < len(stream.shards) else None
            cursor.log = local
            if local is not None:
                cursor.position = min(cursor.position, local.next_offset)
                cursor.pending_redelivery = [o for o in cursor.pending_redelivery if o < cursor.position]
        else:
            start = cursor.floor
            cursor.resent_below = cursor.position
            cursor.pending_redelivery = []
            cursor.position = start
            cursor.log = owner_log(start)
        cursor.skip.update(offset for offset in held if offset >= cursor.position)
        cursor.live = cursor.log is None
        cursor.ahead = []
        cursor.placed = True
        self._dirty.add((cursor.stream, cursor.shard))
        self.schedule_pump()

    def place_cursor(self, stream: str, shard: int, shard_log: ShardLog | None, position: int,
                     unacked: Sequence[int] = (), messages: Sequence[Message] = ()) -> ShardCursor:
        """Put a cursor handed over from elsewhere (a cluster node that held this subscription):
        it resumes at `position` over `shard_log`, redelivering `unacked` (whose `messages`,
        when given, are redelivered as they are instead of being read back). Saved soon."""
        cursor = ShardCursor(stream, shard, shard_log, position)
        cursor.pending_redelivery = sorted(unacked)
        cursor.restored.update((message.offset, message) for message in messages)
        self.cursors[(stream, shard)] = cursor
        self._dirty.add((stream, shard))
        return cursor

    def adopt(self, message: Message, consumer: Consumer) -> None:
        """Register a message restored as in flight to `consumer` (which resends it itself):
        it stays unacknowledged here and is not replayed again."""
        key = (message.stream, message.shard)
        cursor = self.cursors.get(key)
        if cursor is None:
            stream = self.broker.streams.get(message.stream)
            shard_log = stream.shards[message.shard].log if stream is not None else None
            shard_log = self._replay_log(message.stream, message.shard, shard_log)
            cursor = self.cursors[key] = ShardCursor(message.stream, message.shard, shard_log, message.offset)
        if message.offset in cursor.pending_redelivery:
            cursor.pending_redelivery.remove(message.offset)
        cursor.unacked[message.offset] = Delivery(message, consumer, 1, None)
        if message.offset >= cursor.position:
            cursor.skip.add(message.offset)

    def read_message(self, stream: str, shard: int, offset: int) -> Message | None:
        cursor = self.cursors.get((stream, shard))
        if cursor is None:
            broker_stream = self.broker.streams.get(stream)
            if broker_stream is None or shard >= len(broker_stream.shards):
                return None
            cursor = ShardCursor(stream, shard, broker_stream.shards[shard].log, offset)
        return self._read_one(cursor, offset)

    def seek(self, kind: str | None, value: int | str | None = None) -> None:
        """Move the cursors: kind "earliest", "latest", "offset" (value: the offset on every
        shard) or "timestamp" (value: epoch milliseconds)."""
        if kind in ("offset", "timestamp", "timestamp_ms", "time") and value is None:
            raise TypeError(f"seek to {kind!r} needs a value")
        # What a consumer took and has not handed to a client yet (an AMQP queue's ready
        # messages) goes too: the new position alone decides what comes next.
        for consumer in list(self.consumers):
            forget_ready = getattr(consumer, "forget_ready", None)
            if forget_ready is not None:
                forget_ready()
        if kind in (None, "", "latest"):
            self.reset("latest")
        elif kind == "earliest":
            self.reset("earliest")
        elif kind == "offset":
            self.reset(int(value or 0))
        elif kind in ("timestamp", "timestamp_ms", "time"):
            self.reset(-int(value or 0))
        else:
            raise ValueError(f"unknown position {kind!r}")

    def reset(self, position: str | int) -> None:
        """Move every cursor (offset, `earliest`, `latest`, or -timestamp_ms)."""
        self.cursors.clear()
        self._redeliver.clear()
        self.open_cursors(position)

    def lag(self) -> int:
        total = 0
        for cursor in self.cursors.values():
            if cursor.log is not None:
                total += max(0, cursor.log.next_offset - cursor.floor)
        return total

    def inflight_count(self) -> int:
        return sum(len(c.unacked) for c in self.cursors.values())

    # ------------------------------------------------------------------ live path
    def offer(self, message: Message, filters: Sequence[str]) -> None:
        """A message dispatched live (after it was stored)."""
        key = (message.stream, message.shard)
        cursor = self.cursors.get(key)
        if cursor is None:
            stream = self.broker.streams.get(message.stream)
            shard_log = stream.shards[message.shard].log if stream is not None else None
            shard_log = self._replay_log(message.stream, message.shard, shard_log)
            cursor = ShardCursor(message.stream, message.shard, shard_log, message.offset)
            cursor.live = True
            self.cursors[key] = cursor
            # Saved at once: if this message is not delivered before a restart, the restored
            # subscription must still start here, not at the end of the shard.
            self._dirty.add(key)
        if cursor.log is None:
            # Non-reliable shard: nothing to replay from. A consumer with room takes it now;
            # otherwise it is held here (in order, bounded) until one has room: a consumer
            # without credit is never handed more than it asked for.
            if self.options.consumers_queue:
                consumer = self.pick(message.shard)
                if consumer is not None:
                    consumer.deliver(message, self, filters)
                return
            if not self._held:
                consumer = self.pick_available(message.shard)
                if consumer is not None:
                    consumer.deliver(message, self, filters)
                    return
            self._hold(message, tuple(filters))
            return
        if message.offset < cursor.position:
            return  # already delivered by replay
        if not cursor.live:
            self.schedule_pump()
            return
        consumer = self.pick_available(message.shard)
        if consumer is None:
            cursor.live = False
            return
        self._send(cursor, message, filters, consumer, 1)

    def _send(self, cursor: ShardCursor, message: Message, filters: Sequence[str],
              consumer: Consumer, count: int) -> None:
        if message.offset >= cursor.position:
            cursor.position = message.offset + 1
        if message.offset < cursor.resent_below and count == 1:
            count = 2
        timeout = self.options.ack_timeout_s
        deadline = time.monotonic() + timeout if timeout else None
        cursor.unacked[message.offset] = Delivery(message, consumer, count, deadline)
        self._dirty.add((cursor.stream, cursor.shard))
        if timeout and self._timer is None:
            self._arm_timer()
        consumer.deliver(message, self, filters)

    def forget_cached_matches(self) -> None:
        """Drop what was compiled or cached from the filters (made again on demand): memory
        back when idle."""
        self._filter_set = None
        self._key_cache = {}

    def filters_changed(self) -> None:
        self.forget_cached_matches()

    def _compiled_filters(self) -> FilterSet:
        filter_set = self._filter_set
        if filter_set is None:
            filter_set = self._filter_set = FilterSet(self.filters)
        return filter_set

    def _wants_key(self, key: bytes) -> bool:
        """Whether a record of index key `key` may match the filters (the journal's key index
        asks this of each key of a segment)."""
        wanted = self._key_cache.get(key)
        if wanted is None:
            wanted = any_may_match(self._compiled_filters().filters, key)
            if len(self._key_cache) > 10_000:
                self._key_cache.clear()
            self._key_cache[key] = wanted
        return wanted

    def _filters_for(self, topic: str) -> tuple[str, ...]:
        return self._compiled_filters().matching_name(topic)

    # ------------------------------------------------------------------ acknowledgements
    def handed_out_before(self, message: Message) -> bool:
        """Whether `message` is being handed out again (unacknowledged before a restart, nacked,
        or timed out): protocols mark such a delivery (MQTT DUP, AMQP redelivered)."""
        cursor = self.cursors.get((message.stream, message.shard))
        delivery = cursor.unacked.get(message.offset) if cursor is not None else None
        return delivery is not None and delivery.count > 1

    def redeliveries(self, message: Message) -> int:
        """How many times `message` was handed out before this delivery (0 the first time)."""
        cursor = self.cursors.get((message.stream, message.shard))
        delivery = cursor.unacked.get(message.offset) if cursor is not None else None
        return max(0, delivery.count - 1) if delivery is not None else 0

    def ack(self, message: Message) -> None:
        cursor = self.cursors.get((message.stream, message.shard))
        if cursor is None:
            return
        if cursor.unacked.pop(message.offset, None) is not None:
            self._dirty.add((cursor.stream, cursor.shard))
            if not cursor.live or self._redeliver:
                self.schedule_pump()

    def nack(self, message: Message, delay_s: float = 0.0) -> None:
        cursor = self.cursors.get((message.stream, message.shard))
        if cursor is not None and cursor.log is None and not self.options.consumers_queue:
            # A message of a non-reliable shard given back (nacked, or its consumer left with
            # it unacknowledged or still queued): held for the next consumer with room.
            self._hold(message, self._filters_for(message.topic) or tuple(self.filters),
                       returned=True)
            self.schedule_pump()
            return
        if cursor is None or message.offset not in cursor.unacked:
            return
        delivery = cursor.unacked[message.offset]
        delivery.consumer = None
        delivery.deadline = None
        if delay_s > 0:
            due = time.monotonic() + delay_s
            heapq.heappush(self._delayed, (due, message.offset, cursor.stream, cursor.shard))
            self._arm_timer(due)
        else:
            self._redeliver.append((cursor, message.offset))
            self.schedule_pump()

    def detach(self, consumer: Consumer) -> bool:
        removed = super().detach(consumer)
        if removed and self._held:
            self.schedule_pump()  # the consumer that now takes over may have room
        if removed and self.options.redeliver_on_leave:
            for cursor in self.cursors.values():
                for offset, delivery in cursor.unacked.items():
                    if delivery.consumer is consumer:
                        delivery.consumer = None
                        self._redeliver.append((cursor, offset))
            if self._redeliver:
                self.schedule_pump()
        return removed

    def wake(self) -> None:
        self.schedule_pump()

    # ------------------------------------------------------------------ replay
    def schedule_pump(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            try:
                pump_queue(asyncio.get_running_loop()).add(self)
            except RuntimeError:
                self._pump_scheduled = False

    def _pump(self, deadline: float = math.inf) -> None:
        """Replay within `PUMP_BUDGET` messages, and until `perf_counter()` passes `deadline`
        (the turn's replay time: one subscription replaying large messages must not hold the
        loop for tens of milliseconds); what is left waits for a later turn."""
        self._pump_scheduled = False
        budget = PUMP_BUDGET
        if self._held:
            budget = self._pump_held(budget)
        budget = self._pump_redeliveries(budget)
        if budget <= 0:
            self.schedule_pump()
            return
        for cursor in list(self.cursors.values()):
            if not cursor.placed:
                continue  # restored in a cluster, waiting for the shard map (`place_restored`)
            if cursor.pending_redelivery:
                budget = self._pump_restored(cursor, budget)
            if not cursor.live and budget > 0:
                budget = self._pump_cursor(cursor, budget, deadline)
            if budget <= 0:
                self.schedule_pump()
                return

    def _hold(self, message: Message, filters: tuple[str, ...], returned: bool = False) -> None:
        """Keep a message of a non-reliable shard until a consumer has room; past
        `options.max_held` the oldest held is dropped and counted (as a slow subscriber's
        QoS 0 overflow is)."""
        held = self._held
        if returned:
            # Given back (in the order the consumer had them): before anything newer.
            held.insert(self._held_returned, (message, filters))
            self._held_returned += 1
        else:
            held.append((message, filters))
        if len(held) > self.options.max_held:
            self._take_held()
            self.broker.stats.drop(SLOW_SUBSCRIBER)

    def _take_held(self) -> tuple[Message, tuple[str, ...]]:
        if self._held_returned:
            self._held_returned -= 1
        return self._held.popleft()

    @property
    def held(self) -> int:
        """Messages of non-reliable shards waiting for a consumer with room."""
        return len(self._held)

    def _pump_held(self, budget: int) -> int:
        held = self._held
        now = now_ms()
        while held and budget > 0:
            message, filters = held[0]
            if message.expires_at_ms is not None and message.expires_at_ms <= now:
                self._take_held()
                continue
            consumer = self.pick_available(message.shard)
            if consumer is None:
                return budget
            self._take_held()
            consumer.deliver(message, self, filters)
            budget -= 1
        if held:
            self.schedule_pump()
        return budget

    def _pump_redeliveries(self, budget: int) -> int:
        max_deliveries = self.options.max_deliveries
        while self._redeliver and budget > 0:
            cursor, offset = self._redeliver[0]
            delivery = cursor.unacked.get(offset)
            if delivery is None or delivery.consumer is not None:
                self._redeliver.popleft()
                continue
            if max_deliveries and delivery.count >= max_deliveries:
                self._redeliver.popleft()
                self._dead_letter(cursor, delivery)
                continue
            consumer = self.pick_available(cursor.shard)
            if consumer is None:
                return budget
            self._redeliver.popleft()
            filters = self._filters_for(delivery.message.topic) or tuple(self.filters)
            self._send(cursor, delivery.message, filters, consumer, delivery.count + 1)
            budget -= 1
        return budget

    def _pump_restored(self, cursor: ShardCursor, budget: int) -> int:
        while cursor.pending_redelivery and budget > 0:
            consumer = self.pick_available(cursor.shard)
            if consumer is None:
                return budget
            offset = cursor.pending_redelivery[0]
            message = cursor.restored.pop(offset, None)
            if message is None and cursor.log is not None and offset < cursor.log.low_watermark:
                archive = self.broker.archive
                if archive is not None:
                    # Tiered replay of a restored unacknowledged message: from the archive.
                    if not cursor.fetching:
                        cursor.fetching = True
                        asyncio.get_running_loop().create_task(
                            self._fetch_restored(cursor, archive))
                    return budget
            cursor.pending_redelivery.pop(0)
            if message is None:
                message = self._read_one(cursor, offset)
            if message is None:
                continue
            filters = self._filters_for(message.topic)
            if filters:
                self._send(cursor, message, filters, consumer, 2)
                budget -= 1
        return budget

    def _read_one(self, cursor: ShardCursor, offset: int) -> Message | None:
        if cursor.log is None:
            return None
        try:
            records = cursor.log.read(offset, 1)
        except StorageError as exc:
            log.error("subscription %s: cannot read %s/%d@%d: %s", self.name, cursor.stream, cursor.shard, offset, exc)
            return None
        if not records or records[0].offset != offset or not records[0].data:
            return None  # gone, or an offset the journal skipped (an empty record)
        try:
            return decode_to_message(records[0].data, cursor.stream, cursor.shard, offset)
        except RecordFormatError as exc:
            log.error("subscription %s: bad record %s/%d@%d: %s", self.name, cursor.stream, cursor.shard, offset, exc)
            return None

    def has_available(self) -> bool:
        return any(consumer.available for consumer in self.consumers)

    def _pump_cursor(self, cursor: ShardCursor, budget: int, deadline: float = math.inf) -> int:
        shard_log = cursor.log
        assert shard_log is not None
        if not self.has_available():
            return budget
        if cursor.position < shard_log.low_watermark and not cursor.archived:
            shard_log = self._read_from_owner(cursor) or shard_log
        # The journal reads the records of the topics wanted through its key index, or else in
        # blocks (one buffer, no object per record); other logs per record.
        read_keyed = shard_log.read_keyed if _reads_keyed(shard_log) else None
        read_block = shard_log.read_block if _reads_blocks(shard_log) else None
        now = now_ms()
        scanned = 0
        records: list[StoredRecord] | RecordSpans | KeyedSpans | None
        while budget > 0:
            if scanned >= SCAN_BUDGET or (scanned and time.perf_counter() >= deadline):
                self._dirty.add((cursor.stream, cursor.shard))
                return 0  # the rest on a later turn
            if cursor.archived:
                records, cursor.archived = cursor.archived, []
            elif cursor.ahead:
                records, cursor.ahead = cursor.ahead, []
            elif cursor.position < shard_log.low_watermark:
                # Tiered replay: what the journal no longer holds comes from the archive.
                archive = self.broker.archive
                if archive is None:
                    log.warning("subscription %s: %s/%d@%d is gone from the journal; resuming at %d",
                                self.name, cursor.stream, cursor.shard, cursor.position,
                                shard_log.low_watermark)
                    cursor.position = shard_log.low_watermark
                    continue
                if not cursor.fetching:
                    cursor.fetching = True
                    asyncio.get_running_loop().create_task(self._fetch_archived(cursor, archive))
                return budget
            else:
                records = None
            try:
                if records is None and read_keyed is not None:
                    records = read_keyed(cursor.position, REPLAY_BATCH, self._wants_key)
                    if records is not None and not len(records):
                        scanned += 1
                        if records.end_offset > cursor.position:
                            self._pass_to(cursor, records.end_offset)  # nothing wanted there
                            continue
                if records is None:
                    if read_block is not None:
                        records = read_block(cursor.position, REPLAY_BATCH)
                    else:
                        records = shard_log.read(cursor.position, REPLAY_BATCH)
            except StorageError as exc:
                log.error("subscription %s: replay of %s/%d stopped at %d: %s",
                          self.name, cursor.stream, cursor.shard, cursor.position, exc)
                return budget
            if not len(records):
                if cursor.position >= shard_log.next_offset:
                    cursor.live = True
                else:
                    # Appended but not yet committed: read it once the commit is done.
                    waiter = shard_log.commit_waiter()
                    if waiter is not None:
                        waiter.add_done_callback(lambda _: self.schedule_pump())
                return budget
            if isinstance(records, list):
                scanned += sum(1 for record in records if record.data)
                budget = self._replay_records(cursor, records, budget, now, deadline)
            else:
                scanned += sum(map(operator.ne, records.starts, records.ends))  # not empty
                budget = self._replay_block(cursor, records, budget, now, deadline)
            if budget <= 0:
                return 0
            self._dirty.add((cursor.stream, cursor.shard))
        return budget

    def _read_from_owner(self, cursor: ShardCursor) -> ShardLog | None:
        """In a cluster, a cursor over what this node received of a shard another node owns
        that fell behind the received window (its consumers out of credit while the owner
        pushed more than the window holds) reads the owner's journal from its position instead,
        and the pushes again once caught up: nothing is skipped. None when it cannot."""
        placement = self.broker.placement
        if placement is None or placement.serves(cursor.stream, cursor.shard):
            return None
        if cursor.log is not placement.received_log(cursor.stream, cursor.shard):
            return None
        owner_log = placement.owner_log(cursor.stream, cursor.shard, cursor.position,
                                        lambda: list(self.filters))
        if owner_log is None:
            return None
        log.info("subscription %s: %s/%d@%d slid out of the received window; reading the owner",
                 self.name, cursor.stream, cursor.shard, cursor.position)
        cursor.log = owner_log
        cursor.ahead = []
        return owner_log

    def _replay_records(self, cursor: ShardCursor, records: list[StoredRecord], budget: int,
                        now: int, deadline: float = math.inf) -> int:
        """Deliver what `cursor` wants of `records` (read per record: from the archive, or a
        log without blocks) while consumers take it; returns the budget left, 0 when a
        consumer was missing or the budget ran out (the rest kept in `cursor.ahead`)."""
        for index, record in enumerate(records):
            if record.offset < cursor.position:
                continue
            if not record.data:  # an offset the journal skipped
                cursor.position = record.offset + 1
                continue
            try:
                # Only records this subscription wants are decoded whole.
                filters = self._filters_for(record_topic(record.data))
                message = decode_to_message(
                    record.data, cursor.stream, cursor.shard, record.offset
                ) if filters else None
            except RecordFormatError as exc:
                log.error("subscription %s: skipping bad record %s/%d@%d: %s",
                          self.name, cursor.stream, cursor.shard, record.offset, exc)
                cursor.position = record.offset + 1
                continue
            if message is None or message.expired(now) or record.offset in cursor.skip:
                cursor.skip.discard(record.offset)
                cursor.position = record.offset + 1
                continue
            consumer = self.pick_available(cursor.shard)
            if consumer is None:
                self._keep_ahead(cursor, records, index)
                return 0
            self._send(cursor, message, filters, consumer, 1)
            budget -= 1
            if budget <= 0 or (not budget % DEADLINE_EVERY and time.perf_counter() >= deadline):
                self._keep_ahead(cursor, records, index + 1)
                return 0
        return budget

    def _replay_block(self, cursor: ShardCursor, block: RecordSpans, budget: int, now: int,
                      deadline: float = math.inf) -> int:
        """`_replay_records` over a block: each record's topic is looked at in the block's
        buffer and a message is made only for the records this subscription wants. A block
        read through the key index (`KeyedSpans`) holds only some offsets: once gone through,
        the cursor passes to its end."""
        buffer = block.buffer
        starts = block.starts
        ends = block.ends
        first = block.first_offset
        offsets = block.offsets if _is_keyed(block) else None
        unpack_length = _TOPIC_LENGTH.unpack_from
        matching = self._compiled_filters().matching
        skip = cursor.skip
        if offsets is None:
            begin = max(0, cursor.position - first)
        else:
            begin = bisect_left(offsets, cursor.position)
        for index in range(begin, len(starts)):
            offset = first + index if offsets is None else offsets[index]
            start = starts[index]
            end = ends[index]
            if start == end:  # an offset the journal skipped
                cursor.position = offset + 1
                continue
            try:
                if buffer[start] not in READABLE_VERSIONS or end - start < _TOPIC_LENGTH_AT + 4:
                    raise RecordFormatError("not a readable message record")
                topic_start = start + _TOPIC_LENGTH_AT + 4
                topic_end = topic_start + unpack_length(buffer, start + _TOPIC_LENGTH_AT)[0]
                if topic_end > end:
                    raise RecordFormatError("truncated message record")
                filters = matching(buffer, topic_start, topic_end)
                if not filters:
                    if skip:
                        skip.discard(offset)
                    cursor.position = offset + 1
                    continue
                # Only records this subscription wants are decoded whole.
                message = decode_to_message(buffer[start:end], cursor.stream, cursor.shard, offset)
            except (RecordFormatError, UnicodeDecodeError) as exc:
                log.error("subscription %s: skipping bad record %s/%d@%d: %s",
                          self.name, cursor.stream, cursor.shard, offset, exc)
                cursor.position = offset + 1
                continue
            if message.expired(now) or offset in skip:
                skip.discard(offset)
                cursor.position = offset + 1
                continue
            consumer = self.pick_available(cursor.shard)
            if consumer is None:
                self._keep_block_ahead(cursor, block, index)
                return 0
            self._send(cursor, message, filters, consumer, 1)
            budget -= 1
            if budget <= 0 or (not budget % DEADLINE_EVERY and time.perf_counter() >= deadline):
                self._keep_block_ahead(cursor, block, index + 1)
                return 0
        if _is_keyed(block):
            self._pass_to(cursor, block.end_offset)
        return budget

    @staticmethod
    def _pass_to(cursor: ShardCursor, offset: int) -> None:
        """Move `cursor` on to `offset` past records it does not want (read through the key
        index, so never gone through one by one)."""
        if offset > cursor.position:
            cursor.position = offset
            if cursor.skip:
                cursor.skip = {skipped for skipped in cursor.skip if skipped >= offset}

    @staticmethod
    def _keep_ahead(cursor: ShardCursor, records: list[StoredRecord], index: int) -> None:
        rest = records[index:]
        if rest and sum(len(record.data) for record in rest) <= AHEAD_BYTES:
            cursor.ahead = rest

    @staticmethod
    def _keep_block_ahead(cursor: ShardCursor, block: RecordSpans, index: int) -> None:
        """Keep the block's records from `index` for the next turn: the block itself when its
        whole buffer fits in AHEAD_BYTES, else those records' data alone if that does."""
        rest = block[index:]
        if not len(rest):
            return
        if len(block.buffer) <= AHEAD_BYTES:
            cursor.ahead = rest
        elif sum(rest.ends) - sum(rest.starts) <= AHEAD_BYTES:
            buffer = block.buffer
            offsets = rest.offsets if _is_keyed(rest) else range(
                rest.first_offset, rest.first_offset + len(rest))
            cursor.ahead = [
                StoredRecord(offset, stamp, buffer[start:end])
                for offset, start, end, stamp in zip(offsets, rest.starts, rest.ends, rest.timestamps, strict=True)
            ]

    async def _fetch_archived(self, cursor: ShardCursor, archive: ArchiveSource) -> None:
        try:
            records = await archive.read_async(cursor.stream, cursor.shard, cursor.position, REPLAY_BATCH)
        except Exception as exc:
            log.error("subscription %s: archive read of %s/%d@%d failed: %s",
                      self.name, cursor.stream, cursor.shard, cursor.position, exc)
            records = []
            await asyncio.sleep(1.0)
        finally:
            cursor.fetching = False
        records = [r for r in records if r.offset >= cursor.position]
        if records:
            cursor.archived = records
        elif cursor.log is not None and cursor.position < cursor.log.low_watermark:
            log.warning("subscription %s: %s/%d@%d is in neither the archive nor the journal; "
                        "resuming at %d", self.name, cursor.stream, cursor.shard, cursor.position,
                        cursor.log.low_watermark)
            cursor.position = cursor.log.low_watermark
        self.schedule_pump()

    async def _fetch_restored(self, cursor: ShardCursor, archive: ArchiveSource) -> None:
        """Read the pending redeliveries that only the archive still holds."""
        low = cursor.log.low_watermark if cursor.log is not None else 0
        wanted = [offset for offset in cursor.pending_redelivery if offset < low]
        found: dict[int, Message] = {}
        try:
            if wanted:
                first, last = wanted[0], wanted[-1]
                position = first
                while position <= last:
                    records = await archive.read_async(
                        cursor.stream, cursor.shard, position, min(REPLAY_BATCH, last - position + 1))
                    if not records:
                        break
                    for record in records:
                        if record.offset in wanted:
                            try:
                                found[record.offset] = decode_to_message(
                                    record.data, cursor.stream, cursor.shard, record.offset)
                            except RecordFormatError as exc:
                                log.error("subscription %s: bad archived record %s/%d@%d: %s",
                                          self.name, cursor.stream, cursor.shard, record.offset, exc)
                    position = records[-1].offset + 1
        except Exception as exc:
            log.error("subscription %s: archive read of %s/%d@%d failed: %s",
                      self.name, cursor.stream, cursor.shard, wanted[0], exc)
            await asyncio.sleep(1.0)
            cursor.fetching = False
            self.schedule_pump()
            return
        cursor.fetching = False
        missing = [offset for offset in wanted if offset not in found]
        if missing:
            log.warning("subscription %s: %d unacknowledged messages of %s/%d are in neither "
                        "the archive nor the journal", self.name, len(missing), cursor.stream,
                        cursor.shard)
            cursor.pending_redelivery = [o for o in cursor.pending_redelivery if o not in missing]
        cursor.restored.update(found)
        self.schedule_pump()

    def _dead_letter(self, cursor: ShardCursor, delivery: Delivery) -> None:
        cursor.unacked.pop(delivery.message.offset, None)
        self._dirty.add((cursor.stream, cursor.shard))
        original = delivery.message
        headers = list(original.headers or [])
        headers += [("x-dead-letter-subscription", self.name), ("x-original-topic", original.topic),
                    ("x-delivery-count", str(delivery.count))]
        letter = Message(
            f"$dlq/{self.name}", original.payload, original.qos, False, original.key, headers,
            original.content_type, original.correlation_data, original.reply_to, original.payload_format,
            None, producer_protocol="dlq", producer_id=self.name,
        )
        log.info("subscription %s: %s@%d dead-lettered after %d deliveries", self.name,
                 original.topic, original.offset, delivery.count)
        try:
            self.broker.publish(letter)
        except Exception:
            log.exception("subscription %s: dead letter could not be published", self.name)

    # ------------------------------------------------------------------ timers and saving
    def _arm_timer(self, due: float | None = None) -> None:
        """Check ack deadlines every `TIMER_S`, and wake at `due` (a nack's delay ends: it is
        redelivered then, not at the next tick)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        now = time.monotonic()
        when = now + TIMER_S
        if self._delayed:
            when = min(when, self._delayed[0][0])
        if due is not None:
            when = min(when, due)
        if self._timer is not None:
            if self._timer_at <= when:
                return
            self._timer.cancel()
        self._timer_at = when
        self._timer = loop.call_later(max(0.0, when - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        now = time.monotonic()
        due = False
        while self._delayed and self._delayed[0][0] <= now:
            _, offset, stream, shard = heapq.heappop(self._delayed)
            cursor = self.cursors.get((stream, shard))
            if cursor is not None and offset in cursor.unacked:
                self._redeliver.append((cursor, offset))
                due = True
        if self.options.ack_timeout_s:
            for cursor in self.cursors.values():
                for offset, delivery in cursor.unacked.items():
                    if delivery.deadline is not None and delivery.deadline <= now and delivery.consumer is not None:
                        delivery.consumer = None
                        delivery.deadline = None
                        self._redeliver.append((cursor, offset))
                        due = True
        if due:
            self.schedule_pump()
        if self._delayed or any(c.unacked for c in self.cursors.values()):
            self._arm_timer()

    def save(self) -> None:
        """Hand changed cursors to the sink."""
        if self.sink is None or not self._dirty:
            self._dirty.clear()
            return
        dirty, self._dirty = self._dirty, set()
        for key in dirty:
            cursor = self.cursors.get(key)
            if cursor is None:
                continue
            pending = cursor.pending_redelivery
            # (offsets enter `unacked` in order, which sorting a list of them finds in one pass)
            unacked = sorted(set(cursor.unacked).union(pending)) if pending else sorted(cursor.unacked)
            state = encode_cursor_state(cursor.position, unacked)
            self.sink.save_cursor(self.name, cursor.stream, cursor.shard, cursor.floor, state)

    def close(self) -> None:
        """The subscription is removed: stop its timer and forget what it handed out. Its
        deliveries hold their consumers (an MQTT session holds the subscription back), so
        keeping them would leave the session and its messages in a cycle until a full
        collection of the cycle collector, while the heap grows around them."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for cursor in self.cursors.values():
            cursor.unacked.clear()
        self._redeliver.clear()
        self._delayed.clear()


def is_durable(subscription: Subscription) -> bool:
    return isinstance(subscription, DurableSubscription)


OnDeliver = Callable[[Message], None]
