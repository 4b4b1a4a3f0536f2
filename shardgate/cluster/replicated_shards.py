"""Replicated reliable shards in `shardgate serve`: joins the `ReplicaManager` to the broker,
the cluster view and the peer link (`attach.join` builds one per node).

- Which shards: every shard whose placement names several replicas, this node among them,
  is handed to the manager (`watch`) as the view shows it; the manager keeps its role
  (leader, follower) in step with the placement.
- What the core sees: for such a shard the broker's `Shard.log` is the manager's
  `ReplicatedShardLog` (over the same journal log), so a publish stored here is acknowledged
  once the high watermark passes it, refused (`ShardUnavailable`, retryable) while this node
  cannot lead it or fewer than `min_insync_replicas` replicas are in sync, and local readers
  (durable cursors, live dispatch) see only what is below the high watermark. A shard back to
  one replica gets its plain journal log again.
- The peer link: `ReplicaService` answers followers' fetches for the shards this node leads
  and carries this node's own fetches, on the data plane's peer links (`links`; without
  them, as gRPC calls on the cluster port), authenticated as everything there.
- A new leader whose predecessor is gone (its lease expired) hands on what it inherited: the records it holds from its time as a follower
  go out to subscribers (here and, through the fanout, on other nodes) once its high
  watermark passes them, from up to `REDISPATCH_RECORDS` below the high watermark it knew,
  since the old leader may have died before its pushes of them arrived (durable cursors drop
  what they already have; a live subscriber may get such a message twice: at least once).
- The archive: a replicated shard is archived by its leader only, from below the high
  watermark (`archived_log`, the archiver's reader in cluster mode).
- Fencing: a leader acknowledges only while this node's etcd lease is known alive
  (`lease_valid_until`, renewed by the keepalive).
- The in-sync set: the leaders' proposals go to `propose` (`ClusterNode.propose_isr`: the
  controller writes them); with none, a lagging follower would stay in the set and hold the
  high watermark back (safe, not available).

It never writes etcd itself and touches no protocol.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..core.records import decode_to_message
from .replica_manager import Propose, ReplicaManager
from .replica_rpc import ReplicaService
from .replication import stream_replication

if TYPE_CHECKING:
    from ..core.broker import Broker
    from ..storage.journal import JournalStorage
    from .control import ClusterNode
    from .peer_link import PeerLink

log = logging.getLogger(__name__)

# How far below the high watermark it knew a new leader dispatches again what it inherited:
# the most pushes a peer link holds unanswered (`PUSH_HIGH_WATER`), which the old leader's
# death may have lost.
REDISPATCH_RECORDS = 10_000
REDISPATCH_BATCH = 2_000


class ReplicatedShards:
    """This node's replicated shards, wired into serve (see the module docstring)."""

    def __init__(self, node: ClusterNode, broker: Broker, journal: JournalStorage, *,
                 lag_time_max_s: float = 10.0, propose: Propose | None = None,
                 links: Mapping[str, PeerLink] | None = None) -> None:
        self.node = node
        self.view = view = node.view
        self.broker = broker
        self.journal = journal
        self.service = ReplicaService(view, self._leading, node.credentials, links=links)
        self.manager = ReplicaManager(
            node.node_id, view, journal, self.service.transport,
            min_insync=self._min_insync, lag_time_max_s=lag_time_max_s, propose=propose,
            lease_deadline=lambda: view.lease_valid_until, on_role=self._role_changed)
        self._started = False
        self._led: set[tuple[str, int]] = set()
        # the leader each shard had while this node followed it (see `_role_changed`)
        self._followed: dict[tuple[str, int], str] = {}

    def _leading(self, stream: str, shard: int) -> Any:
        return self.manager.leading(stream, shard)

    def leading_figures(self, stream: str, shard: int) -> Any:
        """The shard's leadership here (high watermark, log end, lag), for cluster status and
        the metrics (`replica_status.Leading`); None where this node does not lead it."""
        shard_log = self.manager.leading(stream, shard)
        return shard_log.leader if shard_log is not None else None

    def archived_log(self, stream: str, shard: int) -> Any:
        """What the archiver reads of a shard: a replicated one only where this node leads it
        (below the high watermark; None elsewhere), any other the journal's log."""
        if self.manager.replicated(stream, shard):
            return self.manager.leading(stream, shard)
        return self.journal.open_shard(stream, shard)

    def _min_insync(self, stream: str) -> int:
        return stream_replication(self.view.streams.get(stream, {}),
                                  self.node.settings.replication_defaults).min_insync

    def start(self) -> None:
        self._started = True
        self.manager.start()
        self.view.on_change(self.sync)
        self.sync()

    def sync(self) -> None:
        """Hand the manager every replicated shard of this node, and give the broker the
        right log for each shard the manager knows."""
        if not self._started:
            return
        manager, node_id = self.manager, self.node.node_id
        for stream, shards in list(self.view.placement.items()):
            for index, placed in enumerate(shards):
                if manager.knows(stream, index):
                    continue
                if len(placed.replicas) > 1 and node_id in placed.replicas:
                    try:
                        manager.watch(stream, index)
                    except Exception:
                        log.exception("%s/%d: cannot open the replicated shard's log", stream, index)
        for stream, shards in list(self.view.placement.items()):
            for index in range(len(shards)):
                if manager.knows(stream, index):
                    self._install(stream, index)

    def _install(self, stream: str, index: int) -> None:
        """The broker's log of one shard: the replicated log while the placement makes this
        node one of several replicas, else the plain journal log."""
        local = self.broker.streams.get(stream)
        if local is None or index >= len(local.shards) or local.shards[index].log is None:
            return
        replicated = self.manager.shard_log(stream, index)
        target: Any = replicated if self.manager.replicated(stream, index) else replicated.log
        if local.shards[index].log is not target:
            self.broker.swap_shard_log(stream, index, target)

    def _role_changed(self, stream: str, index: int) -> None:
        self._install(stream, index)
        local = self.broker.streams.get(stream)
        if local is not None and index < len(local.shards):
            shard_log = local.shards[index].log
            if shard_log is not None:  # its end moved while this node followed
                self.broker.swap_shard_log(stream, index, shard_log)
        key = (stream, index)
        leading = self.manager.leading(stream, index)
        if leading is None:
            self._led.discard(key)
            role = self.manager.role(stream, index)
            if role is not None:
                self._followed[key] = role.leader
        elif key not in self._led:
            self._led.add(key)
            previous = self._followed.pop(key, None)
            # Only a leader that is gone may have died before its pushes arrived. One that still
            # holds its lease handed leadership over (a drain, a graceful leave) after pushing
            # what it stored, and a shard this node already held alone (now given replicas)
            # was dispatched here: handing those on again would repeat them to live subscribers.
            if previous is not None and previous not in self.view.registrations:
                self._hand_on(stream, index, leading)

    def _hand_on(self, stream: str, index: int, shard_log: Any) -> None:
        """Dispatch what this new leader inherited once its high watermark passes it (see
        the module docstring). Done in the commit's callback, before any message this leader
        stores itself is dispatched (those wait for their own, later, commit): per shard, the
        subscribers see the offsets in order."""
        end = shard_log.next_offset
        start = max(shard_log.low_watermark, shard_log.high_watermark - REDISPATCH_RECORDS)
        if start >= end:
            return
        leader = shard_log.leader

        def committed(waiter: asyncio.Future[None] | None) -> None:
            if waiter is not None and (waiter.cancelled() or waiter.exception() is not None):
                return  # this leadership ended first: the next leader hands them on
            if shard_log.leader is not leader:
                return
            count = 0
            offset = start
            while offset < end:
                records = shard_log.read(offset, min(REDISPATCH_BATCH, end - offset))
                if not records:
                    break
                for record in records:
                    if record.data:  # an empty record holds a skipped offset
                        self.broker.dispatch(decode_to_message(
                            bytes(record.data), stream, index, record.offset))
                        count += 1
                offset = records[-1].offset + 1
            log.info("%s/%d: new leader, dispatched %d inherited messages (offsets %d to %d)",
                     stream, index, count, start, end - 1)

        waiter = shard_log.commit_waiter()
        if waiter is None:
            committed(None)
        else:
            waiter.add_done_callback(committed)

    async def close(self) -> None:
        self._started = False
        await self.manager.close()
        await self.service.close()
