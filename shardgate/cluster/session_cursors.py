"""Cursors that move between nodes: taking them off a durable subscription (`cursor_state`,
`snapshot.cursor_entries`) and putting them on one here (`CursorPlacer`), over this node's
journal for the shards it leads and over the leader's (`shard_reader.OwnerLog`) for the
others. Used by the MQTT session handover and by durable subscriptions alike; also places,
once the node has joined, the cursors this node restored from its own store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..core.durable import DurableSubscription
from ..core.message import Message, now_ms
from ..protocols.mqtt.snapshot import CarriedMessage, CursorState, SessionSnapshot
from ..protocols.mqtt.snapshotting import carried_by_place, cursor_entries
from .shard_reader import OwnerLog
from .state_rpc import StateRpc

if TYPE_CHECKING:
    from ..core.broker import Broker
    from .control import ClusterNode
    from .data_plane import DataPlane

log = logging.getLogger(__name__)

# A cursor the old node did not have for a shard starts this long before the snapshot: that
# node had received no matching message of the shard, so nothing there is delivered twice.
NO_CURSOR_MARGIN_MS = 5_000
# Streams every node keeps for itself (its $SYS topics): never handed over.
LOCAL_STREAMS = frozenset({"sys"})


def _unreadable(entry: Any, exc: Exception) -> None:
    log.warning("cluster: a handed-over message of %s/%d@%d is unreadable: %s", entry.stream,
                entry.shard, entry.offset, exc)


def cursor_state(sub: DurableSubscription) -> tuple[list[list[Any]], list[list[Any]]]:
    """A durable subscription's cursors ([stream, shard, position, unacked offsets]) and the
    unacknowledged messages themselves ([stream, shard, offset, record]), for another node:
    the layout of a durable subscription's record in etcd (`durables.py`)."""
    cursors, messages = cursor_entries(sub)
    return ([[c.stream, c.shard, c.position, c.unacked] for c in cursors],
            [[m.stream, m.shard, m.offset, m.record] for m in messages])


def placed_from(cursors: Sequence[Any], messages: Sequence[Any]) -> tuple[
        list[CursorState], list[CarriedMessage]]:
    """`cursor_state`'s lists read back (for `CursorPlacer.place`)."""
    return ([CursorState.decode(entry, 1) for entry in cursors],
            [CarriedMessage.decode(entry, 1) for entry in messages])


