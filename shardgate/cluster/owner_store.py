"""The owner's store of forwarded publishes: the messages a peer forwarded here, to the owner
of their shard, are published to the local core (a packed batch as one `publish_many`, one
journal append), and the frame is answered once every one is stored (an unacknowledged batch
once its messages are published) with each message's offset or why it was refused.

The owner checks the shard map again for every message: one for a shard it does not own under
the sender's epoch is refused `NOT_OWNER` (the sender re-routes it, `forwarding.py`); one sent
under a newer epoch than this node's view knows waits (bounded) for the view to catch up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..core.errors import CoreError, PublishRejected, ShardUnavailable
from ..core.resends import is_resent
from ..proto import cluster_pb2 as pb
from .frames import RecordFormatError, message_from_forward, unpack_records

if TYPE_CHECKING:
    from ..core.message import Message
    from .data_plane import DataPlane


class _Batch:
    """What the receiving owner answers for one `ForwardBatch`: each message's offset (an
    acknowledged batch) and the messages it refused."""

    __slots__ = ("offsets", "refused", "pending", "acknowledged")

    def __init__(self, unacknowledged: bool) -> None:
        self.acknowledged = not unacknowledged
        self.offsets: list[int] = []
        self.refused: list[pb.Outcome] = []
        # outcomes of the messages stored one by one, read when the answer is made
        self.pending: list[pb.Outcome] = []

    def size(self, count: int) -> None:
        if self.acknowledged:
            self.offsets = [-1] * count

    def stored(self, index: int, offset: int) -> None:
        if self.acknowledged:
            self.offsets[index] = offset

    def refuse(self, index: int, code: int, reason: str) -> None:
        self.refused.append(pb.Outcome(code=code, reason=reason, index=index))  # type: ignore[arg-type]

    def slow(self, index: int) -> pb.Outcome:
        outcome = pb.Outcome(index=index)
        self.pending.append(outcome)
        return outcome

    def outcome(self) -> pb.BatchOutcome:
        refused = self.refused
        for outcome in self.pending:
            if outcome.code == pb.STORED:
                self.stored(outcome.index, outcome.offset)
            else:
                refused.append(outcome)
        self.pending = []
        return pb.BatchOutcome(offsets=self.offsets, refused=refused)


class ForwardStore:
    """Stores what peers forward to this node (one per data plane)."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.broker = plane.broker
        self.view = plane.view
        self.stats = plane.stats
        self.node_id = plane.node_id
        self.storing = 0  # frames of forwarded publishes being stored, not answered yet

    def store_forwards(
        self, sequence: int, forwards: Sequence[pb.Forward], batches: Sequence[pb.ForwardBatch],
        answer: Callable[[pb.PeerReply], None],
    ) -> None:
        """Store the forwarded messages of one frame and answer it once all are stored (an
        unacknowledged batch once its messages are published)."""
        outcomes = [pb.Outcome() for _ in forwards]
        # commit future -> the outcomes of the messages it stores
        waiting: dict[asyncio.Future[None], list[tuple[pb.Outcome, Message]]] = {}
        # commit future -> (batch, indices) of the batch messages it stores
        waiting_batches: dict[asyncio.Future[None], list[tuple[_Batch, list[int]]]] = {}
        # the pass below, each commit future waited on, and each message waiting for the view
        remaining = [1]
        self.storing += 1
        results: list[_Batch] = []

        def settled() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self.storing -= 1
                answer(pb.PeerReply(sequence=sequence, outcomes=outcomes,
                                    batches=[result.outcome() for result in results]))

        def landed(future: asyncio.Future[None]) -> None:
            failed = future.cancelled() or future.exception() is not None
            error = ("cancelled" if future.cancelled() else future.exception()) if failed else None
            # a shard whose leadership changed while the message waited for its replicas: the
            # sender may send it again to the next leader (NOT_OWNER), as one never taken
            code = pb.NOT_OWNER if isinstance(error, ShardUnavailable) else pb.FAILED
            for outcome, message in waiting.pop(future, ()):
                if failed:
                    outcome.code = code
                    outcome.reason = f"the owner could not store the message: {error}"
                else:
                    outcome.offset = message.offset
            if failed:
                for batch, indices in waiting_batches.pop(future, ()):
                    for index in indices:
                        batch.refuse(index, code, f"the owner could not store the message: {error}")
            settled()

        def wait_for(future: asyncio.Future[None]) -> None:
            if future not in waiting and future not in waiting_batches:
                remaining[0] += 1
                future.add_done_callback(landed)

        def later(outcome: pb.Outcome, message: Message, epoch: int) -> None:
            """The sender knew a newer shard map (or stream) than this node's view: stored
            (or refused) once the view has caught up."""
            remaining[0] += 1

            def again() -> None:
                future = self._store_forward(message, epoch, outcome, None)
                if future is not None:
                    wait_for(future)
                    waiting.setdefault(future, []).append((outcome, message))
                settled()

            def routed_here() -> bool:  # this node routes the topic to the sender's stream
                return self.broker.stream_for_topic(message.topic).name == message.stream

            self.plane.forwarding.after_epoch(message.stream, message.shard, epoch, again, routed_here)

        def one(message: Message, epoch: int, outcome: pb.Outcome, wait: bool = True) -> None:
            future = self._store_forward(message, epoch, outcome, later)
            if future is not None and wait:
                wait_for(future)
                waiting.setdefault(future, []).append((outcome, message))

        self.stats.forwarded_in += len(forwards)
        for index, forward in enumerate(forwards):
            try:
                message = message_from_forward(forward)
            except RecordFormatError as exc:
                outcomes[index].code = pb.REJECTED
                outcomes[index].reason = f"malformed forwarded message: {exc}"
                continue
            one(message, forward.epoch, outcomes[index])
        for batch in batches:
            result = _Batch(batch.unacknowledged)
            results.append(result)
            self._store_batch(batch, result, one, waiting_batches, wait_for)
        settled()

    def _store_batch(
        self, batch: pb.ForwardBatch, result: _Batch,
        one: Callable[[Message, int, pb.Outcome, bool], None],
        waiting: dict[asyncio.Future[None], list[tuple[_Batch, list[int]]]],
        wait_for: Callable[[asyncio.Future[None]], None],
    ) -> None:
        """Publish the messages of one packed batch here, their shard's owner: the messages
        this node routes to the batch's shard, while it owns it, as one `publish_many` (one
        journal append); any other one by one, as a lone forward is (`_store_forward`)."""
        stream_name, shard, epoch = batch.stream, batch.shard, batch.epoch
        items = unpack_records(batch.records, stream_name, shard)
        self.stats.forwarded_in += len(items)
        acknowledged = not batch.unacknowledged
        result.size(len(items))
        broker = self.broker
        # (not while its log does not take publishes: refused, retryably, as below)
        owned = not self.plane.stopping and self.plane.stores(stream_name, shard)
        # topic -> whether this node routes it to the batch's shard (messages without a key)
        here: dict[str, bool] = {}
        direct: list[Message] = []
        direct_indices: list[int] = []
        for index, item in enumerate(items):
            if isinstance(item, RecordFormatError):
                result.refuse(index, pb.REJECTED, f"malformed forwarded message: {item}")
                continue
            if batch.transient:
                item.transient = True
            routed = here.get(item.topic) if item.key is None else None
            if routed is None:
                try:
                    stream = broker.stream_for_topic(item.topic)
                    routed = (stream.name == stream_name
                              and stream.shard_for(item.topic, item.key).index == shard)
                except (CoreError, ValueError):
                    routed = False
                if item.key is None:
                    here[item.topic] = routed
            if owned and routed and not is_resent(item):
                direct.append(item)
                direct_indices.append(index)
            else:
                one(item, epoch, result.slow(index), acknowledged)
        if not direct:
            return
        # counted once, by the node its client published to
        outcomes = broker.publish_many(direct, counted=False)
        commits: dict[asyncio.Future[None], list[int]] = {}
        for index, message, published in zip(direct_indices, direct, outcomes, strict=True):
            if published is None:
                result.stored(index, message.offset)
            elif isinstance(published, PublishRejected):
                code = pb.NOT_OWNER if isinstance(published, ShardUnavailable) else pb.REJECTED
                result.refuse(index, code, str(published))
            else:
                result.stored(index, message.offset)
                if acknowledged:
                    indices = commits.get(published)
                    if indices is None:
                        indices = commits[published] = []
                    indices.append(index)
        for future, indices in commits.items():
            wait_for(future)
            waiting.setdefault(future, []).append((result, indices))

    def _store_forward(
        self, message: Message, epoch: int, outcome: pb.Outcome,
        later: Callable[[pb.Outcome, Message, int], None] | None,
    ) -> asyncio.Future[None] | None:
        """Publish one forwarded message here, its owner; fill `outcome` (the offset, or why
        not). Returns the commit future to wait on, if any. With `later`, a message for a
        shard this node's view does not yet give it (the sender's epoch is newer) is handed
        to `later` instead."""
        broker, view = self.broker, self.view
        if self.plane.stopping:
            outcome.code = pb.NOT_OWNER
            outcome.reason = f"node {self.node_id} is stopping; retry"
            return None
        try:
            stream = broker.stream_for_topic(message.topic)
            sent_for = message.stream
            if later is not None and sent_for and sent_for != stream.name:
                # the sender routes the topic to a stream this node does not (yet): one created
                # a moment ago whose definition or routes have not landed here. Wait for them
                # (bounded), as for a newer epoch
                later(outcome, message, epoch)
                return None
            shard = stream.shard_for(message.topic, message.key).index
            # Named its leader but its log does not take publishes (leadership coming here, or
            # quiesced to move on): refused like a non-owner's, so that the sender holds it,
            # under the identity it gave it (held here, it would get another one)
            if not self.plane.stores(stream.name, shard):
                assignment = view.leader(stream.name, shard)
                known = assignment.leader_epoch if assignment is not None else 0
                if later is not None and epoch > known:
                    message.stream, message.shard = stream.name, shard
                    later(outcome, message, epoch)
                    return None
                outcome.code = pb.NOT_OWNER
                outcome.epoch = known
                outcome.reason = f"node {self.node_id} does not own {stream.name}/{shard} now; retry"
                return None
            # counted once, by the node its client published to. One sent again after a
            # failover that is stored already (its earlier leader's record replicated here) is
            # acknowledged where it is (`forward_ids.py`, `core/resends.py`): None, its offset set
            future = broker.publish(message, counted=False)
        except PublishRejected as exc:
            outcome.code = pb.NOT_OWNER if isinstance(exc, ShardUnavailable) else pb.REJECTED
            outcome.reason = str(exc)
            return None
        except (CoreError, ValueError) as exc:  # a bad topic, say: this message only
            outcome.code = pb.REJECTED
            outcome.reason = str(exc)
            return None
        outcome.offset = message.offset
        return future
