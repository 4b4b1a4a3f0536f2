"""What a peer link has written and not had answered yet, how queued messages are packed
into a frame, and what the peer's answer settles: the pieces of `peer_link.PeerLink` that hold
no connection.

A frame carries the forwarded publishes as packed `ForwardBatch`es and the pushes as packed
`PushBatch`es (one per run of messages of one shard, in queue order), bounded by
`FRAME_MAX_MESSAGES` and `FRAME_MAX_BYTES`. Nothing here sends, awaits or decides a route.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.errors import PublishRejected, ShardUnavailable
from ..proto import cluster_pb2 as pb
from .frames import pack_records

if TYPE_CHECKING:
    from ..core.message import Message

log = logging.getLogger(__name__)

FRAME_MAX_MESSAGES = 2_000
FRAME_MAX_BYTES = 4 << 20


class Shared:
    """The one future of the QoS 0 publishes queued for a peer between two writes: nobody
    waits on them one by one (an MQTT QoS 0 publisher never looks; an AMQP transient publish
    with confirms is confirmed with its batch). It resolves once the owner has taken every
    one of them, and fails when the owner refused any (a retryable error: at least once)."""

    __slots__ = ("future", "pending", "error")

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future
        self.pending = 0
        self.error: PublishRejected | None = None

    def settle(self, count: int, error: PublishRejected | None = None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.pending -= count
        if self.pending <= 0 and not self.future.done():
            if self.error is None:
                self.future.set_result(None)
            else:
                fail(self.future, self.error)


# What a forwarded publish's sender waits on: its own future, or the `Shared` one of its write.
Waiter = asyncio.Future[None] | Shared
# Settles one waiter: stored (None) or refused with the error.
SettleOne = Callable[[Waiter, PublishRejected | None], None]
# Re-routes a message its owner refused as not its own (`PeerLink._rerouted`): whether it did.
Reroute = Callable[["Message", "asyncio.Future[None] | None", int, pb.Outcome], bool]
# A publish queued for the peer: (message, epoch, its future or None, the shared future of
# the QoS 0 ones or None).
Queued = tuple["Message", int, asyncio.Future[None] | None, Shared | None]


class SentBatch:
    """A `ForwardBatch` written and not answered yet: its messages, and for each the future
    of its publisher (the `Shared` of its write for an unacknowledged batch)."""

    __slots__ = ("messages", "waiters", "epoch", "unacknowledged")

    def __init__(self, messages: list[Message], waiters: list[Waiter],
                 epoch: int, unacknowledged: bool) -> None:
        self.messages = messages
        self.waiters = waiters
        self.epoch = epoch
        self.unacknowledged = unacknowledged


class SentFrame:
    """A frame written to the peer and not answered yet: written again on a new stream of the
    same session after a break, until its answer comes."""

    __slots__ = ("frame", "batches", "forwarded", "pushes", "route_generation", "written_at",
                 "pushes_before")

    def __init__(
        self, frame: pb.PeerFrame, batches: list[SentBatch], forwarded: int,
        pushes: int, route_generation: int, pushes_before: int = 0,
    ) -> None:
        self.frame = frame
        self.batches = batches
        self.forwarded = forwarded  # messages in the batches
        self.pushes = pushes
        # how many pushes the link had put into frames before this one's
        self.pushes_before = pushes_before
        self.route_generation = route_generation
        self.written_at = time.perf_counter()


def take_pushes(pushes: list[tuple[Message, tuple[str, ...]]], frame: pb.PeerFrame,
                count: int, size: int) -> int:
    """Move queued pushes (as many as the frame still holds) into `frame`, as one packed
    `PushBatch` per run of messages of one shard with the same share groups, in the
    queue's order. Returns how many."""
    runs: list[tuple[list[Message], tuple[str, ...]]] = []
    run_key: tuple[str, int, tuple[str, ...]] | None = None
    messages: list[Message] = []
    taken = 0
    for message, groups in pushes:
        if count >= FRAME_MAX_MESSAGES or (count and size >= FRAME_MAX_BYTES):
            break
        count += 1
        taken += 1
        size += len(message.payload) + len(message.topic)
        key = (message.stream, message.shard, groups)
        if key != run_key:
            run_key = key
            messages = []
            runs.append((messages, groups))
        messages.append(message)
    del pushes[:taken]
    for messages, groups in runs:
        first = messages[0]
        try:
            records = pack_records(messages)
        except (ValueError, OverflowError, struct.error):  # stored, so encodable; but safe
            log.exception("cluster: a stored message could not be packed for a push")
            continue
        frame.push_batches.add(
            stream=first.stream, shard=first.shard, records=records,
            offsets=[message.offset for message in messages], share_groups=groups,
        )
    return taken


