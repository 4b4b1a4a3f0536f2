"""The keyed index of one kind of `StateLog` records (`state_log.py`): for each key and each
epoch, the newest value committed in the internal stream, kept in memory as the stream is
read, so that a reader asks the shard only for what was appended since its last read.

What it is for: a user whose records carry an owner's epoch (a durable AMQP queue's home:
0 at its declare, one more at each takeover) asks for the newest record of the highest epoch
up to the one it knows (`StateIndex.latest(key, max_epoch)`), never a later-written record of
an earlier owner (a paused or cut-off home that resumed and wrote once more before it saw
the takeover). Each record is stamped by its writer (`stamp`: message headers, not the
value's bytes) with its epoch and a sequence number growing with every record the writer
process writes; of one epoch the highest sequence number wins, whatever order the log holds
them in (a forwarded batch retried after a leader change), the later offset on a tie. A
record with no stamp counts as epoch 0, sequence 0.

How it reads: the records of the kind's route (`$internal/<kind>/#`) from the leader of the
stream's shard (here, or through `state_rpc.read_shard`), up to its committed end, refusing
(`ShardUnreadable`) while a new leader has not committed what earlier epochs held. The index
covers every record written from `since_ms` on up to `next_offset`; a later read goes on
from `next_offset` (forwards), and one asking for an earlier `since_ms` reads the older part
once (backwards, up to where the index began). Merging by (epoch, sequence, offset) makes
the order of reading irrelevant. Entries older than the stream's retention are dropped (the
log no longer holds them either).

It must not: read anything at start (the first `latest` reads), or keep more per key than
the newest record of each epoch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote

from ..core.message import Message, now_ms
from ..core.records import RecordFormatError, decode_to_message, record_topic
from .journal_search import ShardUnreadable

if TYPE_CHECKING:
    from ..core.broker import Broker
    from .control import ClusterNode

EPOCH_HEADER = "sg-state-epoch"
SEQ_HEADER = "sg-state-seq"
# Records read at a time.
READ_BATCH = 512


def stamp(epoch: int, seq: int) -> list[tuple[str, str]]:
    """The headers a record of `epoch`, its writer's `seq`-th, carries."""
    return [(EPOCH_HEADER, str(epoch)), (SEQ_HEADER, str(seq))]


def version_of(message: Message) -> tuple[int, int]:
    """(epoch, seq) of a record (0, 0 when it carries no stamp or an unreadable one)."""
    epoch = seq = 0
    for name, value in message.headers or ():
        try:
            if name == EPOCH_HEADER:
                epoch = int(value)
            elif name == SEQ_HEADER:
                seq = int(value)
        except ValueError:
            return 0, 0
    return epoch, seq


@dataclass(slots=True)
class Entry:
    """The newest record of one key and epoch seen so far."""

    seq: int
    offset: int
    time_ms: int
    value: bytes


