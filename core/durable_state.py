"""The state a durable subscription keeps per shard, and how it is saved.

`ShardCursor` is one shard's cursor (the next offset to deliver, what was handed out and not
acknowledged, what was read ahead or fetched from the archive), `Delivery` one message handed
out; `DurableOptions` the subscription's settings; `CursorSink` where progress is saved and
`encode_cursor_state` / `decode_cursor_state` its byte format. Plain state: no delivery, no
reading of logs (`core/durable.py`, `core/durable_replay.py`).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..storage.interfaces import RecordSpans, ShardLog, StoredRecord
from .message import Message
from .subscriptions import Consumer


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

    def retention_floor(self, held_from: int | None = None) -> int:
        """The lowest offset journal retention must keep for this cursor. Its `floor`, except
        for a live cursor with nothing in hand: every record its log has shown subscribers was
        offered to it live and either taken and acknowledged or not matched by its filters, so
        it needs none of them, and its position moves there (a later replay starts there, not
        below the journal's start). Without this, a cursor on a shard whose records its filters
        never match (every durable subscription has one on every reliable shard) would hold the
        journal at the offset where it opened, forever.

        `held_from` is the first offset of the shard the broker still holds for its commit
        (`Broker.held_offsets`): below the log's deliverable end, but not offered live yet. The
        position stops there: past it, the live offer of that message would count as already
        delivered by a replay, and the cursor would never deliver it."""
        shard_log = self.log
        if (shard_log is None or not self.live or self.unacked or self.pending_redelivery
                or self.ahead or self.archived or self.restored or not self.placed):
            return self.floor
        end = min(shard_log.deliverable_end, shard_log.next_offset)
        if held_from is not None:
            end = min(end, held_from)
        self.position = max(self.position, end)
        return self.position
