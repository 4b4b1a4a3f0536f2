"""How a published message is stored: appended to its reliable shard's log (one append per
shard and read for a batch), dispatched at once below the log's deliverable end or held in its
commit group until that is durable (in order, behind earlier held ones), and transient
messages kept behind held ones of their shard. Per-message path: kept lean.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..storage.interfaces import StorageError, StorageFull, StorageUnavailable
from .broker_stats import BrokerStats
from .errors import PublishRejected, ShardUnavailable, StoreFull
from .message import Message
from .records import encode_message
from .streams import Shard

log = logging.getLogger("shardgate.core.broker")

# What `publish_many` returns per message: None (stored and dispatched, or held for later), the
# commit future to wait on before acknowledging, or the error that refused the message.
PublishOutcome = asyncio.Future[None] | PublishRejected | None


@dataclass(slots=True, eq=False)
class CommitGroup:
    """Messages appended to one shard's pending commit group, delivered once it is durable."""

    shard: Shard
    first_append: float
    # The messages held until the group is durable (those beyond the log's deliverable end).
    messages: list[Message] = field(default_factory=list)
    # The offset of the last stored message held (transient ones have none).
    last_offset: int = -1


class ShardAppends:
    """The shard appends part of `Broker` (`core/broker.py`), which holds the state."""

    _awaiting_commit: dict[asyncio.Future[None], CommitGroup]
    _held: dict[Shard, int]
    stats: BrokerStats

    if TYPE_CHECKING:  # provided by the other parts of Broker (`core/broker.py`)
        def dispatch(self, message: Message, share_groups: Container[str] | None = None) -> int: ...

        def dispatch_all(self, messages: list[Message]) -> None: ...

    @staticmethod
    def _encodable(
        indices: list[int], group: list[Message], outcomes: list[PublishOutcome]
    ) -> tuple[list[int], list[Message], list[tuple[int, bytes]]]:
        """The messages of `group` that encode as records, with their records; the others
        are refused in `outcomes` (a field the record format cannot hold)."""
        kept_indices: list[int] = []
        kept: list[Message] = []
        records: list[tuple[int, bytes]] = []
        for index, message in zip(indices, group, strict=True):
            try:
                records.append((message.publish_time_ms, encode_message(message)))
            except (ValueError, OverflowError, struct.error) as exc:
                outcomes[index] = PublishRejected(f"the message cannot be stored: {exc}")
                continue
            kept_indices.append(index)
            kept.append(message)
        return kept_indices, kept, records

    def _deliver_transient(self, shard: Shard, message: Message) -> asyncio.Future[None] | None:
        """A transient message that no durable subscription wants: not journaled (so not
        archived either) and without an offset. It is delivered at once (returns None), unless
        the shard's stored messages are being held until their commit: then it waits behind
        them, so that subscribers see the producer's order, and the commit future that
        releases it is returned (the caller learns when it was delivered)."""
        if shard in self._held:
            for waiter, group in reversed(self._awaiting_commit.items()):
                if group.shard is shard and group.messages:
                    group.messages.append(message)
                    return waiter
        self.dispatch(message)
        return None

    def _append_reliable(self, shard: Shard, message: Message) -> asyncio.Future[None] | None:
        shard_log = shard.log
        assert shard_log is not None
        try:
            message.offset = shard_log.append([(message.publish_time_ms, encode_message(message))])
        except StorageUnavailable as exc:
            raise ShardUnavailable(f"the shard cannot take the message now: {exc}") from exc
        except StorageFull as exc:
            raise StoreFull(f"the journal refused the message: {exc}") from exc
        except StorageError as exc:
            raise PublishRejected(f"the journal refused the message: {exc}") from exc
        shard.next_offset = message.offset + 1
        return self._appended(shard, message, shard_log.commit_waiter())

    def _append_group(
        self,
        shard: Shard,
        group: list[Message],
        records: list[tuple[int, bytes]],
        indices: list[int],
        outcomes: list[PublishOutcome],
    ) -> asyncio.Future[None] | None:
        """Append the records of `group` (messages of one shard, in order) with one call; a
        message the journal refuses gets its error in `outcomes`. Returns the commit waiter."""
        shard_log = shard.log
        assert shard_log is not None
        try:
            first = shard_log.append(records)
        except StorageError:
            # The journal takes a batch whole or not at all: offer them one by one, so that
            # what fits is stored and only the rest is refused, as single publishes would be.
            for message, record, index in zip(group, records, indices, strict=True):
                try:
                    message.offset = shard_log.append([record])
                except StorageUnavailable as exc:
                    outcomes[index] = ShardUnavailable(f"the shard cannot take the message now: {exc}")
                except StorageFull as exc:
                    outcomes[index] = StoreFull(f"the journal refused the message: {exc}")
                except StorageError as exc:
                    outcomes[index] = PublishRejected(f"the journal refused the message: {exc}")
                else:
                    shard.next_offset = message.offset + 1
        else:
            for message in group:
                message.offset = first
                first += 1
            shard.next_offset = first
        return shard_log.commit_waiter()

    def _appended_group(
        self,
        shard: Shard,
        group: list[Message],
        waiter: asyncio.Future[None] | None,
        indices: list[int],
        outcomes: list[PublishOutcome],
    ) -> None:
        """`_appended` for each message of `group` (appended to `shard` in order), setting its
        outcome; messages the journal refused (an outcome already) are skipped."""
        if waiter is None:
            for message, index in zip(group, indices, strict=True):
                if outcomes[index] is None:
                    self.dispatch(message)
            return
        commit_group = self._awaiting_commit.get(waiter)
        if commit_group is None:
            commit_group = self._awaiting_commit[waiter] = CommitGroup(shard, time.perf_counter())
            waiter.add_done_callback(self._on_commit)
        shard_log = shard.log
        assert shard_log is not None
        deliverable_end = shard_log.deliverable_end
        held = self._held
        if shard in held:
            self._release_reserved(shard, deliverable_end)
        now: list[Message] = []
        holding = shard in held
        for message, index in zip(group, indices, strict=True):
            if outcomes[index] is not None:
                continue  # refused by the journal
            outcomes[index] = waiter
            if message.offset < deliverable_end and not holding:
                now.append(message)  # see `_appended`
            else:
                if not commit_group.messages:
                    held[shard] = held.get(shard, 0) + 1
                holding = True
                commit_group.messages.append(message)
                commit_group.last_offset = message.offset
        if now:
            self.dispatch_all(now)

    def _appended(
        self, shard: Shard, message: Message, waiter: asyncio.Future[None] | None
    ) -> asyncio.Future[None] | None:
        """Dispatch `message`, just appended to `shard`'s log, now or once its commit group
        (`waiter`) is durable; returns the waiter (None: durable already)."""
        if waiter is None:  # durable already (an engine that writes synchronously)
            self.dispatch(message)
            return None
        group = self._awaiting_commit.get(waiter)
        if group is None:
            group = self._awaiting_commit[waiter] = CommitGroup(shard, time.perf_counter())
            waiter.add_done_callback(self._on_commit)
        shard_log = shard.log
        assert shard_log is not None
        deliverable_end = shard_log.deliverable_end
        if shard in self._held:
            self._release_reserved(shard, deliverable_end)
        if message.offset < deliverable_end and shard not in self._held:
            # Subscribers get it now; the publisher's acknowledgement (the returned future)
            # still waits for durability. The log never gives this offset to another record,
            # so what a subscriber saw is never contradicted, even if this commit fails.
            self.dispatch(message)
        else:
            # Beyond the log's reservation: delivered once durable, in order.
            if not group.messages:
                self._held[shard] = self._held.get(shard, 0) + 1
            group.messages.append(message)
            group.last_offset = message.offset
        return waiter

    def held_offsets(self) -> dict[tuple[str, int], int]:
        """Per (stream, shard), the offset of the first stored message held in a commit group,
        not dispatched live yet. The log's deliverable end may have passed it already: a group
        goes out once all of it is committed (a replicated shard's high watermark moves record
        by record), and only when its commit callback runs, a loop turn after the commit. What
        moves a live cursor up to the deliverable end must stop here, or the cursor passes
        over the message when it comes (`ShardCursor.retention_floor`)."""
        held: dict[tuple[str, int], int] = {}
        if not self._held:
            return held
        for group in self._awaiting_commit.values():
            shard = group.shard
            key = (shard.stream, shard.index)
            if not group.messages or key in held:
                continue  # groups come in append order: the first one holding is the lowest
            for message in group.messages:
                if message.offset >= 0:  # (a transient message held behind has none)
                    held[key] = message.offset
                    break
        return held

    def dispatched_elsewhere(self, waiters: Iterable[asyncio.Future[None]]) -> None:
        """The stored messages held until one of `waiters` commits are not this node's to
        dispatch any more, whatever the commit's outcome: their shard's log stopped leading
        while they waited (a replicated shard's leadership moved), and the node that leads it
        next dispatches every record it holds from there. Their publishers still wait on
        `waiters`; a transient message held behind them still goes out with the commit."""
        held = self._held
        for waiter in waiters:
            group = self._awaiting_commit.get(waiter)
            if group is None or not group.messages:
                continue
            group.messages = [message for message in group.messages if message.offset < 0]
            if group.messages:
                continue
            shard = group.shard
            count = held.get(shard, 0) - 1
            if count > 0:
                held[shard] = count
            else:
                held.pop(shard, None)

    def _release_reserved(self, shard: Shard, deliverable_end: int) -> None:
        """Dispatch now, oldest first, the held messages of `shard` that the log's durable
        reservation has come to cover (all below `deliverable_end`), as if they had been
        appended below it: without this, a shard that had to hold once (a fresh journal's
        first group) would keep holding behind each commit under a steady load."""
        held = self._held
        for group in list(self._awaiting_commit.values()):
            if group.shard is not shard or not group.messages:
                continue
            if group.last_offset >= deliverable_end:
                return  # this one and the later ones still wait, in order
            messages, group.messages = group.messages, []
            count = held.get(shard, 0) - 1
            if count > 0:
                held[shard] = count
            else:
                held.pop(shard, None)
            self.dispatch_all(messages)

    def _on_commit(self, waiter: asyncio.Future[None]) -> None:
        group = self._awaiting_commit.pop(waiter, None)
        if group is None:
            return
        shard = group.shard
        if group.messages:
            held = self._held.get(shard, 0) - 1
            if held > 0:
                self._held[shard] = held
            else:
                self._held.pop(shard, None)
        if not (waiter.cancelled() or waiter.exception() is not None):
            self.stats.commit_latency.observe(time.perf_counter() - group.first_append)
            self.dispatch_all(group.messages)
            if shard in self._held:  # later groups the reservation covers now go out too
                assert shard.log is not None
                self._release_reserved(shard, shard.log.deliverable_end)
            return
        error = "cancelled" if waiter.cancelled() else waiter.exception()
        # a replicated shard whose leadership moved (a graceful move, a failover) refuses what
        # it had not committed with a retryable error: expected, its publishers try again
        retryable = isinstance(error, (ShardUnavailable, StorageUnavailable))
        log.log(logging.WARNING if retryable else logging.ERROR,
                "journal commit %s on %s/%d: %s; %d held messages not delivered",
                "refused (retryable)" if retryable else "failed", shard.stream, shard.index,
                error, len(group.messages))
        # The failed offsets are not handed out again (the log skips them), so what a
        # subscriber already saw is never contradicted; publishers got no acknowledgement.
