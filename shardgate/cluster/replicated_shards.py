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
- A new leader hands on what it inherited: the records it holds from an earlier epoch go out
  to subscribers (here and, through the fanout, on other nodes) once its high watermark
  passes them, before anything it stores itself, since nobody may have dispatched them:
  - the old leader's process is gone (its lease ended, or it registered again under a new
    one: a restarted process): from the **dispatched mark** it told this node last
    (`dispatch_marks.py`, with each fetch answer, as the high watermark; a parked fetch is
    answered again as soon as the pushes it waited for were, `_mark`): below it every
    record was dispatched and each push of it answered by the node it went to, so nothing
    there is missing anywhere; above it a push may have died with the process. Nothing is
    lost, and what a live subscriber may get twice is bounded by what the old leader
    dispatched after that mark: the records it dispatched after taking the checkpoint the
    mark came from (at a fetch answer before the last one this node got) and those whose
    pushes it had not seen answered by then: about one fetch round and one push round
    trip's worth, not the whole shard. Where this process was told no mark (it was started
    again since: all the shard's nodes were restarted, or the old leader was this node's own
    earlier run), from the mark kept on disk (`dispatch_checkpoints.py`: the last mark this
    node led with or was told before, written at most `SAVE_INTERVAL_S` apart and at a clean
    stop, read as "at least this far"), so what may come twice is about an interval of the
    shard's traffic; either mark, whichever is further, when both are known. Where neither is
    (a node whose data directory was lost, or a leader that knew none): from up to
    `REDISPATCH_RECORDS` below the high watermark this node knew (below the log end where it
    knew none), the most pushes a peer link holds unanswered;
  - the old leader still runs under the lease it led with (a drain, a graceful leave): from
    the high watermark this node knew. It dispatched what it committed; what it had not
    committed when it stopped leading it never dispatches (`hand_off`: it acknowledges
    those its publishers wait for once this node's high watermark passes them, or refuses
    them), and this node commits it now. At a graceful leave (SIGTERM) that mark is exactly where
    the old leader's dispatching ended: before it announced the leave it stopped taking
    publishes and waited until its in-sync followers knew the high watermark it ends at
    (`quiesce`). A drain does the same per shard before the controller moves it
    (`leader_handoff.py`). Where the old leader could not (the controller stopped waiting
    for its answer) the mark this node knew may lag the old leader's last one, and what
    lies between is dispatched twice;
  - a shard this node held alone before it was given replicas is not handed on: it was
    dispatched here.
  Durable cursors (persistent sessions, durable subscriptions) keep their own position by
  offset: their node answered the pushes below the mark (it holds those records), the
  hand-on brings the rest, and they drop what they already have. A live subscriber may get
  such a message twice (at least once), never miss it.
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
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from ..core.records import decode_to_message
from .dispatch_checkpoints import SAVE_INTERVAL_S, KeptMarks
from .replica_manager import Propose, ReplicaManager
from .replica_rpc import ReplicaService
from .replication import stream_replication

if TYPE_CHECKING:
    from ..core.broker import Broker
    from ..storage.journal import JournalStorage
    from .control import ClusterNode
    from .dispatch_marks import DispatchMarks
    from .peer_link import PeerLink

log = logging.getLogger(__name__)

# How far below the high watermark it knew a new leader dispatches again what it inherited
# when it knows no dispatched mark (none told, none kept on disk): the most pushes a peer link
# holds unanswered (`PUSH_HIGH_WATER`), which the old leader's death may have lost.
REDISPATCH_RECORDS = 10_000
REDISPATCH_BATCH = 2_000
# A leaving leader's wait for its followers to know where it ends (`quiesce`): the part of it
# for what it holds to commit, before the high watermark is frozen where it is
QUIESCE_COMMIT_SHARE = 2 / 3
QUIESCE_POLL_S = 0.01
# While a fetch is parked and pushes of a shard this node leads are on their way, how often it
# looks whether they were answered: then the fetch is answered at once, with the new
# dispatched mark (else the follower learns it at the next append or the long poll's end)
MARK_CHECK_S = 0.005


