"""The controller: election, and the placement every stream's shards should have.

The first node to create `controller` under its lease is the controller until its lease ends
(then the others campaign again). Only the controller writes placement: at every pass (a
watch event, or every second) it computes the placement (`desired_placement`, from the
cached view alone) and writes what changed in one `PlacementChange`, which the store compares
on its election and on the `placement-guard` revision it last saw, so a deposed controller's
write, or one made from a stale view, fails.

Shards of streams with one replica are placed by `placement.place()`; shards of replicated
streams (and reliable shards with a replica on a draining node, moved by copying) by
`replica_placement.ReplicaPlacer`: replicas for new shards, a new leader from the in-sync set
when one dies (a new epoch), the in-sync set changes leaders propose (`isr/<stream>/<shard>`,
deleted in the same transaction), and the drain of the nodes named under `drain/` or leaving.
Before a drain moves a live leader's leadership away, the controller asks that leader to
quiesce the shard (`quiesce/<stream>/<shard>`, under the controller's lease) and moves it once
the leader answered (`quiesced/...`, `leader_handoff.py`) or a bound passed
(`replica_placement.QUIESCE_WAIT_S`); a request no longer wanted is deleted.

The decisions here read the view and decide; every etcd write is `control_store.py`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace

from .control_store import AnsweredProposal, ControlStore, PlacementChange
from .etcd_view import EtcdClusterView
from .keys import NodeRegistration
from .placement import ShardPlacement, place
from .replica_placement import Nodes, ReplicaPlacer, ReplicatedSpec
from .replication import DEFAULTS, Replication, stream_replication
from .settings import ClusterSettings

log = logging.getLogger(__name__)

# a warning every this many placement writes refused in a row (passes run about every second)
REFUSED_WARN_EVERY = 30


def replica_nodes(view: EtcdClusterView, draining: set[str]) -> list[str]:
    """The live nodes that may receive replicas: they run the replication data path and are
    neither leaving nor draining."""
    return [node for node, reg in view.registrations.items()
            if reg.replication and node not in draining]


def _with_leader_lease(placed: ShardPlacement, before: ShardPlacement | None,
                       registrations: Mapping[str, NodeRegistration]) -> ShardPlacement:
    """`placed` with the lease its leader was named under: the one it had when the leader
    and epoch stay, else the leader's lease now."""
    if before is not None and (before.leader, before.leader_epoch) == (placed.leader, placed.leader_epoch):
        lease = before.leader_lease
    else:
        registration = registrations.get(placed.leader)
        lease = registration.lease if registration is not None else 0
    return placed if placed.leader_lease == lease else replace(placed, leader_lease=lease)


