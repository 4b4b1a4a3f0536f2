"""Cursor sources: what a durable cursor here reads for a shard another node owns, and
re-pointing the cursors when ownership moves or pushes were lost.

A shard another node owns is read from what this node received of it (`received.ReceivedLog`,
the pushes, a bounded window) or from its owner's journal (`shard_reader.OwnerLog`, through
the data plane's `OwnerReads`). When the owner leaves, restarts or says it dropped pushes for this
node, the cursors following its shards read its journal again from their positions; when a
reliable shard's ownership moves, its cursors switch between the shard's own log and the
received one.

When a reliable shard's leader changes (a graceful leave or a drain moved it by copying, a
failover), the cursors here that followed the old leader's pushes read the shard again from
their positions in the new leader's log (their own, where this node leads it now; else the
new leader's journal through `OwnerLog`), then the pushes: the old leader may have stored and
acknowledged a message whose push had not arrived here when the new leader's first messages
did, and a cursor taking those live would pass over it for good (a late push below a cursor's
position counts as delivered). Replay and pushes meet by offset, so nothing comes twice.
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
        # The leader each shard a durable cursor here follows had at the last look (see
        # `repoint_cursors`).
        self._leaders: dict[tuple[str, int], str] = {}

    def received_log(self, stream: str, shard: int) -> ReceivedLog:
        key = (stream, shard)
        log = self.received.get(key)
        if log is None:
            log = self.received[key] = ReceivedLog()
        return log

    def owner_log(self, stream: str, shard: int, start: int, filters: Callable[[], Sequence[str]],
                  since_ms: int | None = None) -> ShardLog | None:
        return self.plane.owner_reads.owner_log(self.plane, stream, shard, start, filters, since_ms)

    def read_owner_again(self, node_id: str) -> None:
        """`node_id` left the view (its lease expired), started a new link session, or said
        it dropped pushes meant for this node: what it stored but did not push here never
        will be, so durable cursors following the pushes of its shards read its journal from
        their positions once it is back (`shard_reader.OwnerLog`), then the pushes again. Its
        reliable shards stay its own meanwhile (their log is on its disk)."""
        from ..core.durable import DurableSubscription

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
                owner = self.owner_log(stream, shard, cursor.position, _filters_of(sub))
                if owner is None:
                    continue  # this node reads no other node's journal
                cursor.repoint(owner, replay=True)
                moved = True
            if moved:
                sub.schedule_pump()

    def repoint_cursors(self) -> None:
        """Durable cursors of reliable shards replay from the shard's own log where this node
        owns the shard, else from what it received of it. Cursors restored at start, before the
        shard map was known, get their log here once it is."""
        from ..core.durable import DurableSubscription

        broker, view = self.plane.broker, self.plane.view
        me = self.plane.node_id
        leaders: dict[tuple[str, int], str] = {}
        for sub in broker.subscriptions.values():
            if not isinstance(sub, DurableSubscription):
                continue
            moved = False
            for (stream, shard), cursor in sub.cursors.items():
                if cursor.log is None:
                    continue
                assignment = view.leader(stream, shard)
                if assignment is None:
                    continue
                leader = leaders[(stream, shard)] = assignment.leader
                before = self._leaders.get((stream, shard), leader)
                # (an OwnerLog of cluster.shard_reader also reads a shard another node owns)
                received = isinstance(cursor.log, ReceivedLog) or getattr(cursor.log, "remote_shard", False)
                owner = None
                if leader != me and (before != leader or not received) and cursor.placed:
                    # the new leader's journal from the position (a cursor over this node's
                    # own log: it led the shard until now): it holds what the old leader stored
                    # (this node included), and what the new one pushed here before this
                    # node's view showed it the leader (None: this node reads no other's)
                    owner = self.owner_log(stream, shard, cursor.position, _filters_of(sub))
                if owner is not None:
                    cursor.repoint(owner, replay=True)
                    moved = True
                elif leader != me and not received:
                    cursor.repoint(self.received_log(stream, shard))
                elif leader == me and received:
                    local = broker.streams.get(stream)
                    own = local.shards[shard].log if local is not None and shard < len(local.shards) else None
                    if own:
                        # from the position on, this node's log holds what the old leader
                        # stored (a copy, or what it fetched as a follower)
                        cursor.repoint(own, replay=True)
                        moved = True
            if moved:
                sub.schedule_pump()
        self._leaders.update(leaders)


def _filters_of(sub: Subscription) -> Callable[[], Sequence[str]]:
    """The topic filters `sub` has when called (they change while a cursor reads)."""
    return lambda: list(sub.filters)
