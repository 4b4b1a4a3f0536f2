"""The producer identity of a forwarded publish, and the check a shard's leader makes before it
stores one sent again, so that a publish held through a failover (`forwarding.HeldForwards`)
is stored once.

A node forwarding a publish (QoS >= 1) to its shard's leader gives it an identity: its node id,
its incarnation (random, new at every start) and a sequence number, in the message's native
properties under `FORWARD_ID`. It is stored with the record, so it is in the shard's log and
replicated with it, as Kafka keeps a producer's id and sequence in its record batches. When the
leader dies after storing (and replicating) the message but before its answer arrived, the
forwarding node holds the message and sends it to the next leader marked as possibly stored
(the identity under `RESENT_ID`, on the wire only). That leader looks for the identity in its
own log, from a little before the message's publish time (the journal's time index): found,
the message is acknowledged at the offset it has; not found, it is stored (under `FORWARD_ID`
again). A new leader answers only once it has settled (its high watermark reached the end of
the log it began its epoch with, every record an earlier leader may have stored readable);
before, the resend is refused retryably and held again, as is one found above the high
watermark (a resend to the same leader whose first copy waits for its replicas), until it is
committed there. What a leader read is kept per shard
(`ResendCheck`) until the view changes, so a failover's resends read the log once.

A copy found there reaches live subscribers although this leader did not dispatch it itself:
either its earlier leader committed it, and dispatched it then, or it is in the tail this
leader inherited past the high watermark it knew, which it hands on (dispatches) once its own
high watermark passes that tail's end (`replicated_shards.ReplicatedShards._hand_on`, set up as
it takes the lead). That is also when it settles (its high watermark reaches the end its epoch
began with), and the check answers nothing before: so a found copy is acknowledged only once
its hand-on is due, never one that nobody dispatches.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.errors import ShardUnavailable
from ..core.records import F_NATIVE, RecordFormatError, decode_message
from .replica_log import ReplicatedShardLog

if TYPE_CHECKING:
    from ..core.broker import Broker
    from ..core.message import Message

# The identity stored with a forwarded message's record.
FORWARD_ID = "shardgate-forward-id"
# The same identity on a copy sent again that its earlier leader may have stored: the receiving
# leader looks for it before storing (never stored under this name).
RESENT_ID = "shardgate-forward-resent"
# How far before a resent message's publish time its leader looks for it (the journal is found
# by time, the match is exact on the identity; the records of a shard need not be in time order).
SEARCH_BEFORE_MS = 30_000
# At most this many records are read for one check (a shard written very fast): beyond, the
# message is stored (at least once, as before).
MAX_SCAN = 200_000
READ_BATCH = 1024


class ForwardIds:
    """Gives the publishes this node forwards their identity (see the module docstring)."""

    def __init__(self, node_id: str) -> None:
        self._prefix = f"{node_id}:{os.urandom(6).hex()}:".encode()
        self._sequence = itertools.count(1)

    def tag(self, message: Message) -> None:
        native = message.native_properties
        forward_id = b"%s%d" % (self._prefix, next(self._sequence))
        if native is None:
            message.native_properties = {FORWARD_ID: forward_id}
        else:
            native = {name: value for name, value in native.items() if name != RESENT_ID}
            native[FORWARD_ID] = forward_id
            message.native_properties = native


def mark_resent(message: Message) -> None:
    """`message` may have been stored by the leader it was sent to: its next leader checks."""
    native = message.native_properties
    if native is None or FORWARD_ID not in native:
        return
    native = dict(native)
    native[RESENT_ID] = native.pop(FORWARD_ID)
    message.native_properties = native


def is_resent(message: Message) -> bool:
    native = message.native_properties
    return native is not None and RESENT_ID in native


@dataclass(slots=True)
class _Read:
    """What a leader read of one shard's log: the identities from offset `start` to `end`."""

    start: int
    end: int
    ids: dict[bytes, int] = field(default_factory=dict)


class ResendCheck:
    """A leader's check of resent messages against its log (see the module docstring)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._read: dict[tuple[str, int], _Read] = {}
        self.duplicates = 0

    def forget(self) -> None:
        """The view changed: leaderships may have moved, read again when asked."""
        self._read.clear()

    def stored_at(self, message: Message, stream: str, shard: int) -> int | None:
        """The offset at which this node's log of `stream`/`shard` (which it leads) holds the
        resent `message`, or None when it does not (store it then; its mark is undone).
        Raises ShardUnavailable while this leader cannot tell yet (not settled)."""
        native = message.native_properties
        if native is None or RESENT_ID not in native:
            return None
        forward_id = native[RESENT_ID]
        shard_log = self.broker.streams[stream].shards[shard].log
        if shard_log is None:  # a shard that keeps no log: at least once
            self._unmark(message)
            return None
        committed_end = None
        if isinstance(shard_log, ReplicatedShardLog):
            if not shard_log.settled:
                raise ShardUnavailable(f"the new leader of {stream}/{shard} is not settled yet; retry")
            # read past the high watermark too: a resend to the same leader (its link broke)
            # may find its first copy still waiting for the replicas
            committed_end = shard_log.committed_offset
            shard_log = shard_log.log
        since = shard_log.offset_for_timestamp(message.publish_time_ms - SEARCH_BEFORE_MS)
        key = (stream, shard)
        read = self._read.get(key)
        if read is None or read.start > since or read.end < since:
            read = self._read[key] = _Read(since, since)
        position, budget = read.end, MAX_SCAN
        ids = read.ids
        while budget > 0:
            batch = shard_log.read(position, min(READ_BATCH, budget))
            if not batch:
                break
            for record in batch:
                data = record.data
                if len(data) > 1 and data[1] & F_NATIVE:
                    try:
                        found = decode_message(data).native_properties
                    except RecordFormatError:
                        continue
                    if found is not None:
                        stored_id = found.get(FORWARD_ID)
                        if stored_id is not None:
                            ids[stored_id] = record.offset
            position = batch[-1].offset + 1
            budget -= len(batch)
        read.end = position
        offset = ids.get(forward_id)
        if offset is not None and committed_end is not None and offset >= committed_end:
            raise ShardUnavailable(f"{stream}/{shard} holds the message, not yet on enough "
                                   "replicas; retry")
        if offset is not None:
            self.duplicates += 1
            message.offset = offset
            return offset
        self._unmark(message)
        return None

    @staticmethod
    def _unmark(message: Message) -> None:
        native = dict(message.native_properties or {})
        native[FORWARD_ID] = native.pop(RESENT_ID)
        message.native_properties = native
