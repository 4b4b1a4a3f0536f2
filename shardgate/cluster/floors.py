"""Journal retention that counts durable cursors on other nodes.

On one node, a shard's retention never deletes what a durable cursor still needs (its floor:
the lowest offset not yet acknowledged). In a cluster a reliable shard's journal is on its
owner, while the cursors reading it can be anywhere: a persistent MQTT session or a durable
gRPC subscription held by another node, whose backlog is read from the owner's journal when
it resumes (`shard_reader.OwnerLog`). So every node reports the floors of its durable cursors
on shards other nodes hold (a replicated shard's followers as well as its leader), and every
node counts the reports for the shards it holds:

- each node writes `/shardgate/<cluster>.state/floors/<node id>` = {"stream/shard": floor},
  when it changed, at most every `REPORT_INTERVAL_S`, and at once when cursors came here from
  another node (a session taken over). Not under the node's lease: a dead node's sessions
  still need their backlog when it returns or when they resume elsewhere;
- every node reads all reports every `REFRESH_INTERVAL_S` and gives retention
  (`Persistence.remote_needs`) the lowest floor per shard it holds. Until it has read them once,
  it keeps every shard's journal whole.

A floor only rises while a cursor moves, so a report that is a little old asks to keep more,
never less.

A node that never returns would pin its owners' journals forever, so its floors count for a
bound, `departed_floors_retention_s` (24 h by default, as Kafka expires the committed offsets
of a group gone for `offsets.retention.minutes`): the controller stamps when it first saw a
reporting node out of the view, `/shardgate/<cluster>.state/floors-departed/<node id>` =
{"since_ms": ...} (create-if-absent, so a new controller keeps the first stamp), and deletes
the stamp when that node is live again. Owners ignore the floors of a node out of the view
whose stamp is older than the bound; its report stays in etcd (a node that comes back after
the bound resumes from what the owners still have). `shardgate cluster status` shows the
floors an owner keeps and the departed nodes' reports, ignored or not yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..core.durable import DurableSubscription
from ..core.message import now_ms
from . import keys
from .etcd import EtcdError
from .waits import wait_within

if TYPE_CHECKING:
    from ..core.broker import Broker
    from .control import ClusterNode

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 2.0
REFRESH_INTERVAL_S = 2.0


class CursorFloors:
    """This node's report of its cursors' floors, and every node's reports for the shards
    this node owns (module docstring)."""

    def __init__(self, node: ClusterNode, broker: Broker) -> None:
        self.node = node
        self.broker = broker
        self.prefix = node.settings.prefix.rstrip("/") + ".state/floors/"
        self.departed_prefix = node.settings.prefix.rstrip("/") + ".state/floors-departed/"
        # how long the floors of a node out of the view still count
        self.departed_retention_ms = int(float(node.settings.departed_floors_retention_s) * 1000)
        self._reported: dict[str, int] | None = None
        # every other node's report, by node id
        self._reports: dict[str, dict[str, int]] | None = None
        # nodes out of the view, by node id: since when (ms), as the controller stamped it
        self._departed: dict[str, int] = {}
        self._report_now = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------ this node's cursors
    def local_floors(self) -> dict[str, int]:
        """The lowest floor of this node's durable cursors per reliable shard another node
        holds a replica of ("stream/shard"): its leader, or its followers, which may lead it
        after a failover."""
        view = self.node.view
        me = self.node.node_id
        floors: dict[str, int] = {}
        held = self.broker.held_offsets()
        for sub in list(self.broker.subscriptions.values()):
            if not isinstance(sub, DurableSubscription):
                continue
            for (stream, shard), cursor in sub.cursors.items():
                if cursor.log is None:
                    continue  # a stream kept in memory: no journal to retain
                assignment = view.leader(stream, shard)
                if assignment is None or assignment.replicas == (me,):
                    continue  # its only copy is here: this node's retention counts it
                name = f"{stream}/{shard}"
                floor = cursor.retention_floor(held.get((stream, shard)))
                if floor < floors.get(name, floor + 1):
                    floors[name] = floor
        return floors

    def report_soon(self) -> None:
        """Cursors came here from another node: report them without waiting."""
        self._report_now.set()

    async def report(self) -> bool:
        """Write this node's floors if they changed; whether it wrote."""
        floors = self.local_floors()
        if floors == self._reported:
            return False
        await self.node.state_store.put(self.prefix + self.node.node_id, keys.encode(floors))
        self._reported = floors
        return True

    # ------------------------------------------------------------ the owners' side
    async def refresh(self) -> None:
        kvs, _revision = await self.node.state_store.get_prefix(self.prefix)
        reports: dict[str, dict[str, int]] = {}
        for kv in kvs:
            node_id = kv.key[len(self.prefix):]
            if node_id == self.node.node_id:
                continue
            try:
                reports[node_id] = {str(name): int(floor) for name, floor in keys.decode(kv.value).items()}
            except (ValueError, AttributeError, TypeError):
                log.warning("cluster: ignoring an unreadable cursor report of node %s", node_id)
        stamps, _revision = await self.node.state_store.get_prefix(self.departed_prefix)
        departed: dict[str, int] = {}
        for kv in stamps:
            try:
                departed[kv.key[len(self.departed_prefix):]] = int(keys.decode(kv.value)["since_ms"])
            except (ValueError, KeyError, TypeError):
                departed[kv.key[len(self.departed_prefix):]] = now_ms()  # restamped below
        if self.node.is_controller:
            await self._stamp_departed(reports, departed)
        self._reports, self._departed = reports, departed

    async def _stamp_departed(self, reports: Mapping[str, object], departed: dict[str, int]) -> None:
        """(Controller) stamp when a reporting node was first seen out of the view; remove the
        stamp of a node live again."""
        live = self.node.view.nodes()
        for node_id in reports:
            if node_id not in live and node_id not in departed:
                key, since = self.departed_prefix + node_id, now_ms()
                created, _current = await self.node.state_store.create(key, keys.encode({"since_ms": since}))
                if created:
                    departed[node_id] = since
                    log.info("cluster: node %s left with cursor floors; they count for %.0f s more",
                             node_id, self.departed_retention_ms / 1000)
        for node_id in list(departed):
            if node_id in live or node_id not in reports:
                await self.node.state_store.delete(self.departed_prefix + node_id)
                del departed[node_id]

    def ignored(self, node_id: str) -> bool:
        """Whether `node_id`'s floors no longer count: out of the view for longer than the bound."""
        since = self._departed.get(node_id)
        return (since is not None and node_id not in self.node.view.nodes()
                and now_ms() - since >= self.departed_retention_ms)

    def remote_needs(self) -> Mapping[tuple[str, int], int]:
        """For retention: per shard this node holds a replica of (its leader or a follower:
        either may lead it after a failover), the lowest offset another node's cursor still
        needs; before the reports were read once, every shard's current start."""
        reports = self._reports
        needs: dict[tuple[str, int], int] = {}
        if reports is None:
            for broker_stream in self.broker.streams.values():
                for shard in broker_stream.shards:
                    if shard.log is not None:
                        needs[(broker_stream.name, shard.index)] = shard.log.low_watermark
            return needs
        view = self.node.view
        for node_id, floors in reports.items():
            if self.ignored(node_id):
                continue
            for name, floor in floors.items():
                stream, _, index = name.rpartition("/")
                if not index.isdigit():
                    continue
                assignment = view.leader(stream, int(index))
                if assignment is None or self.node.node_id not in assignment.replicas:
                    continue
                key = (stream, int(index))
                if floor < needs.get(key, floor + 1):
                    needs[key] = floor
        return needs

    def status(self) -> dict[str, int]:
        """The remote floors of the shards this node owns ("stream/shard": offset)."""
        if self._reports is None:
            return {}
        return {f"{stream}/{shard}": floor for (stream, shard), floor in sorted(self.remote_needs().items())}

    def departed_status(self) -> dict[str, dict[str, object]]:
        """The reports of nodes out of the view that ask to keep something: since when, whether
        they are ignored yet, and when they will be, and their floors."""
        reports = self._reports or {}
        live = self.node.view.nodes()
        status: dict[str, dict[str, object]] = {}
        for node_id, floors in sorted(reports.items()):
            if node_id in live or not floors:
                continue
            since = self._departed.get(node_id)
            status[node_id] = {
                "departed_ms": since, "ignored": self.ignored(node_id),
                "ignored_from_ms": None if since is None else since + self.departed_retention_ms,
                "floors": dict(sorted(floors.items())),
            }
        return status

    # ------------------------------------------------------------ loops
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._report_loop(), name="cluster-floor-report"),
                       loop.create_task(self._refresh_loop(), name="cluster-floor-refresh")]

    async def _report_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await wait_within(self._report_now.wait(), REPORT_INTERVAL_S)
            self._report_now.clear()
            try:
                await self.report()
            except EtcdError as exc:
                log.warning("cluster: cannot report cursor floors to etcd yet: %s", exc)

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except EtcdError as exc:
                log.warning("cluster: cannot read other nodes' cursor floors yet: %s", exc)
            await asyncio.sleep(REFRESH_INTERVAL_S)

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(EtcdError, TimeoutError):
            await wait_within(self.report(), 2.0)  # the last floors, before the lease ends
