"""A message sent again, stored once: the identities a publish carries in its native properties,
and the look-up a shard's storing node makes before it stores one marked as sent again.

Two identities, each stored with the record (so in the shard's log, and replicated with it, as
Kafka keeps a producer's id and sequence in its record batches):

- `PRODUCER_ID`: its client's, for a client that gives one (the gRPC SDK's idempotent
  `Producer`: a random producer id and a sequence number). A client that sends the message
  again (its answer was lost or late) marks it `PRODUCER_RESENT` instead.
- `FORWARD_ID`: a cluster node's, given to the publishes it forwards to the shard's leader
  (`shardgate/cluster/forward_ids.py`); one it holds through a failover and sends again is
  marked `RESENT_ID`.

A marked message is looked for in its shard (`Broker.publish`: on a single node, and on the node
leading the shard in a cluster) from a little before its publish time (the journal's time
index), by its client's identity and by its node's (a copy a node held through a failover may
meet one its client sent again through another node, stored first): found, it is acknowledged at the offset it has and not stored again; not found, its mark
is undone and it is stored under its identity. The look-up reads the log through the storage
Protocols only (`ShardLog`, and `ReplicatedLog` for a replicated shard): a new leader answers
only once it has settled (every record an earlier leader may have acknowledged is readable
there); before, and for a copy found above the high watermark (a resend to the same leader whose
first copy waits for its replicas) or while fewer than the minimum of replicas are in sync, it
raises `ShardUnavailable` (retry: a forwarding node holds
the message again, a client retries). What a node read is kept per shard (`ResendCheck`) until
the view changes or the look-ups move on, so a failover's resends read the log once.

The bound is time, not a count of batches (Kafka keeps each producer's last five): records from
`SEARCH_BEFORE_MS` before the publish time, at most `MAX_SCAN` of them, are compared. A copy
beyond (a shard written faster than `MAX_SCAN` records in that window, or one retention
deleted) is not found, and the message is stored again: at least once, as without an identity.
The journal shows only records it has made durable, so a resend that arrives while its first
copy still waits for its fsync is not found either.

Whoever marks the message must have sent it before under the same identity; the core never
looks at which protocol brought it in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..storage.interfaces import ReplicatedLog, ShardLog
from .errors import ShardUnavailable
from .records import F_NATIVE, RecordFormatError, decode_message

if TYPE_CHECKING:
    from .message import Message
    from .streams import Shard

# The identity a node forwarding a publish gave it, stored with the record.
FORWARD_ID = "shardgate-forward-id"
# The same identity on a copy sent again that its earlier leader may have stored: the receiving
# leader looks for it before storing (never stored under this name).
RESENT_ID = "shardgate-forward-resent"
# The identity its client gave the message (producer id and sequence), stored with the record.
PRODUCER_ID = "shardgate-producer-id"
# The same on a message its client sent again: looked for before storing (never stored so).
PRODUCER_RESENT = "shardgate-producer-resent"
# How far before a resent message's publish time its leader looks for it (the journal is found
# by time, the match is exact on the identity; the records of a shard need not be in time order).
SEARCH_BEFORE_MS = 30_000
# At most this many records are read for one check (a shard written very fast): beyond, the
# message is stored (at least once, as before).
MAX_SCAN = 200_000
READ_BATCH = 1024


def is_resent(message: Message) -> bool:
    """Whether `message` was sent before under its identity (a node's or its client's)."""
    native = message.native_properties
    return native is not None and (RESENT_ID in native or PRODUCER_RESENT in native)


def mark_resent(message: Message) -> None:
    """`message`, forwarded before, may have been stored by the leader it was sent to: its
    next leader checks."""
    native = message.native_properties
    if native is None or FORWARD_ID not in native:
        return
    native = dict(native)
    native[RESENT_ID] = native.pop(FORWARD_ID)
    message.native_properties = native


def unmark(message: Message) -> None:
    """Not found: `message` is stored, under its identities."""
    native = dict(message.native_properties or {})
    if RESENT_ID in native:
        native[FORWARD_ID] = native.pop(RESENT_ID)
    if PRODUCER_RESENT in native:
        native[PRODUCER_ID] = native.pop(PRODUCER_RESENT)
    message.native_properties = native


@dataclass(slots=True)
class _Read:
    """What a node read of one shard's log: the identities from offset `start` to `end`."""

    log: ShardLog  # (a stream deleted and made again has another: read it anew)
    start: int
    end: int
    forwarded: dict[bytes, int] = field(default_factory=dict)
    produced: dict[bytes, int] = field(default_factory=dict)