def desired_placement(view: EtcdClusterView, placer: ReplicaPlacer, leases_seen: dict[str, int],
                      now: float, defaults: Replication = DEFAULTS,
                      ) -> tuple[dict[str, list[ShardPlacement]], dict[str, int]]:
    """The placement every stream should have, and the leases of the nodes it was made for
    (the controller remembers them, as `leases_seen`, once it is written: a node seen under
    another lease since registered again). A stream without replica settings gets
    `defaults` (`[cluster] default_replicas`, `default_min_insync_replicas`)."""
    current = {
        (stream, index): placed
        for stream, shards in view.placement.items()
        for index, placed in enumerate(shards)
    }
    registrations = view.registrations
    draining = {node for node in view.draining if node in registrations}
    draining |= {node for node, reg in registrations.items() if reg.leaving}
    live = [node for node in registrations if node not in draining]
    load = {node: reg.load for node, reg in registrations.items()}
    released = set()
    for node, registration in registrations.items():
        if registration.leaving:
            for name in registration.released:
                stream, _, index = name.rpartition("/")
                if index.isdigit() and current.get((stream, int(index)), None) is not None \
                        and current[(stream, int(index))].leader == node:
                    released.add((stream, int(index)))
    # shards of replicated streams, and reliable shards with a replica on a draining node
    # (moved by copying), are the replica placer's; the others `place()`'s
    settings = {name: stream_replication(definition, defaults)
                for name, definition in view.streams.items()}
    replicated: list[ReplicatedSpec] = []
    specs = view.shard_specs()
    for spec in specs:
        key = (spec.stream, spec.shard)
        placed = current.get(key)
        wanted = settings[spec.stream].replicas
        if spec.reliable and key not in released and (
                (wanted > 1 and (placed is not None or replica_nodes(view, draining)))
                or (placed is not None and (len(placed.replicas) > 1
                                            or any(r in draining for r in placed.replicas)))):
            replicated.append(ReplicatedSpec(spec.stream, spec.shard, wanted))
    # `place()` sees every shard (its balance counts them all); the replica placer's
    # decisions then replace its own for the replicated ones
    placed_now = place(specs, current, live, load, released)
    # the lease each node is registered under; -1 for a leader seen dead, so that its
    # return counts as registering again even for a controller that never saw its lease
    leases = {placed.leader: -1 for placed in current.values()
              if placed.leader not in registrations}
    leases.update((node, reg.lease) for node, reg in registrations.items())
    rejoined = {node for node, lease in leases.items()
                if node in leases_seen and leases_seen[node] != lease}
    # a leader registered under another lease than the one it was named under (a controller
    # that took over after the node restarted never saw its old lease)
    rejoined.update(placed.leader for placed in current.values()
                    if placed.leader_lease and placed.leader in registrations
                    and registrations[placed.leader].lease != placed.leader_lease)
    nodes = Nodes(
        alive=frozenset(registrations), placeable=frozenset(replica_nodes(view, draining)),
        rejoined=frozenset(rejoined), draining=frozenset(draining),
        leaving=frozenset(node for node, reg in registrations.items() if reg.leaving),
        # answers to the requests as they stand (not to one withdrawn and made again since)
        quiesced={key: answer[:2] for key, answer in view.quiesced.items()
                  if view.quiesce_requests.get(key) == answer})
    proposals = {key: proposal for key, (proposal, _) in view.proposals.items()}
    for key, placed in placer.place(replicated, current, nodes, now, proposals).items():
        placed_now[key] = _with_leader_lease(placed, current.get(key), registrations)
    desired: dict[str, list[ShardPlacement]] = {}
    for name, definition in view.streams.items():
        shards = [placed_now.get((name, index)) for index in range(int(definition.get("partitions", 1)))]
        if all(shard is not None for shard in shards):
            desired[name] = shards  # type: ignore[assignment]
    return desired, leases


def placement_change(view: EtcdClusterView, node_id: str,
                     desired: dict[str, list[ShardPlacement]]) -> PlacementChange:
    """What the controller writes to bring etcd from the view's placement to `desired`: the
    streams that changed, the streams gone, and every in-sync set proposal read (answered:
    applied in `desired`, or refused), compared on the view's election and guard."""
    return PlacementChange(
        controller=node_id, controller_revision=view.controller_revision,
        guard_revision=view.guard_revision,
        put={name: shards for name, shards in sorted(desired.items())
             if view.placement.get(name) != shards},
        removed=sorted(view.placement.keys() - view.streams.keys()),
        answered=[AnsweredProposal(stream, index, revision)
                  for (stream, index), (_, revision) in sorted(view.proposals.items())])


def movable_led(view: EtcdClusterView, node_id: str, replication: bool) -> list[tuple[str, int]]:
    """The shards `node_id` leads that the controller moves off it while it leaves:
    non-reliable ones, the empty reliable ones it released, replicated ones (leadership goes
    to an in-sync replica) and, where `replication` (the leaving node runs the replication
    data path) and another live node does too, the reliable ones holding messages: the
    controller copies each to that node (`replica_placement._drain`) and moves it only once
    the copy is in sync, so a graceful leave moves its data rather than leaving the shard
    unavailable until it is back."""
    copied = replication and any(
        registration.replication and not registration.leaving and node not in view.draining
        for node, registration in view.registrations.items() if node != node_id)
    owned = []
    for spec in view.shard_specs():
        assignment = view.leader(spec.stream, spec.shard)
        if assignment is None or assignment.leader != node_id:
            continue
        if (not spec.reliable or copied or (spec.stream, spec.shard) in view.released
                or len(assignment.isr) > 1):
            owned.append((spec.stream, spec.shard))
    return owned


