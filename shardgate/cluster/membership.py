"""What the data plane may ask of the control plane: who is in the cluster, who leads a shard.

The control plane (etcd: node leases, the controller's placement, leader epochs) implements
`ClusterView`; the data plane (forwarding, route table) only reads it. `StaticClusterView`
is a fixed view for unit tests of the data plane and for a single node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from .placement import ShardPlacement


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A live node: its id, the host:port of its internal (cluster) gRPC listener, the
    instance (data directory identity) that registered it, and the etcd lease its registration
    is under (0: not known; a new lease is a new registration: another process, or the same
    one after its lease ran out). Two infos are equal by id, address and instance."""

    node_id: str
    cluster_address: str
    instance: str = ""
    lease: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class ShardAssignment:
    """The node that leads `stream`/`shard`, under `leader_epoch` (bumped on every change of
    leader), and the shard's replicas and in-sync replicas (both `(leader,)` when not given:
    one replica, as every shard has today)."""

    stream: str
    shard: int
    leader: str
    leader_epoch: int
    replicas: tuple[str, ...] = ()
    isr: tuple[str, ...] = ()
    isr_version: int = 0
    adding: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.replicas:
            object.__setattr__(self, "replicas", (self.leader,))
        if not self.isr:
            object.__setattr__(self, "isr", (self.leader,))

    @classmethod
    def of(cls, stream: str, shard: int, placement: ShardPlacement) -> ShardAssignment:
        return cls(stream, shard, placement.leader, placement.leader_epoch, placement.replicas,
                   placement.isr, placement.isr_version, placement.adding)

    @property
    def placement(self) -> ShardPlacement:
        return ShardPlacement(self.leader, self.replicas, self.isr, self.leader_epoch,
                              self.isr_version, self.adding)


class ClusterView(Protocol):
    """The current, locally cached view of the cluster (kept fresh by etcd watches)."""

    @property
    def node_id(self) -> str: ...

    def nodes(self) -> Mapping[str, NodeInfo]:
        """Live nodes by id (those whose lease is alive), this node included."""
        ...

    def leader(self, stream: str, shard: int) -> ShardAssignment | None:
        """Who leads the shard now, or None while it is unassigned (publishes are refused)."""
        ...

    def leads(self, stream: str, shard: int) -> bool:
        """True when this node leads the shard under the current epoch and its lease is live."""
        ...

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the event loop) after any change of nodes or assignments."""
        ...


@dataclass
class StaticClusterView:
    """A fixed cluster view: every assignment given up front (tests, single node)."""

    node_id: str
    node_infos: dict[str, NodeInfo] = field(default_factory=dict)
    assignments: dict[tuple[str, int], ShardAssignment] = field(default_factory=dict)
    _callbacks: list[Callable[[], None]] = field(default_factory=list)

    def nodes(self) -> Mapping[str, NodeInfo]:
        return self.node_infos

    def leader(self, stream: str, shard: int) -> ShardAssignment | None:
        return self.assignments.get((stream, shard))

    def leads(self, stream: str, shard: int) -> bool:
        assignment = self.assignments.get((stream, shard))
        return assignment is not None and assignment.leader == self.node_id

    def on_change(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def changed(self) -> None:
        for callback in self._callbacks:
            callback()
