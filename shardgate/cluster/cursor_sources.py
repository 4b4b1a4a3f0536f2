"""Cursor sources: what a durable cursor here reads for a shard another node owns, and
re-pointing the cursors when ownership moves or pushes were lost.

A shard another node owns is read from what this node received of it (`received.ReceivedLog`,
the pushes, a bounded window) or from its owner's journal (`shard_reader.OwnerLog`, through
`DataPlane.owner_reader`). When the owner leaves, restarts or says it dropped pushes for this
node, the cursors following its shards read its journal again from their positions; when a
reliable shard's ownership moves, its cursors switch between the shard's own log and the
received one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..core.subscriptions import Subscription
from .received import ReceivedLog

if TYPE_CHECKING:
    from ..storage.interfaces import ShardLog
    from .data_plane import DataPlane


class CursorSources:
    """The received logs of the shards other nodes own, and the cursors' re-pointing (one per
    data plane)."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        # Shards other nodes own that a durable subscription here follows.
        self.received: dict[tuple[str, int], ReceivedLog] = {}

    def received_log(self, stream: str, shard: int) -> ReceivedLog:
        key = (stream, shard)
        log = self.received.get(key)
        if log is None:
            log = self.received[key] = ReceivedLog()
        return log

    def owner_log(self, stream: str, shard: int, start: int, filters: Callable[[], Sequence[str]],
                  since_ms: int | None = None) -> ShardLog | None:
        reader = self.plane.owner_reader
        return None if reader is None else reader(stream, shard, start, filters, since_ms)

    def read_owner_again(self, node_id: str) -> None:
        """`node_id` left the view (its lease expired), started a new link session, or said
        it dropped pushes meant for this node: what it stored but did not push here never
        will be, so durable cursors following the pushes of its shards read its journal from
        their positions once it is back (`shard_reader.OwnerLog`), then the pushes again. Its
        reliable shards stay its own meanwhile (their log is on its disk)."""
        from ..core.durable import DurableSubscription

        reader = self.plane.owner_reader
        if reader is None:
            return
        for sub in self.plane.broker.subscriptions.values():
            if not isinstance(sub, DurableSubscription):
                continue
            moved = False
            for (stream, shard), cursor in sub.cursors.items():
                # (an OwnerLog past its hand-off follows the pushes too)
                if not (isinstance(cursor.log, ReceivedLog) or getattr(cursor.log, "remote_shard", False)):
                    continue
                assignment = self.plane.view.leader(stream, shard)
                if assignment is None or assignment.leader != node_id:
                    continue
                cursor.repoint(reader(stream, shard, cursor.position, _filters_of(sub), None),
                               replay=True)
                moved = True
            if moved:
                sub.schedule_pump()

    def repoint_cursors(self) -> None:
        """Durable cursors of reliable shards replay from the shard's own log where this node
        owns the shard, else from what it received of it. Cursors restored at start, before the
        shard map was known, get their log here once it is."""
        from ..core.durable import DurableSubscription

        broker, view = self.plane.broker, self.plane.view
        for sub in broker.subscriptions.values():
            if not isinstance(sub, DurableSubscription):
                continue
            for (stream, shard), cursor in sub.cursors.items():
                if cursor.log is None:
                    continue
                assignment = view.leader(stream, shard)
                if assignment is None:
                    continue
                # (an OwnerLog of cluster.shard_reader also reads a shard another node owns)
                received = isinstance(cursor.log, ReceivedLog) or getattr(cursor.log, "remote_shard", False)
                if assignment.leader != self.plane.node_id and not received:
                    cursor.repoint(self.received_log(stream, shard))
                elif assignment.leader == self.plane.node_id and received:
                    local = broker.streams.get(stream)
                    own = local.shards[shard].log if local is not None and shard < len(local.shards) else None
                    if own:
                        cursor.repoint(own)


def _filters_of(sub: Subscription) -> Callable[[], Sequence[str]]:
    """The topic filters `sub` has when called (they change while a cursor reads)."""
    return lambda: list(sub.filters)