def take_batches(forwards: list[Queued], frame: pb.PeerFrame,
                 refuse: Callable[[Waiter, PublishRejected], None],
                 ) -> tuple[list[SentBatch], int, int]:
    """Move the queued publishes (as many as a frame holds) into `frame`, as one packed
    `ForwardBatch` per run of messages to the same shard, epoch and acknowledgement; the
    runs keep the order of the queue. A message a record cannot hold is handed to `refuse`
    and leaves its batch. Returns the batches, the messages and their bytes."""
    batches: list[SentBatch] = []
    count = size = 0
    run_key: tuple[str, int, int, bool, bool] | None = None
    messages: list[Message] = []
    waiters: list[Waiter] = []
    for message, epoch, future, shared in forwards:
        if count >= FRAME_MAX_MESSAGES or (count and size >= FRAME_MAX_BYTES):
            break
        count += 1
        size += len(message.payload) + len(message.topic)
        key = (message.stream, message.shard, epoch, future is None, message.transient)
        if key != run_key:
            run_key = key
            messages, waiters = [], []
            batches.append(SentBatch(messages, waiters, epoch, future is None))
        messages.append(message)
        waiters.append(future if future is not None else shared)  # type: ignore[arg-type]
    del forwards[:count]
    for batch in batches:
        first = batch.messages[0]
        try:
            records = pack_records(batch.messages)
        except (ValueError, OverflowError, struct.error):
            records = _packable(batch, refuse)
        frame.batches.add(
            stream=first.stream, shard=first.shard, epoch=batch.epoch, records=records,
            unacknowledged=batch.unacknowledged, transient=first.transient,
        )
    return batches, count, size


def _packable(batch: SentBatch, refuse: Callable[[Waiter, PublishRejected], None]) -> bytes:
    """The records of the messages of `batch` that a record can hold; the others are
    refused (`refuse`) and leave the batch (a field too long for the record format, say)."""
    kept: list[Message] = []
    kept_waiters: list[Waiter] = []
    for message, waiter in zip(batch.messages, batch.waiters, strict=True):
        try:
            pack_records((message,))
        except (ValueError, OverflowError, struct.error) as exc:
            refuse(waiter, PublishRejected(f"the message cannot be forwarded: {exc}"))
            continue
        kept.append(message)
        kept_waiters.append(waiter)
    batch.messages[:] = kept
    batch.waiters[:] = kept_waiters
    return pack_records(kept)


def settle_batch(batch: SentBatch, result: pb.BatchOutcome | None, node_id: str,
                 settle_one: SettleOne, rerouted: Reroute) -> None:
    """The owner `node_id` answered a batch: resolve its publishers' futures (stored),
    re-route the messages it did not own, fail the ones it refused."""
    messages, waiters = batch.messages, batch.waiters
    if result is None:  # the owner answered the frame without this batch
        for waiter in waiters:
            settle_one(waiter, refusal(node_id, None))
        return
    refused: dict[int, pb.Outcome] = {}
    if result.refused:
        refused = {outcome.index: outcome for outcome in result.refused}
    if batch.unacknowledged:
        if not refused and waiters:
            # the common case: every message taken; count them down per shared future
            first = waiters[0]
            if waiters[-1] is first:
                first.settle(len(waiters))  # type: ignore[union-attr]
                return
        for index, waiter in enumerate(waiters):
            outcome = refused.get(index) if refused else None
            if outcome is None:
                waiter.settle(1)  # type: ignore[union-attr]
            elif rerouted(messages[index], None, batch.epoch, outcome):
                waiter.settle(1)  # type: ignore[union-attr]
            else:
                settle_one(waiter, refusal(node_id, outcome))
        return
    offsets = list(result.offsets)
    known = len(offsets)
    for index, message in enumerate(messages):
        future = waiters[index]
        if future.done():  # type: ignore[union-attr]
            continue
        outcome = refused.get(index) if refused else None
        if outcome is None and index < known:
            message.offset = offsets[index]
            future.set_result(None)  # type: ignore[union-attr]
        elif outcome is None or not rerouted(message, future, batch.epoch, outcome):  # type: ignore[arg-type]
            settle_one(future, refusal(node_id, outcome))


def seen(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


def fail(future: asyncio.Future[None], error: BaseException) -> None:
    """Fail a forward's future, marked as seen: a QoS 0 publisher never looks at it, and an
    unretrieved failure would be logged by asyncio as a bug."""
    future.set_exception(error)
    future.exception()


def refusal(node_id: str, outcome: pb.Outcome | None) -> PublishRejected:
    """The error a publisher gets for a forward its owner refused (None: not answered)."""
    if outcome is None:
        return ShardUnavailable(f"node {node_id} did not answer for the message; retry")
    reason = outcome.reason or pb.OutcomeCode.Name(outcome.code).lower()
    if outcome.code == pb.NOT_OWNER:
        return ShardUnavailable(reason)
    return PublishRejected(reason)