class StateIndex:
    """The newest record of each key and epoch of one kind (module docstring)."""

    def __init__(self, node: ClusterNode, broker: Broker, stream: str, prefix: str,
                 retention_ms: int) -> None:
        self.node = node
        self.broker = broker
        self.stream = stream
        self.prefix = prefix  # `$internal/<kind>/`: a key is the rest of the topic, unquoted
        self.route = prefix + "#"
        self.retention_ms = retention_ms
        self._keys: dict[str, dict[int, Entry]] = {}
        self._since_ms: int | None = None  # None: nothing read yet
        self.next_offset = 0
        self._lock = asyncio.Lock()
        self.records_read = 0  # records of the kind read from the stream, in all

    # ------------------------------------------------------------ the pure part
    def observe(self, message: Message, offset: int) -> None:
        """Take one record of the kind into the index."""
        if not message.topic.startswith(self.prefix):
            return
        key = unquote(message.topic[len(self.prefix):])
        epoch, seq = version_of(message)
        epochs = self._keys.setdefault(key, {})
        entry = epochs.get(epoch)
        if entry is None or (seq, offset) > (entry.seq, entry.offset):
            epochs[epoch] = Entry(seq, offset, message.publish_time_ms, message.payload)

    def chosen(self, key: str, max_epoch: int | None, since_ms: int = 0) -> tuple[int, bytes] | None:
        """(epoch, value) of `key`'s newest record of the highest epoch up to `max_epoch` (any
        epoch: None) written from `since_ms` on, from what the index holds."""
        epochs = self._keys.get(key)
        if not epochs:
            return None
        found = [epoch for epoch, entry in epochs.items()
                 if (max_epoch is None or epoch <= max_epoch) and entry.time_ms >= since_ms]
        if not found:
            return None
        epoch = max(found)
        return epoch, epochs[epoch].value

    def _prune(self) -> None:
        horizon = now_ms() - self.retention_ms
        for key in list(self._keys):
            epochs = self._keys[key]
            for epoch in [epoch for epoch, entry in epochs.items() if entry.time_ms < horizon]:
                del epochs[epoch]
            if not epochs:
                del self._keys[key]

    # ------------------------------------------------------------ reading the stream
    async def latest(self, key: str, since_ms: int, max_epoch: int | None,
                     timeout_s: float = 5.0) -> tuple[int, bytes] | None:
        """`chosen` once the index holds every record of the kind written from `since_ms` on
        up to the shard's committed end. Raises ShardUnreadable when that cannot be read now."""
        async with self._lock:
            if self._since_ms is None:
                self.next_offset = await self._read(since_ms, 0, None, timeout_s)
                self._since_ms = since_ms
            else:
                if since_ms < self._since_ms:  # the older part, once
                    await self._read(since_ms, 0, self.next_offset, timeout_s)
                    self._since_ms = since_ms
                self.next_offset = await self._read(None, self.next_offset, None, timeout_s)
            self._prune()
        return self.chosen(key, max_epoch, since_ms)

    def _handle(self, data: bytes, offset: int) -> None:
        try:
            message = decode_to_message(data)
        except (RecordFormatError, ValueError):
            return
        self.records_read += 1
        self.observe(message, offset)

    async def _read(self, since_ms: int | None, start: int, stop: int | None,
                    timeout_s: float) -> int:
        """Reads the kind's records from `start` (or the first written from `since_ms` on) to
        the committed end, or to `stop`; the offset after the last one read."""
        assignment = self.node.view.leader(self.stream, 0)
        if assignment is None or assignment.leader not in self.node.view.nodes():
            raise ShardUnreadable(f"{self.stream}/0 has no live owner")
        if assignment.leader == self.node.node_id:
            return await self._read_here(since_ms, start, stop)
        return await self._read_there(assignment.leader, since_ms, start, stop, timeout_s)

    async def _read_here(self, since_ms: int | None, start: int, stop: int | None) -> int:
        stream = self.broker.streams.get(self.stream)
        shard_log = stream.shards[0].log if stream is not None else None
        if shard_log is None:
            raise ShardUnreadable(f"{self.stream}/0 keeps no journal here")
        if not getattr(shard_log, "settled", True):
            raise ShardUnreadable(f"{self.stream}/0: its new leader has not settled yet")
        position = max(start, int(getattr(shard_log, "low_watermark", 0)))
        if since_ms is not None:
            position = max(position, shard_log.offset_for_timestamp(since_ms))
        wanted = self._wanted()
        while stop is None or position < stop:
            batch = shard_log.read(position, READ_BATCH)
            if not batch:
                break
            for record in batch:
                if record.offset < position:
                    continue
                if stop is not None and record.offset >= stop:
                    return stop
                if wanted(record.data):
                    self._handle(record.data, record.offset)
                position = record.offset + 1
            await asyncio.sleep(0)  # a long read does not hold the loop
        return position if stop is None else max(position, stop)

    def _wanted(self) -> Callable[[bytes], bool]:
        prefix = self.prefix

        def wanted(data: bytes) -> bool:
            try:
                return record_topic(data).startswith(prefix)
            except RecordFormatError:
                return False

        return wanted

    async def _read_there(self, leader: str, since_ms: int | None, start: int, stop: int | None,
                          timeout_s: float) -> int:
        rpc = self.node.state_rpc
        if rpc is None:
            raise ShardUnreadable(f"{self.stream}/0: this node cannot call its peers yet")
        position = start
        while True:
            request = {"stream": self.stream, "shard": 0, "from": position, "max": READ_BATCH,
                       "filters": [self.route], "node": self.node.node_id}
            if since_ms is not None:
                request["since_ms"] = since_ms
            try:
                header, records = await rpc.read_shard(leader, request, timeout_s)
            except Exception as exc:  # noqa: BLE001 - a link down, a timeout: asked again later
                raise ShardUnreadable(f"{self.stream}/0 on {leader}: {exc}") from exc
            if "error" in header:
                raise ShardUnreadable(f"{self.stream}/0 on {leader}: {header['error']}")
            for record in records:
                if stop is not None and record.offset >= stop:
                    return stop
                self._handle(bytes(record.data), record.offset)
            position = max(position, int(header["next"]))
            if stop is not None and position >= stop:
                return stop
            if header.get("caught_up"):
                if not header.get("settled", True):
                    raise ShardUnreadable(f"{self.stream}/0 on {leader}: its new leader has not "
                                          "settled yet")
                return position