class ResendCheck:
    """The look-up of resent messages in the shards this node stores (see the module
    docstring); one per broker."""

    def __init__(self) -> None:
        self._read: dict[tuple[str, int], _Read] = {}
        self.duplicates = 0

    def forget(self) -> None:
        """The view changed: leaderships may have moved, read again when asked."""
        self._read.clear()

    def stored_at(self, message: Message, shard: Shard) -> int | None:
        """The offset at which `shard` (stored here) holds the resent `message` (set on it
        too), or None when it does not (store it then; its mark is undone). Raises
        ShardUnavailable while this node cannot tell yet (a leader not settled) or its copy is
        not committed yet."""
        native = message.native_properties
        if native is None:
            return None
        forward_id = native.get(RESENT_ID)
        producer_id = native.get(PRODUCER_RESENT)
        if forward_id is None and producer_id is None:
            return None
        if producer_id is None:
            # a forwarded copy held through a failover, whose client may have sent it again
            # meanwhile through another node (stored first there): its client's identity too
            producer_id = native.get(PRODUCER_ID)
        shard_log = shard.log
        if shard_log is None:  # a shard that keeps no log: at least once
            unmark(message)
            return None
        committed_end = None
        shard_log_acknowledging = True
        if isinstance(shard_log, ReplicatedLog):
            if not shard_log.settled:
                raise ShardUnavailable(
                    f"the new leader of {shard.stream}/{shard.index} is not settled yet; retry")
            # read past the high watermark too: a resend to the same leader (its link broke)
            # may find its first copy still waiting for the replicas
            committed_end = shard_log.committed_offset
            shard_log_acknowledging = shard_log.acknowledging
            shard_log = shard_log.log
        since = shard_log.offset_for_timestamp(message.publish_time_ms - SEARCH_BEFORE_MS)
        key = (shard.stream, shard.index)
        read = self._read.get(key)
        if (read is None or read.log is not shard_log or read.start > since or read.end < since
                or since - read.start > MAX_SCAN):
            # (moved on that far, what was read before is dropped: the cache stays bounded)
            read = self._read[key] = _Read(shard_log, since, since)
        position, budget = read.end, MAX_SCAN
        forwarded, produced = read.forwarded, read.produced
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
                    if found is not None:  # (the first copy, if a resend was stored again)
                        stored_id = found.get(FORWARD_ID)
                        if stored_id is not None:
                            forwarded.setdefault(stored_id, record.offset)
                        stored_id = found.get(PRODUCER_ID)
                        if stored_id is not None:
                            produced.setdefault(stored_id, record.offset)
            position = batch[-1].offset + 1
            budget -= len(batch)
        read.end = position
        offset = produced.get(producer_id) if producer_id is not None else None
        if offset is None and forward_id is not None:
            offset = forwarded.get(forward_id)
        if offset is not None and committed_end is not None and (
                offset >= committed_end or not shard_log_acknowledging):
            # (below the minimum of in-sync replicas, what the mark passed is not acknowledged)
            raise ShardUnavailable(f"{shard.stream}/{shard.index} holds the message, not yet "
                                   "on enough replicas; retry")
        if offset is not None:
            self.duplicates += 1
            message.offset = offset
            return offset
        unmark(message)
        return None
