"""What the data plane (`data_plane.DataPlane`) is given at construction besides the broker and
the view: three small ports, each a typing Protocol with the implementation a plane alone
uses (in-process tests, a node before its parts exist), so that nothing is set on the plane
afterwards.

| port | implemented by | the plane alone |
|---|---|---|
| `OwnerReads` | `shard_reader.OwnerLogs` (shared-state calls) | reads no other node's journal |
| `ReplicaRequests` | `replica_rpc.ReplicaService` | refuses every request: leads nothing |
| `PeerWatch` | `control.ClusterNode` (ends the dead peer's lease) | does nothing |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from ..proto import cluster_pb2 as pb

if TYPE_CHECKING:
    from ..storage.interfaces import ShardLog
    from .data_plane import DataPlane
    from .membership import NodeInfo


class OwnerReads(Protocol):
    """Reads a shard another node owns from its owner's journal."""

    def owner_log(self, plane: DataPlane, stream: str, shard: int, start: int,
                  filters: Callable[[], Sequence[str]], since_ms: int | None) -> ShardLog | None:
        """A log of `stream`/`shard` read from its owner's journal from `start` (or its first
        record at or after `since_ms`), only the records matching `filters()`; None when this
        node cannot read other nodes' journals (its cursors follow the pushes alone)."""
        ...


class ReplicaRequests(Protocol):
    """Answers the replica requests (fetches, epoch ends) peers' followers send on their links."""

    def serve_link(self, peer: str, requests: Sequence[pb.ReplicaRequest],
                   reply: Callable[[pb.PeerReply], None]) -> None:
        """Answer each of `requests` once, through `reply` (the stream they came by)."""
        ...

    def settling(self, stream: str, shard: int) -> bool:
        """True while the view names this node the leader of replicated shard `stream`/`shard`
        and its log does not lead yet (its role is changing): a publish here is held for it
        (`Forwarding`), not refused."""
        ...


class PeerWatch(Protocol):
    """Told of a peer whose cluster port refused every dial for a while (its process is gone)."""

    def peer_gone(self, info: NodeInfo) -> None:
        """`info` is the peer as the view showed it when the refusals began (its registration's
        lease included): a later registration of that node is another process."""
        ...


class NoOwnerReads:
    """`OwnerReads` of a plane that reads no other node's journal."""

    def owner_log(self, plane: DataPlane, stream: str, shard: int, start: int,
                  filters: Callable[[], Sequence[str]], since_ms: int | None) -> ShardLog | None:
        return None


class NoReplicas:
    """`ReplicaRequests` of a node that leads no replicated shard: every request is refused."""

    def serve_link(self, peer: str, requests: Sequence[pb.ReplicaRequest],
                   reply: Callable[[pb.PeerReply], None]) -> None:
        reply(pb.PeerReply(replica=[pb.ReplicaAnswer(id=request.id, error="not_leader")
                                    for request in requests]))

    def settling(self, stream: str, shard: int) -> bool:
        return False


class NoPeerWatch:
    """`PeerWatch` of a plane alone: a peer that refuses dials is redialed, nothing else."""

    def peer_gone(self, info: NodeInfo) -> None:
        return None


__all__ = ["NoOwnerReads", "NoPeerWatch", "NoReplicas", "OwnerReads", "PeerWatch", "ReplicaRequests"]