class Controller:
    """This node's part in the election, and, while it is the controller, the placement
    writes (`step`, once per pass of the node's control loop)."""

    def __init__(self, store: ControlStore, view: EtcdClusterView, node_id: str,
                 settings: ClusterSettings) -> None:
        self.store = store
        self.view = view
        self.node_id = node_id
        # the replica placement's state (since when a shard lacks a replica), and the lease
        # of each node's registration last written for (`replica_placement.Nodes.rejoined`)
        self.replica_placer = ReplicaPlacer(settings.re_replicate_after_s,
                                            settings.unclean_leader_election)
        self.leases_seen: dict[str, int] = {}
        self.replication_defaults = settings.replication_defaults
        # the quiesce requests this controller wrote (`replica_placement.ReplicaPlacer.quiesce_wanted`),
        # under the lease it held then (they go with it)
        self.quiesce_asked: dict[tuple[str, int], tuple[str, int]] = {}
        self._quiesce_lease = 0
        # placement writes refused in a row (a few are a lagging watch; many, a stuck view)
        self.refused = 0

    @property
    def elected(self) -> bool:
        """This node is the controller (and its lease is known alive)."""
        return self.view.controller_id == self.node_id and self.view.lease_alive()

    async def step(self, lease: int) -> None:
        """Campaign while there is no controller; as the controller, write the placement."""
        if not self.view.lease_alive():
            return
        if self.view.controller_id is None:
            await self.campaign(lease)
        if self.elected:
            await self.write_placement()
            if self.elected:
                await self.ask_quiesce(lease)

    async def campaign(self, lease: int) -> None:
        elected = await self.store.campaign(self.node_id, lease)
        if elected is not None:
            self.view.controller_id = self.node_id
            self.view.controller_revision = elected
            log.info("cluster: node %s is the controller", self.node_id)

    def desired(self) -> tuple[dict[str, list[ShardPlacement]], dict[str, int]]:
        return desired_placement(self.view, self.replica_placer, self.leases_seen,
                                 time.monotonic(), self.replication_defaults)

    async def write_placement(self) -> None:
        view = self.view
        desired, leases = self.desired()
        change = placement_change(view, self.node_id, desired)
        written = await self.store.write_placement(change)
        for answered in written.answered:
            key = (answered.stream, answered.shard)
            if key in view.proposals and view.proposals[key][1] == answered.revision:
                del view.proposals[key]
        if not written.complete:
            # The view was stale or another controller won: the watch catches up. The view's
            # guard stays the one the watch last brought, with the placement it came with:
            # not the one this pass read, which the watch may have moved past meanwhile (its
            # events of this controller's own earlier writes come late), and which no later
            # event would correct: every pass would be refused for good.
            self.refused += 1
            if self.refused % REFUSED_WARN_EVERY == 0:
                log.warning("cluster: %d placement writes in a row refused (the view's guard "
                            "at revision %d, etcd's moved on)", self.refused, view.guard_revision)
            return
        self.refused = 0
        self.leases_seen.update(leases)
        if written.guard_revision < view.guard_revision:
            return  # the watch already brought a later placement write, with its guard
        view.guard_revision = written.guard_revision
        if change.put or change.removed:
            for name, shards in desired.items():
                view.placement[name] = shards
            for name in list(view.placement.keys() - view.streams.keys()):
                del view.placement[name]
            log.info("cluster: placement written (%d streams changed)",
                     len(change.put) + len(change.removed))

    async def ask_quiesce(self, lease: int) -> None:
        """Keep in etcd the requests that live leaders quiesce the shards a drain moves off
        them (what the last placement pass wanted), and no others. Raises EtcdError."""
        view = self.view
        wanted = self.replica_placer.quiesce_wanted
        if lease != self._quiesce_lease:
            self.quiesce_asked.clear()
            self._quiesce_lease = lease
        removed = sorted((view.quiesce_requests.keys() | self.quiesce_asked.keys()) - wanted.keys())
        put = {key: asked for key, asked in sorted(wanted.items())
               if self.quiesce_asked.get(key) != asked}
        if not put and not removed:
            return
        if not await self.store.write_quiesce_requests(view.controller_revision, put, removed,
                                                       lease):
            return  # another controller won: the watch catches up
        for key in removed:
            self.quiesce_asked.pop(key, None)
        self.quiesce_asked.update(put)
        for (stream, shard), (leader, epoch) in put.items():
            log.info("cluster: asked %s to quiesce %s/%d (epoch %d) before it is moved",
                     leader, stream, shard, epoch)
