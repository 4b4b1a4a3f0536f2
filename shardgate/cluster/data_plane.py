"""The data plane of a cluster node (`DataPlane`): what the core sees of the cluster
(`ShardPlacement` and `Fanout`, see `core/placement.py`), the cluster port, and one outgoing
`PeerLink` per other live node, kept in step with the view.

It wires the pieces, one module each, and decides nothing itself:

| piece | module | what it does |
|---|---|---|
| `Forwarding` | `forwarding.py` | a publish to a shard another node owns goes to its owner; re-routing |
| `PushFanout` | `fanout.py` | a stored message is pushed once to each node that wants it |
| `UnroutedHold` | `unrouted.py` | messages stored while a node's routes are not known yet |
| `RouteSync` | `route_sync.py` | this node's routes told to the peers; waiting for them |
| `RetainedSync` | `retained_sync.py` | retained messages set on their owner, copied everywhere |
| `Inboxes` | `inbox.py` | the receiving end of the peers' links, and a peer held as a publisher |
| `ForwardStore` | `owner_store.py` | the owner stores what peers forwarded and answers |
| `CursorSources` | `cursor_sources.py` | what durable cursors read of shards other nodes own |
| `PeerLink` | `peer_link.py` (`outbox.py`) | one outgoing link: batched frames, redial, resume |
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from ..storage.interfaces import LatencyHistogram
from .cluster_port import ClusterPortProtocol
from .cursor_sources import CursorSources
from .fanout import PushFanout
from .forwarding import NODE_LOCAL_STREAMS, Forwarding
from .inbox import Inboxes
from .link_auth import HANDSHAKE_TIMEOUT_S, CallAuthenticator, NodeCredentials
from .membership import ClusterView
from .owner_store import ForwardStore
from .peer_link import LINK_TIMEOUT_S, PeerLink
from .plane_ports import (
    NoOwnerReads,
    NoPeerWatch,
    NoReplicas,
    OwnerReads,
    PeerWatch,
    ReplicaRequests,
)
from .received import ReceivedLog
from .retained_sync import RetainedSync
from .route_sync import ROUTE_DEBOUNCE_S, RouteSync
from .routes import RemoteRoutes
from .unrouted import UnroutedHold

if TYPE_CHECKING:
    from ..core.broker import Broker
    from ..core.message import Message
    from ..core.subscriptions import Subscription
    from ..storage.interfaces import ShardLog

log = logging.getLogger(__name__)

MAX_GRPC_MESSAGE = 512 << 20
# Links are checked against the view this often too, besides on every change it reports.
RECONCILE_S = 1.0
# On stop, how long the node waits for its peers to answer what it still sends them: the
# pushes of messages it stored (a subscriber elsewhere would miss an acknowledged message).
STOP_DRAIN_S = 3.0
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

@dataclass(slots=True)
class DataPlaneStats:
    """Counters for metrics (read at scrape time)."""

    forwarded: int = 0  # publishes sent to their shard's owner
    forward_failures: int = 0  # of those, refused or lost (the client got an error)
    forwarded_in: int = 0  # publishes other nodes forwarded here
    pushed: int = 0  # stored messages pushed to other nodes (once per node)
    pushed_in: int = 0  # messages other nodes pushed here for local subscribers
    pushes_dropped: int = 0  # pushes dropped on a full or broken link, or for unknown routes
    frames_out: int = 0  # frames written to peers (each a batch of forwards and pushes)
    frames_in: int = 0  # frames received from peers
    # Write of a frame of forwards → the owner's answer, once per frame.
    forward_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


class DataPlane:
    """Forwarding, fan-out and the route table of one node (see the module docstring)."""

    def __init__(
        self,
        broker: Broker,
        view: ClusterView,
        host: str = "127.0.0.1",
        port: int = 0,
        route_debounce_s: float = ROUTE_DEBOUNCE_S,
        link_timeout_s: float = LINK_TIMEOUT_S,
        credentials: NodeCredentials | None = None,
        *,
        owner_reads: OwnerReads | None = None,
        replicas: ReplicaRequests | None = None,
        peers: PeerWatch | None = None,
        links: dict[str, PeerLink] | None = None,
        forward_hold_s: float | None = None,
    ) -> None:
        self.broker = broker
        # what this node proves to its peers, and checks of them, on the cluster port
        self.credentials = credentials or NodeCredentials(view.node_id)
        # A peer that sends nothing for this long (no reply, no heartbeat) is given up on:
        # its link breaks, the publishes waiting for it fail retryably, and it is redialed.
        self.link_timeout_s = link_timeout_s
        self.view = view
        self.host = host
        self.port = port
        self.stats = DataPlaneStats()
        self.remote = RemoteRoutes()
        # One link per other live node (the same dict for the life of the plane: the pieces
        # below hold it; given, when another part sends on the links too: the replicas').
        self.links: dict[str, PeerLink] = links if links is not None else {}
        self.started = False
        # Stopping: forwarded publishes are refused (retryably) while the links drain.
        self.stopping = False
        # reads a shard another node owns from its owner's journal (`shard_reader.OwnerLogs`)
        self.owner_reads: OwnerReads = owner_reads or NoOwnerReads()
        # answers the replica requests peers' followers send on their links
        # (`replica_rpc.ReplicaService`); a node without one leads no replicated shard
        self.replicas: ReplicaRequests = replicas or NoReplicas()
        # told of a peer whose cluster port refused every dial for a while
        # (`peer_link.PEER_GONE_AFTER_S`; `ClusterNode`, which ends its lease)
        self.peers: PeerWatch = peers or NoPeerWatch()
        self.forwarding = Forwarding(self, forward_hold_s)
        self.unrouted = UnroutedHold(self)
        self.fanout = PushFanout(self)
        self.route_sync = RouteSync(self, route_debounce_s)
        self.retained_sync = RetainedSync(self)
        self.sources = CursorSources(self)
        self.store = ForwardStore(self)
        self.inboxes = Inboxes(self)
        self._server: grpc.aio.Server | None = None
        self._listener: asyncio.Server | None = None
        # Connections accepted on the cluster port (closed at stop).
        self._connections: set[ClusterPortProtocol] = set()
        self._closing: asyncio.Task[None] | None = None
        self._reconcile: asyncio.Task[None] | None = None

    @property
    def node_id(self) -> str:
        return self.view.node_id

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Listen on the cluster port, dial the peers and take the core's cluster hooks."""
        # gRPC (the shared-state calls) listens on loopback only: the cluster port passes
        # every connection that is not a peer's link through to it (`link.py`).
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[
            CallAuthenticator(self.credentials, self.registered)])
        grpc_port = server.add_insecure_port("127.0.0.1:0")
        if not grpc_port:
            raise OSError("cannot listen for the cluster's gRPC calls on 127.0.0.1")
        await server.start()
        self._server = server
        tls = self.credentials.tls
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                lambda: ClusterPortProtocol(self.inboxes, ("127.0.0.1", grpc_port),
                                            self._connections, self.credentials, self.registered),
                self.host or None, self.port,
                # TLS (`link_tls.py`) ends here: the protocol reads what the peer said
                ssl=tls.server_context if tls is not None else None,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if tls is not None else None,
            )
        except OSError:
            await server.stop(grace=None)
            self._server = None
            raise
        self.port = self._listener.sockets[0].getsockname()[1]
        self.started = True
        self.route_sync.start()
        self.broker.join_cluster(self, self, routes_changed=self.route_sync.changed,
                                 retained_changed=self.retained_sync.changed)
        self.view.on_change(self._view_changed)
        self._view_changed()
        self._reconcile = asyncio.get_running_loop().create_task(self._reconcile_links())

    async def stop(self) -> None:
        # Refuse new forwards, then let the links carry what is queued (the pushes of what
        # this node stored: their publishers were acknowledged) before they close. Bounded.
        self.stopping = True
        deadline = time.monotonic() + STOP_DRAIN_S
        while time.monotonic() < deadline and (
            self.store.storing or self.unrouted.held()
            or any(link.holding for link in self.links.values() if link.connected)
        ):
            await asyncio.sleep(0.01)
        self.started = False
        if self._reconcile is not None:
            self._reconcile.cancel()
            self._reconcile = None
        self.broker.leave_cluster(self)
        self.route_sync.stop()
        self.unrouted.clear()
        links = list(self.links.values())
        self.links.clear()
        self.forwarding.stop()
        for link in links:
            await link.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for connection in list(self._connections):
            connection.close()
        if self._server is not None:
            await self._server.stop(grace=0.1)
            self._server = None

    def registered(self, node_id: str, instance: str) -> bool:
        """Whether `node_id` is a live node of the view, registered by `instance`: a peer's
        link and calls are taken only from such a node (`link_auth.py`)."""
        info = self.view.nodes().get(node_id)
        return info is not None and info.instance == instance and node_id != self.node_id

    def add_service(self, handler: grpc.GenericRpcHandler) -> None:
        """Serve another service on the cluster port (the shared-state calls, `state_rpc.py`)."""
        assert self._server is not None, "the data plane is not started"
        self._server.add_generic_rpc_handlers((handler,))

    # The app closes its listeners with close() then wait_closed(); this is one of them.
    def close(self) -> None:
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self.stop())

    async def wait_closed(self) -> None:
        if self._closing is None:
            self.close()
        assert self._closing is not None
        await self._closing

    async def _reconcile_links(self) -> None:
        while self.started:
            await asyncio.sleep(RECONCILE_S)
            try:
                self._view_changed()
            except Exception:  # noqa: BLE001 - retried on the next round
                log.exception("cluster: checking the links against the view failed")

    def _view_changed(self) -> None:
        """Dial new peers, drop the links and routes of nodes that left or moved."""
        self.forwarding.view_changed()
        if not self.started:
            return
        nodes = self.view.nodes()
        for node_id, link in list(self.links.items()):
            info = nodes.get(node_id)
            if info is None or info.cluster_address != link.node.cluster_address:
                del self.links[node_id]
                asyncio.get_running_loop().create_task(link.close())
                if info is None:
                    self.remote.forget(node_id)
                    self.unrouted.routes_known.discard(node_id)
                    # (its inbox stays: a node that comes back with the same link session
                    # sends again what it had no answer to, and what this node applied of it
                    # already must be answered, not stored twice; a restart brings a new session)
                    self._end_links_from(node_id)
                    self.sources.read_owner_again(node_id)
                self.route_sync.link_state_changed()
        for node_id, info in nodes.items():
            if node_id != self.node_id and node_id not in self.links:
                self.links[node_id] = PeerLink(self, info)
        self.unrouted.refresh()
        self.sources.repoint_cursors()

    def _end_links_from(self, node_id: str) -> None:
        """End the streams `node_id` opened to this node: its routes were forgotten with it (a
        node frozen past its lease leaves the view, and its stream may stay open), so it
        dials again and sends what this node did not answer, and its routes, on a new one."""
        for connection in list(self._connections):
            if connection.peer == node_id:
                connection.close()

    # ------------------------------------------------------------ ShardPlacement
    def serves(self, stream: str, shard: int) -> bool:
        return stream in NODE_LOCAL_STREAMS or self.view.leads(stream, shard)

    def stores(self, stream: str, shard: int) -> bool:
        return self.serves(stream, shard) and not self.replicas.settling(stream, shard)

    def forward(self, message: Message) -> asyncio.Future[None]:
        return self.forwarding.forward(message)

    def received_log(self, stream: str, shard: int) -> ReceivedLog:
        return self.sources.received_log(stream, shard)

    def owner_log(self, stream: str, shard: int, start: int, filters: Callable[[], Sequence[str]],
                  since_ms: int | None = None) -> ShardLog | None:
        return self.sources.owner_log(stream, shard, start, filters, since_ms)

    # ------------------------------------------------------------ Fanout
    def push(
        self, message: Message, local: list[tuple[Subscription, tuple[str, ...]]]
    ) -> Container[str] | None:
        return self.fanout.push(message, local)

    def wanted_elsewhere(self, topic: str) -> bool:
        return self.fanout.wanted_elsewhere(topic)

    def wanted_durably_elsewhere(self, topic: str) -> bool:
        return self.fanout.wanted_durably_elsewhere(topic)

    def routes_ready(self) -> asyncio.Future[None] | None:
        return self.route_sync.routes_ready()

    # ------------------------------------------------------------ for the other cluster modules
    def pushes_settled(self) -> asyncio.Future[None] | None:
        """See `RouteSync.pushes_settled` (a session moving here waits for it)."""
        return self.route_sync.pushes_settled()

    def pushes_flushed(self, timeout_s: float) -> asyncio.Future[None] | None:
        """See `RouteSync.pushes_flushed` (a session's stand-in waits for it before it leaves)."""
        return self.route_sync.pushes_flushed(timeout_s)

    def unrouted_held(self) -> int:
        """How many stored messages wait for some node's routes (`unrouted.py`)."""
        return self.unrouted.held()