def inherited_from(previous: tuple[str, int | None] | None, *, node_id: str,
                   registrations: Mapping[str, Any], held_alone: bool, high_watermark: int,
                   log_end: int, dispatched: int | None = None,
                   kept: int | None = None) -> int | None:
    """Where a node that has just begun to lead a shard starts handing on what it inherited
    (None: nothing to hand on; see the module docstring). `previous` is the leader it followed
    and the etcd lease that leader's process led under (None: not known, or `node_id`'s own
    earlier run); `registrations` are the registered nodes (each with its `lease`);
    `high_watermark` is the one this node knew as it took over, `dispatched` the dispatched
    mark its leader told it last (None: none told), `kept` the mark kept on this node's disk
    (`dispatch_checkpoints.py`, one of this log, so at most `log_end`; None: none counts)."""
    if previous is None and held_alone:
        return None  # its records were stored and dispatched here
    if previous is not None:
        leader, lease = previous
        registration = registrations.get(leader)
        if lease is not None and registration is not None and registration.lease == lease:
            # the old leader's process still runs: it dispatched what it committed
            return high_watermark
    # Below either mark, every record was dispatched and each push of it answered (each is a
    # lower bound of that, so the further one is too).
    marks = [mark for mark in (
        min(dispatched, high_watermark) if dispatched is not None and previous is not None
        and previous[0] != node_id else None, kept) if mark is not None]
    if marks:
        return max(marks)
    if previous is None:
        return log_end - REDISPATCH_RECORDS  # nothing known of who stored them
    known = high_watermark if previous[0] != node_id and high_watermark > 0 else log_end
    return known - REDISPATCH_RECORDS


