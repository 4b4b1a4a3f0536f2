"""The replicated state of a durable AMQP queue, as its home node writes it and a taker reads
it back (the pure part of `amqp_queue_replicas.py`: values, their byte form, and the choices
made from them; no I/O).

A durable queue's messages are in reliable shards, replicated as the stream says; what lives
only on its home is the queue itself: its definition (arguments, bindings, the declaring user)
and, per shard, its durable cursor (the next offset to take and the offsets taken and not yet
acknowledged: the ready messages and those delivered and unacknowledged). `QueueState` is
all of that at one moment, stamped with

- the queue's `incarnation` (a random id its etcd record got when it was declared: a queue
  deleted and declared again is another queue, and never reads its predecessor's state),
- the `epoch` of its etcd record (0 at the declare, one more at each takeover): a record
  written by a home that lost the queue (a paused process that resumes, a node cut off) has an
  older epoch and is never read as the queue's state,
- `seq`, growing with every state its writer writes.

The records go to the cluster's one internal state stream through `state_log.StateLog` (kind
`QUEUE_KIND`), keyed by vhost, queue and incarnation (`state_key`), stamped with the epoch:
`StateLog.latest(max_epoch=)` gives the newest of the highest epoch up to the record's, the
latest written within an epoch by its writer's sequence number even if the log holds it
before an older one (a forward re-routed after a leader change).

Any state a home wrote is a true past state of the queue: reading an older one than the latest
only delivers again what was acknowledged since (at least once), never loses a message.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

# The `StateLog` kind of the queues' states (topics `$internal/amqp-queue-states/<key>` of the
# internal state stream), and the stream a first version kept them in (its cursors are not
# part of a queue's state where a cluster still has it).
QUEUE_KIND = "amqp-queue-states"
LEGACY_STATE_STREAM = "_amqp-queue-state"
FORMAT = 1


class QueueStateError(ValueError):
    """A state record that cannot be read."""


def state_key(vhost: str, queue: str, incarnation: str) -> str:
    """The `StateLog` key of one incarnation of `queue` (a queue declared again is another
    key: it never reads its predecessor's state)."""
    return "/".join(quote(part, safe="") for part in (vhost, queue, incarnation))


@dataclass(slots=True)
class CursorEntry:
    """One shard's cursor: the next offset to take, and the offsets taken and not acknowledged."""

    stream: str
    shard: int
    position: int
    unacked: list[int] = field(default_factory=list)


@dataclass(slots=True)
class QueueState:
    vhost: str
    name: str
    incarnation: str
    epoch: int
    seq: int
    # what `TopologyRecord.queue_entry` gives: arguments, auto_delete, writer, bindings
    definition: dict[str, Any]
    cursors: list[CursorEntry]
    taken_ms: int

    def newer_than(self, other: QueueState | None) -> bool:
        return other is None or (self.epoch, self.seq) > (other.epoch, other.seq)


def _deltas(offsets: Sequence[int]) -> list[int]:
    """Sorted offsets as their differences (a queue's unacknowledged offsets are mostly
    consecutive: small numbers that compress well)."""
    ordered = sorted(offsets)
    return [value - previous for previous, value in zip([0, *ordered], ordered, strict=False)]


def _undeltas(deltas: Sequence[int]) -> list[int]:
    offsets, total = [], 0
    for delta in deltas:
        total += int(delta)
        offsets.append(total)
    return offsets


def encode_state(state: QueueState) -> bytes:
    """The record's payload: compressed JSON, the unacknowledged offsets as differences."""
    document = {
        "format": FORMAT, "vhost": state.vhost, "name": state.name,
        "incarnation": state.incarnation, "epoch": state.epoch, "seq": state.seq,
        "definition": state.definition, "taken_ms": state.taken_ms,
        "cursors": [[c.stream, c.shard, c.position, _deltas(c.unacked)] for c in state.cursors],
    }
    return zlib.compress(json.dumps(document, separators=(",", ":"), default=str).encode(), 6)


def decode_state(payload: bytes) -> QueueState:
    try:
        document = json.loads(zlib.decompress(payload))
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise QueueStateError(f"not a queue state of format {FORMAT}")
        definition = document.get("definition") or {}
        if not isinstance(definition, dict):
            raise QueueStateError("the definition is not an object")
        cursors = [
            CursorEntry(str(stream), int(shard), int(position), _undeltas(deltas))
            for stream, shard, position, deltas in document.get("cursors", [])
        ]
        return QueueState(
            str(document["vhost"]), str(document["name"]), str(document.get("incarnation", "")),
            int(document["epoch"]), int(document["seq"]), definition, cursors,
            int(document.get("taken_ms", 0)),
        )
    except QueueStateError:
        raise
    except (zlib.error, ValueError, TypeError, KeyError) as exc:
        raise QueueStateError(f"unreadable queue state: {exc}") from None


def taker(queue_key: str, candidates: Iterable[str]) -> str | None:
    """The node that takes a queue over from its dead home: the highest of the candidates
    (the live nodes) by a hash of node and queue (rendezvous hashing). Every node computes the
    same from the same view, so one of them tries; etcd's compare-and-set decides anyway."""
    best: tuple[bytes, str] | None = None
    for node in candidates:
        score = hashlib.blake2b(f"{node}\0{queue_key}".encode(), digest_size=8).digest()
        if best is None or (score, node) > best:
            best = (score, node)
    return None if best is None else best[1]


def record_fields(value: dict[str, Any]) -> tuple[str, int]:
    """A queue record's incarnation and epoch (a record written before either existed: "" and 0)."""
    return str(value.get("incarnation", "")), int(value.get("epoch", 0) or 0)
