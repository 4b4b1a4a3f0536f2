"""Where a durable subscription's cursors start and move: opened on every shard, restored
from saved state, placed in a cluster once the shard map is known, handed over from another
node, moved by a seek; and what the cursors still owe (lag, in flight).

A part of `DurableSubscription` (`core/durable.py`), which alone holds the state and delivers:
this module neither delivers nor reads records (`core/durable_replay.py` does).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..storage.interfaces import ShardLog
from .durable_state import Delivery, ShardCursor, decode_cursor_state
from .message import Message
from .subscriptions import Consumer, Subscription

if TYPE_CHECKING:
    from .broker import Broker


class CursorPositions(Subscription):
    """The cursor-positioning part of `DurableSubscription` (no state of its own)."""

    __slots__ = ()

    broker: Broker
    cursors: dict[tuple[str, int], ShardCursor]
    initial_position: str | int
    _dirty: set[tuple[str, int]]
    _redeliver: deque[tuple[ShardCursor, int]]

    if TYPE_CHECKING:  # provided by the other parts of DurableSubscription (`core/durable.py`)
        def schedule_pump(self) -> None:
            raise NotImplementedError

        def _read_one(self, cursor: ShardCursor, offset: int) -> Message | None:
            raise NotImplementedError

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