class CursorPlacer:
    """Puts cursors that come from another node on a durable subscription here: over this
    node's journal for the shards it owns, over the owner's (`OwnerLog`) for the others."""

    def __init__(self, node: ClusterNode, broker: Broker, plane: DataPlane, rpc: StateRpc) -> None:
        self.node = node
        self.broker = broker
        self.plane = plane
        self.rpc = rpc
        # Restored cursors still waiting for the shard map to name their shard's owner.
        self._unplaced_left = False

    def place(self, sub: DurableSubscription, cursors: Sequence[CursorState],
              messages: Sequence[CarriedMessage], taken_ms: int) -> dict[tuple[str, int, int], Message]:
        """Place every cursor of a snapshot (before the subscription's filters are added, so
        that every push they bring is kept); shards the snapshot has no cursor for start a
        little before it was taken. Returns the handed-over messages by (stream, shard, offset)."""
        broker = self.broker
        found = carried_by_place(messages, _unreadable)
        placed: set[tuple[str, int]] = set()
        for cursor in cursors:
            stream, shard = cursor.stream, cursor.shard
            carried = found.get((stream, shard), ())
            # unacknowledged offsets whose messages are not carried (an AMQP queue's state) are
            # read back from the shard: another owner's log is read from the lowest of them
            carried_offsets = {message.offset for message in carried}
            start = min([cursor.position, *(offset for offset in cursor.unacked
                                            if offset not in carried_offsets)])
            shard_log = self._log_for(sub, stream, shard, start)
            if shard_log is None and stream not in broker.streams:
                continue
            sub.place_cursor(stream, shard, shard_log, cursor.position, cursor.unacked, carried)
            placed.add((stream, shard))
        since = taken_ms - NO_CURSOR_MARGIN_MS
        for broker_stream in broker.streams.values():
            for shard_entry in broker_stream.shards:
                key = (broker_stream.name, shard_entry.index)
                if key in placed or shard_entry.log is None or broker_stream.name in LOCAL_STREAMS:
                    continue
                shard_log = self._log_for(sub, broker_stream.name, shard_entry.index, None, since)
                if shard_log is not None:
                    start = 0 if isinstance(shard_log, OwnerLog) else shard_log.offset_for_timestamp(since)
                    sub.place_cursor(broker_stream.name, shard_entry.index, shard_log, start)
        if self.node.floors is not None:
            self.node.floors.report_soon()  # the owners keep what these cursors still need
        return {(m.stream, m.shard, m.offset): m for listed in found.values() for m in listed}

    def place_snapshot(self, sub: DurableSubscription,
                       snapshot: SessionSnapshot) -> dict[tuple[str, int, int], Message]:
        """`place` for an MQTT session's snapshot (`snapshot.rebuild`'s `place`)."""
        return self.place(sub, snapshot.cursors, snapshot.messages, snapshot.taken_ms or now_ms())

    def replay_restored(self) -> int:
        """Once the node has joined (the shard map is known): place the durable cursors this
        node restored from its own store, which waited unplaced until now (neither replaying
        nor taking pushes: `Broker.restored_cursors_wait`). On shards this node owns they
        continue over its journal; on shards another node owns they continue from that owner's
        journal at their saved floor (what was pushed here before the restart went with the
        process), then on the pushes, so unacknowledged messages come again. A cursor whose
        shard has no owner yet is placed when the shard map names one. Returns how many were
        placed on other owners' journals."""
        self.broker.restored_cursors_placed()
        count = self._place_waiting()
        if count:
            log.info("cluster: %d restored cursors replay from their shards' owners", count)
        if self._unplaced_left:
            self.node.view.on_change(self._place_when_owned)
        return count

    def _place_when_owned(self) -> None:
        if self._unplaced_left:
            self._place_waiting()

    def _waiting(self) -> list[tuple[DurableSubscription, Any]]:
        return [
            (sub, cursor)
            for sub in list(self.broker.subscriptions.values()) if isinstance(sub, DurableSubscription)
            for cursor in sub.unplaced_cursors()
        ]

    def _place_waiting(self) -> int:
        me = self.node.node_id
        count = 0
        self._unplaced_left = False
        for sub, cursor in self._waiting():
            stream, shard = cursor.stream, cursor.shard
            assignment = self.node.view.leader(stream, shard)
            if assignment is None:
                self._unplaced_left = True  # placed when the shard map names its owner
                continue
            if assignment.leader == me:
                sub.place_restored(cursor, None)
                continue
            sub.place_restored(cursor, self._owner_log(sub, stream, shard))
            count += 1
        return count

    def _owner_log(self, sub: DurableSubscription, stream: str, shard: int) -> Callable[[int], Any]:
        def read_from(start: int) -> Any:
            return OwnerLog(self.rpc, self.plane, stream, shard, start, self._filters_of(sub))
        return read_from

    @staticmethod
    def _filters_of(sub: DurableSubscription) -> Callable[[], list[str]]:
        return lambda: list(sub.filters)

    def _log_for(self, sub: DurableSubscription, stream: str, shard: int, position: int | None,
                 since_ms: int | None = None) -> Any:
        broker_stream = self.broker.streams.get(stream)
        if broker_stream is None or shard >= len(broker_stream.shards):
            return None
        local = broker_stream.shards[shard].log
        if local is None:
            return None
        assignment = self.node.view.leader(stream, shard)
        if assignment is None or assignment.leader == self.node.node_id:
            return local
        return OwnerLog(self.rpc, self.plane, stream, shard, position or 0,
                        lambda: list(sub.filters), since_ms)
