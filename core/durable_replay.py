"""Replay of a durable subscription's cursors: reading a shard's log from a cursor's position
(the journal through its key index or in blocks, a peer's log in a cluster, the archive below
the journal's low watermark) and handing what the filters want to consumers with room,
within a budget of records and time per event-loop turn.

A part of `DurableSubscription` (`core/durable.py`), which holds the state, schedules the
pump and sends each delivery (`_send`): this module only reads and chooses.
"""

from __future__ import annotations

import asyncio
import logging
import math
import operator
import struct
import time
from bisect import bisect_left
from typing import TYPE_CHECKING, TypeGuard

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
from .durable_state import ShardCursor
from .filter_sets import FilterSet
from .message import Message, now_ms
from .records import READABLE_VERSIONS, RecordFormatError, decode_to_message, record_topic
from .subscriptions import Consumer, Subscription

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .broker import Broker

log = logging.getLogger("shardgate.core.durable")

REPLAY_BATCH = 256
SCAN_BUDGET = 1024
"""Records a replaying cursor examines per event-loop turn, delivered or not: a session that
resumes far behind a busy shard whose records it mostly does not want yields to other work
(new connections, acknowledgements) between batches instead of scanning to the end at once.
The empty records of offsets a crash skipped (up to a reservation's worth after each crash) are
not counted: they cost nothing to pass, and a message confirmed behind them must reach its
queue at once."""
DEADLINE_EVERY = 16
"""Deliveries between two looks at the clock during a replay (see `DurableSubscription._pump`)."""
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


class ShardReplay(Subscription):
    """The replaying part of `DurableSubscription` (no state of its own)."""

    __slots__ = ()

    broker: Broker
    _dirty: set[tuple[str, int]]

    if TYPE_CHECKING:  # provided by the other parts of DurableSubscription (`core/durable.py`)
        def schedule_pump(self) -> None:
            raise NotImplementedError

        def _send(self, cursor: ShardCursor, message: Message, filters: Sequence[str],
                  consumer: Consumer, count: int) -> None:
            raise NotImplementedError

        def _compiled_filters(self) -> FilterSet:
            raise NotImplementedError

        def _wants_key(self, key: bytes) -> bool:
            raise NotImplementedError

        def _filters_for(self, topic: str) -> tuple[str, ...]:
            raise NotImplementedError

        def _pump_after_commit(self, cursor: ShardCursor) -> None:
            raise NotImplementedError

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
            if message is None:
                message = self._read_one(cursor, offset)
                if message is None and self._not_readable_yet(cursor, offset):
                    # Stored, but not readable here yet: a commit is still to come (a
                    # replicated shard's new leader below its high watermark, a journal write
                    # not yet durable). It waits, as a replay does: dropped, it would be lost
                    # for good (the cursor's position is past it).
                    self._pump_after_commit(cursor)
                    return budget
            cursor.pending_redelivery.pop(0)
            if message is None:
                continue
            filters = self._filters_for(message.topic)
            if filters:
                self._send(cursor, message, filters, consumer, 2)
                budget -= 1
        return budget

    @staticmethod
    def _not_readable_yet(cursor: ShardCursor, offset: int) -> bool:
        """Whether `offset` is in the cursor's log (below its end) but reads nothing yet."""
        shard_log = cursor.log
        if shard_log is None or offset >= shard_log.next_offset:
            return False
        try:
            return not shard_log.read(offset, 1)
        except StorageError:
            return False  # `_read_one` says why

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