class ReplicatedShards:
    """This node's replicated shards, wired into serve (see the module docstring)."""

    def __init__(self, node: ClusterNode, broker: Broker, journal: JournalStorage, *,
                 lag_time_max_s: float = 10.0, propose: Propose | None = None,
                 links: Mapping[str, PeerLink] | None = None) -> None:
        self.node = node
        self.view = view = node.view
        self.broker = broker
        self.journal = journal
        self.service = ReplicaService(view, self._leading, node.credentials, links=links,
                                      replicated=self._replicated)
        self.manager = ReplicaManager(
            node.node_id, view, journal, self.service.transport,
            min_insync=self._min_insync, lag_time_max_s=lag_time_max_s, propose=propose,
            lease_deadline=lambda: view.lease_valid_until, on_role=self._role_changed,
            hand_off=broker.dispatched_elsewhere)
        self._started = False
        self._led: set[tuple[str, int]] = set()
        # the leader each shard had while this node followed it, and the etcd lease that
        # leader's process led under (None: not known, or an earlier run of this node; see
        # `_take_over`)
        self._followed: dict[tuple[str, int], tuple[str, int | None]] = {}
        # the shards this process held alone (one replica, this node): dispatched here
        self._held_alone: set[tuple[str, int]] = set()
        self._leaving = False  # (`quiesce` of every led shard: `reopen` does nothing then)
        # how far the shards this node leads were dispatched to every node (`track_dispatch`)
        self._marks: DispatchMarks | None = None
        self._mark_checks: set[tuple[str, int]] = set()  # the shards `_check_mark` looks at
        # the marks kept on disk, for a start of this node with nothing in memory (`_keep_marks`)
        self._kept = KeptMarks()
        self._keeper: asyncio.Task[None] | None = None

    def track_dispatch(self, marks: DispatchMarks) -> None:
        """The data plane's dispatched marks (built with its fanout and links, after this):
        the shards this node leads tell their followers how far they were dispatched, and a
        new leader hands on only from what it was told (see the module docstring)."""
        self._marks = marks

    def _leading(self, stream: str, shard: int) -> Any:
        return self.manager.leading(stream, shard)

    def _replicated(self, stream: str, shard: int) -> bool:
        return self.manager.replicated(stream, shard)

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
        self._keeper = asyncio.get_running_loop().create_task(self._keep_marks())

    def sync(self) -> None:
        """Hand the manager every replicated shard of this node, and give the broker the
        right log for each shard the manager knows."""
        if not self._started:
            return
        manager, node_id = self.manager, self.node.node_id
        for stream, shards in list(self.view.placement.items()):
            for index, placed in enumerate(shards):
                if placed.replicas == (node_id,):
                    self._held_alone.add((stream, index))
                elif len(placed.replicas) == 1:
                    self._held_alone.discard((stream, index))
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
            if self._marks is not None:
                self._marks.end(key)
            role = self.manager.role(stream, index)
            if role is not None:
                self._followed[key] = (role.leader, self._leader_lease(stream, index, role.leader))
        elif key not in self._led:
            self._led.add(key)
            self._take_over(stream, index, leading, self._followed.pop(key, None))

    def _leader_lease(self, stream: str, index: int, leader: str) -> int | None:
        """The etcd lease of the process that leads the shard as this node's view shows it
        (None: not known, or an earlier run of this node: placed as leader in an epoch that
        run led, this process waits for a new one)."""
        if leader == self.node.node_id:
            return None
        shards = self.view.placement.get(stream)
        placed = shards[index] if shards is not None and index < len(shards) else None
        if placed is not None and placed.leader == leader and placed.leader_lease:
            return placed.leader_lease
        registration = self.view.registrations.get(leader)
        return registration.lease if registration is not None and registration.lease else None

    def _take_over(self, stream: str, index: int, shard_log: Any,
                   previous: tuple[str, int | None] | None) -> None:
        """This node has just begun to lead the shard (not again in a newer epoch: what
        waited carried over then): hand on what it inherited (see the module docstring)."""
        key = (stream, index)
        start = inherited_from(
            previous, node_id=self.node.node_id, registrations=self.view.registrations,
            held_alone=key in self._held_alone,
            high_watermark=shard_log.high_watermark, log_end=shard_log.next_offset,
            dispatched=shard_log.dispatched_known,
            kept=self._kept.kept(key, shard_log.log))
        marks = self._marks
        if marks is not None:
            marks.begin(key, None if start is None else max(start, shard_log.low_watermark, 0))
            shard_log.dispatch_mark = lambda: self._mark(marks, key, shard_log)
        if start is not None:
            self._hand_on(stream, index, shard_log, start)

    def _mark(self, marks: DispatchMarks, key: tuple[str, int], shard_log: Any) -> int | None:
        """The shard's dispatched mark for a fetch answer. While pushes are on their way, a
        fetch parked here is answered again once they were (eagerly, as Kafka answers a
        parked fetch when the high watermark moves)."""
        mark = marks.mark(key)
        if key not in self._mark_checks and marks.waiting(key):
            self._mark_checks.add(key)
            asyncio.get_running_loop().call_later(
                MARK_CHECK_S, self._check_mark, marks, key, shard_log)
        return mark

    def _check_mark(self, marks: DispatchMarks, key: tuple[str, int], shard_log: Any) -> None:
        # (a fetch not parked finds the mark itself when it comes)
        if shard_log.leader is not None and shard_log.fetch_parked and marks.waiting(key):
            if not marks.ready(key):
                asyncio.get_running_loop().call_later(
                    MARK_CHECK_S, self._check_mark, marks, key, shard_log)
                return
            shard_log.wake_fetches()
        self._mark_checks.discard(key)

    async def _keep_marks(self) -> None:
        """Write the dispatched marks that moved to disk, every `SAVE_INTERVAL_S`."""
        while True:
            await asyncio.sleep(SAVE_INTERVAL_S)
            try:
                self._save_marks()
            except Exception:
                log.exception("cannot keep the dispatched marks on disk")

    def _save_marks(self, *, sync: bool = False) -> None:
        """Keep on disk each replicated shard's dispatched mark as known now, where it moved
        (`dispatch_checkpoints.py`): this node's own while it leads, the one its leader told it
        while it follows (the further, where both are known)."""
        manager, marks = self.manager, self._marks
        for stream, shards in list(self.view.placement.items()):
            local = self.broker.streams.get(stream)
            for index in range(len(shards)):
                if not manager.knows(stream, index):
                    continue
                shard_log = manager.shard_log(stream, index)
                if local is None or index >= len(local.shards) or local.shards[index].log is not shard_log:
                    continue  # (the core's log of it is not this one: no mark of this log)
                key = (stream, index)
                known = [mark for mark in (
                    shard_log.dispatched_known, marks.known(key) if marks is not None else None)
                    if mark is not None]
                if known:
                    self._kept.keep(key, shard_log.log, max(known), sync=sync)

    def _hand_on(self, stream: str, index: int, shard_log: Any, start: int) -> None:
        """Dispatch the records from `start` to the log's end now once this new leader's
        high watermark passes them (see the module docstring). Done in the commit's
        callback, before any message this leader stores itself is dispatched (those wait for
        their own, later, commit): per shard, the subscribers see the offsets in order."""
        end = shard_log.next_offset
        start = max(start, shard_log.low_watermark)
        if start >= end:
            return

        def committed(_waiter: asyncio.Future[None] | None) -> None:
            # Refused or not (the in-sync set may have fallen below the minimum as the mark
            # passed), what is below the high watermark is in the shard for good. Else this
            # leadership ended first, and the next leader hands them on.
            if shard_log.leader is None or shard_log.high_watermark < end:
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

    async def quiesce(self, timeout_s: float, shards: Collection[tuple[str, int]] | None = None,
                      *, why: str = "leaving") -> bool:
        """A graceful leave, before this node announces it (`ClusterNode.leave`), so that the
        controller moves its leaderships to followers that know where its dispatching ended:
        the shards it leads take no more publishes (refused, retryable: their clients send
        them again to the next leader), what they hold commits (for up to two thirds of
        `timeout_s`; then each high watermark stays where it is, what waits is refused and the
        next leader hands it on), and it waits (bounded by `timeout_s`) until every in-sync
        follower said in a fetch that it knows the high watermark this node ends at.
        With `shards`, only those (a drain: `leader_handoff.py`; `reopen` undoes it). Whether
        every in-sync follower said so."""
        if shards is None:
            self._leaving = True
        led = [(stream, index, shard_log) for stream, index in sorted(self._led)
               if (shards is None or (stream, index) in shards)
               and (shard_log := self.manager.leading(stream, index)) is not None]
        if not led:
            return True
        for _stream, _index, shard_log in led:
            shard_log.stop_taking()
        loop = asyncio.get_running_loop()
        began = loop.time()
        freeze_at, deadline = began + timeout_s * QUIESCE_COMMIT_SHARE, began + timeout_s
        marks: dict[tuple[str, int], int] = {}
        while True:
            waiting = [entry for entry in led if not entry[2].handed_over]
            now = loop.time()
            if not waiting or now >= deadline:
                break
            for stream, index, shard_log in waiting:
                if now >= freeze_at and not shard_log.frozen:
                    shard_log.freeze()
                mark = shard_log.high_watermark
                if marks.get((stream, index)) != mark:
                    marks[(stream, index)] = mark
                    shard_log.wake_fetches()  # parked fetches learn the new mark at once
            await asyncio.sleep(QUIESCE_POLL_S)
        frozen = [f"{stream}/{index}" for stream, index, shard_log in led if shard_log.frozen]
        if waiting:
            log.warning("%s: not every in-sync follower of %s said it knows where this "
                        "leader's dispatching ends (if elected, it may dispatch some again)", why,
                        ", ".join(f"{stream}/{index}" for stream, index, _log in waiting))
        log.info("%s: %d led shards stopped taking publishes in %.2f s%s", why, len(led),
                 loop.time() - began,
                 f" ({', '.join(frozen)} with messages not committed)" if frozen else "")
        return not waiting

    def reopen(self, stream: str, index: int, *, leading: bool) -> None:
        """A drain's `quiesce` of the shard is over (the controller moved it, or wants it
        moved no more): its next leadership here takes publishes, and with `leading` (this
        node still leads it in that epoch) so does the present one. Not while this node
        leaves."""
        if not self._leaving and self.manager.knows(stream, index):
            self.manager.shard_log(stream, index).reopen(leading=leading)

    async def close(self) -> None:
        self._started = False
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            try:
                self._save_marks(sync=True)  # a clean stop: the marks as they are last
            except Exception:
                log.exception("cannot keep the dispatched marks on disk")
        await self.manager.close()
        await self.service.close()
