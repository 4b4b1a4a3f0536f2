"""The data plane of a cluster: forwarding publishes to shard owners, pushing stored messages
to the nodes that want them, and telling peers which filters this node's clients hold.

`DataPlane` is what the core sees (`ShardPlacement` and `Fanout`, see `core/placement.py`).
It listens on the node's cluster port and keeps one outgoing `PeerLink` per other live node,
a TCP connection carrying numbered frames (`proto/cluster.proto`, framed by `link.py`). A link
writes everything queued during one loop turn as one frame, at the end of that turn (no timer,
no task and no await per message); while the peer is behind reading, the transport pauses and
messages gather into bigger frames. It is bounded: past `MAX_FORWARDS_IN_FLIGHT` forwarded
publishes waiting for their owner, further ones are refused with `ShardUnavailable` (the
client's retryable error); past `MAX_PUSHES_QUEUED` queued pushes, pushes are dropped and
counted as a slow subscriber's would be.

Ownership is the control plane's (`membership.ClusterView`); the owner checks it again for
every forwarded message and answers `NOT_OWNER` when the map moved, so a message is stored only
by the node that owns its shard under the current epoch.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from ..core.errors import CoreError, PublishRejected, ShardUnavailable
from ..core.subscriptions import Subscription, SubscriptionType
from ..proto import cluster_pb2 as pb
from ..storage.journal import LatencyHistogram
from .frames import (
    NO_GROUPS,
    RecordFormatError,
    body_of,
    forward_frame,
    frame_size,
    message_from_forward,
    message_from_push,
    push_frame,
    record_of,
    route_update,
    routes_from_update,
)
from .link import ClusterPortProtocol, LinkClient
from .membership import ClusterView, NodeInfo
from .received import ReceivedLog
from .routes import NOBODY, RemoteRoutes, Route, RouteDelta, diff, local_routes

if TYPE_CHECKING:
    from ..core.broker import Broker
    from ..core.message import Message
    from ..storage.interfaces import ShardLog

log = logging.getLogger(__name__)

MAX_FORWARDS_IN_FLIGHT = 20_000
MAX_PUSHES_QUEUED = 100_000
FRAME_MAX_MESSAGES = 2_000
FRAME_MAX_BYTES = 4 << 20
MAX_GRPC_MESSAGE = 512 << 20
DIAL_TIMEOUT_S = 5.0
RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 1.0
ROUTE_DEBOUNCE_S = 0.02
# A SUBACK waits at most this long for the peers to apply the new routes (a slow peer).
ROUTE_WAIT_S = 1.0
# A node whose view of the shard map is behind a peer's waits this long for its etcd watch
# to catch up before it refuses a message it is not (yet) the owner of.
VIEW_CATCH_UP_S = 5.0
# A broken stream is resumed (its unanswered frames sent again) while its oldest unanswered
# frame is younger than this; older, their publishes fail retryably instead of waiting on.
RESUME_LIMIT_S = 10.0
# Links are checked against the view this often too, besides on every change it reports.
RECONCILE_S = 1.0
# On stop, how long the node waits for its peers to answer what it still sends them: the
# pushes of messages it stored (a subscriber elsewhere would miss an acknowledged message).
STOP_DRAIN_S = 3.0
# Streams every node keeps for itself, never placed nor forwarded: its own $SYS topics.
NODE_LOCAL_STREAMS = frozenset({"sys"})
# Topics whose retained state is the node's own: its $SYS topics, its internal state.
NODE_LOCAL_TOPICS = ("$SYS/", "$internal/")
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
    pushes_dropped: int = 0  # pushes dropped on a full or broken link
    frames_out: int = 0  # frames written to peers (each a batch of forwards and pushes)
    frames_in: int = 0  # frames received from peers
    # Write of a frame of forwards → the owner's answer, once per frame.
    forward_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


class _Sent:
    """A frame written to the peer and not answered yet: written again on a new stream of the
    same session after a break, until its answer comes."""

    __slots__ = ("frame", "forwards", "pushes", "route_generation", "written_at")

    def __init__(
        self, frame: pb.PeerFrame, forwards: list[tuple[asyncio.Future[None], Message, int]],
        pushes: int, route_generation: int,
    ) -> None:
        self.frame = frame
        self.forwards = forwards
        self.pushes = pushes
        self.route_generation = route_generation
        self.written_at = time.perf_counter()


class PeerLink:
    """This node's outgoing link to one peer: one `Link` stream at a time, batched, bounded,
    redialed, and resumed after a break (the frames not answered are sent again)."""

    def __init__(self, plane: DataPlane, node: NodeInfo) -> None:
        self.plane = plane
        self.node = node
        # Frames are numbered within this session, across the streams it opens.
        self.session = random.getrandbits(62) + 1
        self._next_sequence = 1
        self._unanswered: dict[int, _Sent] = {}
        self._answered_floor = 1  # every frame below it was answered
        self._forwards: list[tuple[pb.Forward, asyncio.Future[None], Message]] = []
        self._pushes: list[pb.Push] = []
        self._routes: list[pb.RouteUpdate] = []
        self._routes_generation = 0
        self._retained: list[pb.Retained] = []
        self._in_flight = 0  # forwards queued or not answered
        self._pushes_held = 0  # pushes queued or not answered
        # The last route generation of this node the peer has applied (SUBACK waits for it).
        self.routes_answered = 0
        self._loop = asyncio.get_running_loop()
        # The connection frames go to now (None while dialing or broken).
        self._connection: LinkClient | None = None
        self._flush_scheduled = False
        self._closed = False
        self.connected = False
        # False after two failed dials in a row, until a dial succeeds: forwards fail fast
        # meanwhile.
        self.reachable = True
        self._failed_dials = 0
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"link-{node.node_id}")

    def __repr__(self) -> str:
        return f"PeerLink({self.node.node_id} at {self.node.cluster_address})"

    @property
    def holding(self) -> bool:
        """Whether anything is queued for the peer or sent and not answered yet."""
        return bool(self._forwards or self._pushes or self._unanswered)

    # ------------------------------------------------------------ called on the hot path
    def forward(
        self, message: Message, epoch: int, future: asyncio.Future[None] | None = None
    ) -> asyncio.Future[None]:
        """Queue `message` for the peer (the owner under `epoch`); `future` is the one to
        resolve when the message is re-routed after a refusal."""
        if future is None:
            future = asyncio.get_running_loop().create_future()
        if not self.reachable:
            _fail(future, ShardUnavailable(
                f"node {self.node.node_id} owning {message.stream}/{message.shard} is unreachable"
            ))
        elif self._in_flight >= MAX_FORWARDS_IN_FLIGHT:
            _fail(future, ShardUnavailable(
                f"too many publishes waiting for node {self.node.node_id}; retry"
            ))
        else:
            self._forwards.append((forward_frame(message, epoch), future, message))
            self._in_flight += 1
            self._flush_soon()
        if future.done():
            self.plane.stats.forward_failures += 1
        return future

    def push(self, push: pb.Push) -> None:
        if self._pushes_held >= MAX_PUSHES_QUEUED or not self.reachable:
            self.plane.stats.pushes_dropped += 1
            self.plane.broker.stats.drop("cluster_link_full")
            return
        self._pushes.append(push)
        self._pushes_held += 1
        self._flush_soon()

    def send_routes(self, update: pb.RouteUpdate, generation: int) -> None:
        self._routes.append(update)
        self._routes_generation = generation
        self._flush_soon()

    def send_retained(self, retained: pb.Retained) -> None:
        self._retained.append(retained)
        self._flush_soon()

    def _flush_soon(self) -> None:
        """Write what is queued at the end of this loop turn: everything queued meanwhile (one
        socket read's publishes, say) leaves as one frame, with no timer."""
        if not self._flush_scheduled and self._connection is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write everything queued as frames, unless the peer is behind reading (the transport
        is paused): then the messages gather into bigger frames until it catches up."""
        self._flush_scheduled = False
        connection = self._connection
        if connection is None:
            return
        stats = self.plane.stats
        while (self._forwards or self._pushes or self._routes or self._retained) and not connection.paused:
            connection.send(self._next_frame())
            stats.frames_out += 1

    # ------------------------------------------------------------ the link's task
    async def close(self) -> None:
        self._closed = True
        if self._connection is not None:
            self._connection.close()
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass
        self._fail_all(ShardUnavailable(f"node {self.node.node_id} left the cluster"))

    async def _run(self) -> None:
        backoff = RECONNECT_MIN_S
        while not self._closed:
            try:
                await self._serve()
                backoff = RECONNECT_MIN_S
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a broken link is redialed, never fatal
                if self.connected or self.reachable:
                    log.warning("cluster link to %s lost: %s", self, _short(exc))
                # A stream that broke is resumed on the next (its frames are sent again), as is
                # one broken again while it opened; a peer that cannot be dialed twice in a row
                # is away: its clients get retryable errors.
                self._failed_dials = 0 if self.connected else self._failed_dials + 1
                self.reachable = self._failed_dials < 2 and not self._closed
                oldest = next(iter(self._unanswered.values()), None)
                if not self.reachable or (
                    oldest is not None and time.perf_counter() - oldest.written_at > RESUME_LIMIT_S
                ):
                    self._fail_all(ShardUnavailable(
                        f"link to node {self.node.node_id} lost before it answered; retry"
                    ))
            finally:
                if self.connected:
                    self.connected = False
                    self.plane.link_state_changed()
            if self._closed:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_MAX_S)

    async def _serve(self) -> None:
        """One connection of the link session: dial, say hello, send again what the last
        connection left unanswered, then the route set; return (raise) when it ends."""
        host, _, port = self.node.cluster_address.rpartition(":")
        _transport, connection = await asyncio.wait_for(
            self._loop.create_connection(
                lambda: LinkClient(self._on_reply, self._flush_soon), host.strip("[]"), int(port)),
            DIAL_TIMEOUT_S,
        )
        try:
            connection.send(pb.PeerFrame(sequence=0, from_node=self.plane.node_id, session=self.session))
            # What the last connection left unanswered goes again, in order (the peer skips
            # what it applied already and answers it again).
            for _sequence, sent in list(self._unanswered.items()):
                sent.frame.answered_below = self._answered_below()
                connection.send(sent.frame)
            # Then everything this node's clients hold now (the peer may be a new process),
            # and the retained messages of its shards.
            self._routes = [self.plane.route_snapshot()]
            self._routes_generation = self.plane.route_generation
            self._retained = self._retained + self.plane.retained_snapshot()
            self._connection = connection
            if not self.connected:
                self.connected = self.reachable = True
                log.info("cluster link to %s up", self)
                self.plane.link_state_changed()
            self._flush()
            raise await connection.closed
        finally:
            self._connection = None
            connection.close()

    def _answered_below(self) -> int:
        """The lowest sequence not answered yet (each sequence is passed once: O(1) a frame)."""
        floor, unanswered, end = self._answered_floor, self._unanswered, self._next_sequence
        while floor < end and floor not in unanswered:
            floor += 1
        self._answered_floor = floor
        return floor

    def _next_frame(self) -> pb.PeerFrame:
        sequence = self._next_sequence
        frame = pb.PeerFrame(sequence=sequence, answered_below=self._answered_below())
        self._next_sequence = sequence + 1
        route_generation = 0
        if self._routes:
            routes, self._routes = self._routes, []
            merged = routes[0]
            for later in routes[1:]:
                if later.reset:
                    merged = later
                else:
                    merged.added.extend(later.added)
                    merged.removed.extend(later.removed)
            frame.routes.CopyFrom(merged)
            route_generation = self._routes_generation
        if self._retained:
            frame.retained.extend(self._retained)
            self._retained = []
        size = 0
        count = 0
        forwards: list[tuple[asyncio.Future[None], Message, int]] = []
        if self._forwards:
            taken = []
            for entry in self._forwards:
                if count >= FRAME_MAX_MESSAGES or (count and size >= FRAME_MAX_BYTES):
                    break
                taken.append(entry)
                count += 1
                size += frame_size(entry[0])
            del self._forwards[:count]
            frame.forwards.extend(entry[0] for entry in taken)
            forwards = [(future, message, forward.epoch) for forward, future, message in taken]
        pushes = 0
        if self._pushes and count < FRAME_MAX_MESSAGES:
            for push in self._pushes:
                if count >= FRAME_MAX_MESSAGES or (count and size >= FRAME_MAX_BYTES):
                    break
                count += 1
                pushes += 1
                size += frame_size(push)
            frame.pushes.extend(self._pushes[:pushes])
            del self._pushes[:pushes]
        self._unanswered[sequence] = _Sent(frame, forwards, pushes, route_generation)
        return frame

    def _on_reply(self, reply: pb.PeerReply) -> None:
        """The peer answered a frame: settle its forwards (stored, re-routed or refused)."""
        sent = self._unanswered.pop(reply.sequence, None)
        if sent is None:
            return
        self._pushes_held -= sent.pushes
        if sent.route_generation > self.routes_answered:
            self.routes_answered = sent.route_generation
            self.plane.link_state_changed()
        if not sent.forwards:
            return
        stats = self.plane.stats
        stats.forward_latency.observe(time.perf_counter() - sent.written_at)
        self._in_flight -= len(sent.forwards)
        outcomes = reply.outcomes
        for index, (future, message, epoch) in enumerate(sent.forwards):
            if future.done():
                continue
            outcome = outcomes[index] if index < len(outcomes) else None
            if outcome is not None and outcome.code == pb.STORED:
                message.offset = outcome.offset
                future.set_result(None)
                continue
            if outcome is not None and outcome.code == pb.NOT_OWNER and self.plane.reroute(
                message, future, epoch, outcome.epoch
            ):
                continue
            stats.forward_failures += 1
            _fail(future, _refusal(self.node.node_id, outcome))

    def _fail_all(self, error: PublishRejected) -> None:
        """Fail every forward not yet answered and drop the pushes: the owner may or may not
        have stored them, so the clients get a retryable error (at least once, never
        acknowledged and lost). Used when the peer is away, not when a stream merely broke."""
        entries = [(future, message) for _, future, message in self._forwards]
        dropped = len(self._pushes)
        for sent in self._unanswered.values():
            entries += [(future, message) for future, message, _epoch in sent.forwards]
            dropped += sent.pushes
        self._forwards = []
        self._unanswered = {}
        self._answered_floor = self._next_sequence
        self._in_flight = 0
        self._pushes = []
        self._pushes_held = 0
        self.plane.stats.pushes_dropped += dropped
        for future, _message in entries:
            if not future.done():
                self.plane.stats.forward_failures += 1
                _fail(future, error)


def _fail(future: asyncio.Future[None], error: BaseException) -> None:
    """Fail a forward's future, marked as seen: a QoS 0 publisher never looks at it, and an
    unretrieved failure would be logged by asyncio as a bug."""
    future.set_exception(error)
    future.exception()


def _retained_frame(topic: str, message: Message | None) -> pb.Retained:
    if message is None:
        return pb.Retained(topic=topic, present=False)
    return pb.Retained(topic=topic, present=True, message=push_frame(message, body_of(message)))


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _settle(future: asyncio.Future[None], done: asyncio.Future[None]) -> None:
    if future.done():
        return
    if done.cancelled() or done.exception() is not None:
        error = "cancelled" if done.cancelled() else done.exception()
        _fail(future, PublishRejected(f"the message could not be stored: {error}"))
    else:
        future.set_result(None)


def _refusal(node_id: str, outcome: pb.Outcome | None) -> PublishRejected:
    if outcome is None:
        return ShardUnavailable(f"node {node_id} did not answer for the message; retry")
    reason = outcome.reason or pb.OutcomeCode.Name(outcome.code).lower()
    if outcome.code == pb.NOT_OWNER:
        return ShardUnavailable(reason)
    return PublishRejected(reason)


def _short(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__


class _Inbox:
    """What this node applied of one peer's link session: the highest frame applied (frames of
    a session are applied once, in order), and its answers the peer may not have received yet
    (sent again when the peer sends their frame again on a new stream)."""

    __slots__ = ("session", "applied", "answers", "reply", "_forgotten_below")

    def __init__(self, session: int) -> None:
        self.session = session
        self.applied = 0
        self.answers: dict[int, pb.PeerReply] = {}
        self._forgotten_below = 1
        # Where answers go now: the session's current stream (None between streams).
        self.reply: Callable[[pb.PeerReply], None] | None = None

    def answer(self, reply: pb.PeerReply) -> None:
        self.answers[reply.sequence] = reply
        if self.reply is not None:
            self.reply(reply)

    def forget_below(self, sequence: int) -> None:
        """Drop the answers below `sequence` (each sequence is passed once: O(1) a frame)."""
        answers = self.answers
        below = self._forgotten_below
        while below < sequence:
            answers.pop(below, None)
            below += 1
        self._forgotten_below = below


class DataPlane:
    """Forwarding, fanout and the route table of one node (see the module docstring)."""

    def __init__(
        self,
        broker: Broker,
        view: ClusterView,
        host: str = "127.0.0.1",
        port: int = 0,
        route_debounce_s: float = ROUTE_DEBOUNCE_S,
    ) -> None:
        self.broker = broker
        self.view = view
        self.host = host
        self.port = port
        self.route_debounce_s = route_debounce_s
        self.stats = DataPlaneStats()
        self.remote = RemoteRoutes()
        self.links: dict[str, PeerLink] = {}
        self._advertised: set[Route] = set()
        self._flush_handle: asyncio.Handle | None = None
        self._last_flush = 0.0
        self._turns: dict[str, int] = {}
        # What this node applied of each peer's link session.
        self._inboxes: dict[str, _Inbox] = {}
        # Bumped by every route update sent; each link knows the last its peer applied.
        self.route_generation = 0
        self._route_waiters: list[tuple[int, asyncio.Future[None]]] = []
        # (deadline, stream, shard, epoch, then): waiting for this node's view to catch up.
        self._epoch_waiters: list[
            tuple[float, str, int, int, Callable[[], None], Callable[[], bool] | None]] = []
        self._server: grpc.aio.Server | None = None
        self._listener: asyncio.Server | None = None
        # Connections accepted on the cluster port (closed at stop).
        self._connections: set[ClusterPortProtocol] = set()
        self._started = False
        # Stopping: forwarded publishes are refused (retryably) while the links drain.
        self._stopping = False
        self._storing = 0  # frames of forwarded publishes being stored, not answered yet
        # Shards other nodes own that a durable subscription here follows.
        self._received: dict[tuple[str, int], ReceivedLog] = {}
        # makes a log reading a shard another node owns from its owner's journal (set by
        # `attach.py` once the shard-reading calls are served; see `shard_reader.OwnerLog`)
        self.owner_reader: Callable[[str, int, int, Callable[[], Sequence[str]], int | None], ShardLog] | None = None
        self._closing: asyncio.Task[None] | None = None
        self._reconcile: asyncio.Task[None] | None = None
        # What kept retained messages before (the metadata store, through the app).
        self._keep_retained: Callable[[str, Message | None], None] | None = None

    @property
    def node_id(self) -> str:
        return self.view.node_id

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Listen on the cluster port, dial the peers and take the core's cluster hooks."""
        # gRPC (the shared-state calls) listens on loopback only: the cluster port passes
        # every connection that is not a peer's link through to it (`link.py`).
        server = grpc.aio.server(options=SERVER_OPTIONS)
        grpc_port = server.add_insecure_port("127.0.0.1:0")
        if not grpc_port:
            raise OSError("cannot listen for the cluster's gRPC calls on 127.0.0.1")
        await server.start()
        self._server = server
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                lambda: ClusterPortProtocol(self, ("127.0.0.1", grpc_port), self._connections),
                self.host or None, self.port,
            )
        except OSError:
            await server.stop(grace=None)
            self._server = None
            raise
        self.port = self._listener.sockets[0].getsockname()[1]
        self._started = True
        self._advertised = local_routes(self.broker.subscriptions.values())
        broker = self.broker
        broker.placement = self
        broker.fanout = self
        broker.on_routes_changed = self._routes_changed
        self._keep_retained = broker.on_retained_change
        broker.on_retained_change = self._retained_changed
        self.view.on_change(self._view_changed)
        self._view_changed()
        self._reconcile = asyncio.get_running_loop().create_task(self._reconcile_links())

    async def stop(self) -> None:
        # Refuse new forwards, then let the links carry what is queued (the pushes of what
        # this node stored: their publishers were acknowledged) before they close. Bounded.
        self._stopping = True
        deadline = time.monotonic() + STOP_DRAIN_S
        while time.monotonic() < deadline and (
            self._storing or any(link.holding for link in self.links.values() if link.connected)
        ):
            await asyncio.sleep(0.01)
        self._started = False
        if self._reconcile is not None:
            self._reconcile.cancel()
            self._reconcile = None
        broker = self.broker
        if broker.placement is self:
            broker.placement = None
            broker.fanout = None
            broker.on_routes_changed = None
            broker.on_retained_change = self._keep_retained
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        links, self.links = list(self.links.values()), {}
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
        while self._started:
            await asyncio.sleep(RECONCILE_S)
            try:
                self._view_changed()
            except Exception:  # noqa: BLE001 - retried on the next round
                log.exception("cluster: checking the links against the view failed")

    def _view_changed(self) -> None:
        """Dial new peers, drop the links and routes of nodes that left or moved."""
        if self._epoch_waiters:
            self._check_epoch_waiters()
        if not self._started:
            return
        nodes = self.view.nodes()
        for node_id, link in list(self.links.items()):
            info = nodes.get(node_id)
            if info is None or info.cluster_address != link.node.cluster_address:
                del self.links[node_id]
                asyncio.get_running_loop().create_task(link.close())
                if info is None:
                    self.remote.forget(node_id)
                    self._inboxes.pop(node_id, None)
                self.link_state_changed()
        for node_id, info in nodes.items():
            if node_id != self.node_id and node_id not in self.links:
                self.links[node_id] = PeerLink(self, info)
        self._repoint_cursors()

    def _repoint_cursors(self) -> None:
        """Durable cursors of reliable shards replay from the shard's own log where this node
        owns the shard, else from what it received of it. Cursors restored at start, before the
        shard map was known, get their log here once it is."""
        from ..core.durable import DurableSubscription

        broker, view = self.broker, self.view
        for sub in broker.subscriptions.values():
            if not isinstance(sub, DurableSubscription):
                continue
            for (stream, shard), cursor in sub.cursors.items():
                if cursor.log is None:
                    continue
                assignment = view.owner(stream, shard)
                if assignment is None:
                    continue
                # (an OwnerLog of cluster.shard_reader also reads a shard another node owns)
                received = isinstance(cursor.log, ReceivedLog) or getattr(cursor.log, "remote_shard", False)
                if assignment.node_id != self.node_id and not received:
                    cursor.log = self.received_log(stream, shard)
                elif assignment.node_id == self.node_id and received:
                    local = broker.streams.get(stream)
                    if local is not None and shard < len(local.shards) and local.shards[shard].log:
                        cursor.log = local.shards[shard].log

    # ------------------------------------------------------------ ShardPlacement
    def serves(self, stream: str, shard: int) -> bool:
        return stream in NODE_LOCAL_STREAMS or self.view.owns(stream, shard)

    def received_log(self, stream: str, shard: int) -> ReceivedLog:
        key = (stream, shard)
        log = self._received.get(key)
        if log is None:
            log = self._received[key] = ReceivedLog()
        return log

    def owner_log(self, stream: str, shard: int, start: int, filters: Callable[[], Sequence[str]],
                  since_ms: int | None = None) -> ShardLog | None:
        reader = self.owner_reader
        return None if reader is None else reader(stream, shard, start, filters, since_ms)

    def forward(self, message: Message) -> asyncio.Future[None]:
        assignment = self.view.owner(message.stream, message.shard)
        link = None
        if assignment is not None and assignment.node_id != self.node_id:
            link = self.links.get(assignment.node_id)
        if link is None:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if assignment is None:
                reason = f"no node owns {message.stream}/{message.shard} now; retry"
            elif assignment.node_id == self.node_id:
                reason = f"this node cannot prove it owns {message.stream}/{message.shard} now; retry"
            else:
                reason = f"node {assignment.node_id} owning {message.stream}/{message.shard} is not live"
            _fail(future, ShardUnavailable(reason))
            self.stats.forward_failures += 1
            return future
        self.stats.forwarded += 1
        return link.forward(message, assignment.epoch)  # type: ignore[union-attr]

    def reroute(
        self, message: Message, future: asyncio.Future[None], refused_epoch: int, owner_epoch: int = 0
    ) -> bool:
        """An owner refused `message` (it does not own the shard under `refused_epoch`): when
        the view has moved on since (a newer epoch), send it where the shard lives now and
        resolve `future` from there. When the refusing node knows a newer epoch
        (`owner_epoch`) than this node's view, wait (bounded) for the view to catch up first.
        False to let the client have the retryable error. Bounded: epochs only grow."""
        if self._route_again(message, future, refused_epoch):
            return True
        if owner_epoch <= refused_epoch:
            return False

        def caught_up() -> None:
            if not self._route_again(message, future, refused_epoch):
                self.stats.forward_failures += 1
                _fail(future, ShardUnavailable(
                    f"the owner of {message.stream}/{message.shard} moved and this node has "
                    "not learned where yet; retry"))

        self._after_epoch(message.stream, message.shard, owner_epoch, caught_up)
        return True

    def _route_again(self, message: Message, future: asyncio.Future[None], refused_epoch: int) -> bool:
        assignment = self.view.owner(message.stream, message.shard)
        if assignment is None or assignment.epoch <= refused_epoch:
            return False
        if assignment.node_id == self.node_id:
            if not self.view.owns(message.stream, message.shard):
                return False
            try:
                stored = self.broker.publish(message, counted=False)  # counted when it came in
            except PublishRejected as exc:
                _fail(future, exc)
                return True
            if stored is None:
                future.set_result(None)
            else:
                stored.add_done_callback(lambda done: _settle(future, done))
            return True
        link = self.links.get(assignment.node_id)
        if link is None:
            return False
        link.forward(message, assignment.epoch, future)
        return True

    def _after_epoch(self, stream: str, shard: int, epoch: int, then: Callable[[], None],
                     ready: Callable[[], bool] | None = None) -> None:
        """Call `then` once this node's view holds `stream`/`shard` at `epoch` or later (its
        etcd watch caught up with the node that knew it first), or after VIEW_CATCH_UP_S.
        With `ready`, also wait until it holds."""
        loop = asyncio.get_running_loop()
        self._epoch_waiters.append((loop.time() + VIEW_CATCH_UP_S, stream, shard, epoch, then, ready))
        loop.call_later(VIEW_CATCH_UP_S, self._check_epoch_waiters)

    def _check_epoch_waiters(self) -> None:
        now = asyncio.get_running_loop().time()
        view = self.view
        due, waiting = [], []
        for waiter in self._epoch_waiters:
            deadline, stream, shard, epoch, then, ready = waiter
            assignment = view.owner(stream, shard)
            if now >= deadline or (
                assignment is not None and assignment.epoch >= epoch and (ready is None or ready())
            ):
                due.append(then)
            else:
                waiting.append(waiter)
        self._epoch_waiters = waiting
        for then in due:
            try:
                then()
            except Exception:  # noqa: BLE001 - one message's failure must not stop the others
                log.exception("cluster: handling a message after the shard map changed failed")

    # ------------------------------------------------------------ Fanout
    def push(
        self, message: Message, local: list[tuple[Subscription, tuple[str, ...]]]
    ) -> Container[str] | None:
        interest = self.remote.lookup(message.topic)
        if interest is NOBODY or message.stream in NODE_LOCAL_STREAMS:
            return None
        targets: dict[str, list[str]] = {node: [] for node in interest.plain}
        allowed: set[str] | None = None
        if interest.groups:
            local_shared = {
                sub.name: sub for sub, _ in local if sub.type is SubscriptionType.SHARED
            }
            allowed = {name for name in local_shared if name not in interest.groups}
            for group, members in interest.groups.items():
                here = local_shared.get(group)
                if here is not None and here.consumers:
                    members = (*members, (self.node_id, len(here.consumers)))
                chosen = self._choose(group, members)
                if chosen == self.node_id:
                    allowed.add(group)
                else:
                    targets.setdefault(chosen, []).append(group)
        body = body_of(message)
        links = self.links
        for node_id, groups in targets.items():
            link = links.get(node_id)
            if link is not None:
                link.push(push_frame(message, body, groups))
                self.stats.pushed += 1
        return allowed

    def wanted_elsewhere(self, topic: str) -> bool:
        return self.remote.lookup(topic) is not NOBODY

    def wanted_durably_elsewhere(self, topic: str) -> bool:
        return self.remote.lookup(topic).durable

    def _choose(self, group: str, members: tuple[tuple[str, int], ...]) -> str:
        """The node that takes the next message of a share group: round robin over the
        group's consumers, so each node gets its members' part."""
        total = sum(weight for _node, weight in members)
        turn = self._turns.get(group, 0)
        self._turns[group] = turn + 1
        slot = turn % total
        for node, weight in members:
            if slot < weight:
                return node
            slot -= weight
        return members[-1][0]

    # ------------------------------------------------------------ route table
    def route_snapshot(self) -> pb.RouteUpdate:
        """Everything this node's clients hold, as a reset for a new link."""
        return route_update(RouteDelta(sorted(self._advertised), []), reset=True)

    def _routes_changed(self) -> None:
        """Local subscriptions changed: tell the peers soon (the first change at once, then
        at most one update per debounce interval)."""
        if self._flush_handle is not None or not self._started:
            return
        loop = asyncio.get_running_loop()
        wait = self._last_flush + self.route_debounce_s - loop.time()
        if wait <= 0:
            self._flush_handle = loop.call_soon(self._flush_routes)
        else:
            self._flush_handle = loop.call_later(wait, self._flush_routes)

    def _flush_routes(self) -> None:
        self._flush_handle = None
        self._last_flush = asyncio.get_running_loop().time()
        now = local_routes(self.broker.subscriptions.values())
        delta = diff(self._advertised, now)
        self._advertised = now
        if not delta:
            self.link_state_changed()  # nothing new to wait for
            return
        self.route_generation += 1
        update = route_update(delta)
        for link in self.links.values():
            link.send_routes(update, self.route_generation)

    def routes_ready(self) -> asyncio.Future[None] | None:
        """None when every peer this node is linked to has applied its routes as they are
        now (subscriptions made so far); else a future that resolves once they have, or after
        ROUTE_WAIT_S (a slow peer). Peers whose link is down are not waited for: they get the
        whole route set when their link comes back."""
        target = self.route_generation + (1 if self._flush_handle is not None else 0)
        if self._routes_reached(target):
            return None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._route_waiters.append((target, future))
        loop.call_later(ROUTE_WAIT_S, _resolve, future)
        return future

    def _routes_reached(self, target: int) -> bool:
        if self._flush_handle is None:
            target = min(target, self.route_generation)
        return all(link.routes_answered >= target for link in self.links.values() if link.connected)

    def link_state_changed(self) -> None:
        """A link came up, went down, or its peer applied routes: settle the route waiters."""
        if not self._route_waiters:
            return
        waiting = []
        for target, future in self._route_waiters:
            if future.done():
                continue
            if self._routes_reached(target):
                future.set_result(None)
            else:
                waiting.append((target, future))
        self._route_waiters = waiting

    # ------------------------------------------------------------ retained messages
    def _retained_changed(self, topic: str, message: Message | None) -> None:
        """A retained message was set or cleared here (the owner of its shard): keep it, and
        tell every other node."""
        if self._keep_retained is not None:
            self._keep_retained(topic, message)
        if topic.startswith(NODE_LOCAL_TOPICS):
            return
        update = _retained_frame(topic, message)
        for link in self.links.values():
            link.send_retained(update)

    def retained_snapshot(self) -> list[pb.Retained]:
        """The retained messages of the shards this node owns, for a new link."""
        broker = self.broker
        owned = []
        for topic, message in broker.retained.items():
            if topic.startswith(NODE_LOCAL_TOPICS):
                continue
            stream = broker.stream_for_topic(topic)  # restored messages carry no shard
            if self.view.owns(stream.name, stream.shard_for(topic, message.key).index):
                owned.append(_retained_frame(topic, message))
        return owned

    def _apply_retained(self, updates: list[pb.Retained]) -> None:
        retained = self.broker.retained
        for update in updates:
            message: Message | None = None
            if update.present:
                try:
                    message = message_from_push(update.message)
                except RecordFormatError as exc:
                    log.warning("dropped a malformed retained message from a peer: %s", exc)
                    continue
                message.retain = True
                retained.set(update.topic, message)
            elif not retained.delete(update.topic):
                continue
            if self._keep_retained is not None:
                self._keep_retained(update.topic, message)

    # ------------------------------------------------------------ the receiving end
    def link_opened(self, peer: str, session: int, reply: Callable[[pb.PeerReply], None]) -> None:
        """A stream of `peer`'s link `session` began: answers go to it from now on."""
        inbox = self._inboxes.get(peer)
        if inbox is None or inbox.session != session:
            inbox = self._inboxes[peer] = _Inbox(session)
        inbox.reply = reply

    def receive(self, peer: str, frame: pb.PeerFrame, reply: Callable[[pb.PeerReply], None]) -> None:
        """Apply one frame from `peer` once per session: routes, then retained messages, then
        pushes, then forwards; answered once every forward is stored (at once without any)."""
        inbox = self._inboxes.get(peer)
        if inbox is None or inbox.reply is not reply:
            return  # a late frame of a stream the peer replaced: it sends it again on the new one
        if frame.answered_below:
            inbox.forget_below(frame.answered_below)
        sequence = frame.sequence
        if sequence == 0:
            return  # a hello
        if sequence <= inbox.applied:
            answered = inbox.answers.get(sequence)
            if answered is not None:
                reply(answered)
            return  # applied already; its answer follows when its forwards are stored
        inbox.applied = sequence
        self.stats.frames_in += 1
        if frame.HasField("routes"):
            update = frame.routes
            delta = routes_from_update(update)
            if update.reset:
                self.remote.reset(peer, delta.added)
            else:
                self.remote.apply(peer, delta)
        if frame.retained:
            self._apply_retained(frame.retained)
        if frame.pushes:
            self._dispatch_pushes(frame.pushes)
        if frame.forwards:
            self._store_forwards(sequence, frame.forwards, inbox.answer)
        else:
            inbox.answer(pb.PeerReply(sequence=sequence))

    def peer_link_ended(self, peer: str, reply: Callable[[pb.PeerReply], None]) -> None:
        """A stream from `peer` ended. Its routes stay: the peer resumes its session on a new
        stream, and a node that is gone leaves the view, which forgets them."""
        inbox = self._inboxes.get(peer)
        if inbox is not None and inbox.reply is reply:
            inbox.reply = None

    def _dispatch_pushes(self, pushes: list[pb.Push]) -> None:
        dispatch = self.broker.dispatch
        received = self._received
        for push in pushes:
            try:
                message = message_from_push(push)
            except RecordFormatError as exc:
                log.warning("dropped a malformed message pushed by a peer: %s", exc)
                continue
            self.stats.pushed_in += 1
            key = (message.stream, message.shard)
            kept = received.get(key)
            if kept is not None:
                kept.add(message.offset, message.publish_time_ms, record_of(push))
            groups = push.share_groups
            try:
                dispatch(message, frozenset(groups) if groups else NO_GROUPS)
            except Exception:  # noqa: BLE001 - one message's failure must not end the link
                log.exception("dispatching a message pushed by a peer failed")
            if kept is None and key in received:  # a durable subscription here just began
                received[key].add(message.offset, message.publish_time_ms, record_of(push))

    def _store_forwards(
        self, sequence: int, forwards: list[pb.Forward], answer: Callable[[pb.PeerReply], None]
    ) -> None:
        """Store the forwarded messages of one frame and answer it once all are stored."""
        outcomes = [pb.Outcome() for _ in forwards]
        waiting: dict[asyncio.Future[None], list[tuple[int, Message]]] = {}
        # the pass below, each commit group waited on, and each message waiting for the view
        remaining = [1]
        self._storing += 1

        def settled() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self._storing -= 1
                answer(pb.PeerReply(sequence=sequence, outcomes=outcomes))

        def landed(future: asyncio.Future[None]) -> None:
            failed = future.cancelled() or future.exception() is not None
            for index, message in waiting.pop(future):
                if failed:
                    outcomes[index].code = pb.FAILED
                    error = "cancelled" if future.cancelled() else future.exception()
                    outcomes[index].reason = f"the owner could not store the message: {error}"
                else:
                    outcomes[index].offset = message.offset
            settled()

        def later(index: int, message: Message, epoch: int) -> None:
            """The sender knew a newer shard map (or stream) than this node's view: stored
            (or refused) once the view has caught up."""
            remaining[0] += 1

            def again() -> None:
                future = self._store_forward(message, epoch, outcomes[index], None)
                if future is None:
                    settled()
                    return
                waiting.setdefault(future, []).append((index, message))
                if len(waiting[future]) == 1:
                    remaining[0] += 1
                    future.add_done_callback(landed)
                settled()

            def routed_here() -> bool:  # this node routes the topic to the sender's stream
                return self.broker.stream_for_topic(message.topic).name == message.stream

            self._after_epoch(message.stream, message.shard, epoch, again, routed_here)

        self.stats.forwarded_in += len(forwards)
        for index, forward in enumerate(forwards):
            try:
                message = message_from_forward(forward)
            except RecordFormatError as exc:
                outcomes[index].code = pb.REJECTED
                outcomes[index].reason = f"malformed forwarded message: {exc}"
                continue
            future = self._store_forward(message, forward.epoch, outcomes[index], later, index)
            if future is not None:
                entries = waiting.get(future)
                if entries is None:
                    entries = waiting[future] = []
                    remaining[0] += 1
                    future.add_done_callback(landed)
                entries.append((index, message))
        settled()

    def _store_forward(
        self, message: Message, epoch: int, outcome: pb.Outcome,
        later: Callable[[int, Message, int], None] | None, index: int = 0,
    ) -> asyncio.Future[None] | None:
        """Publish one forwarded message here, its owner; fill `outcome` (the offset, or why
        not). Returns the commit future to wait on, if any. With `later`, a message for a
        shard this node's view does not yet give it (the sender's epoch is newer) is handed
        to `later` instead."""
        broker, view = self.broker, self.view
        if self._stopping:
            outcome.code = pb.NOT_OWNER
            outcome.reason = f"node {self.node_id} is stopping; retry"
            return None
        try:
            stream = broker.stream_for_topic(message.topic)
            sent_for = message.stream
            if later is not None and sent_for and sent_for != stream.name:
                # the sender routes the topic to a stream this node does not (yet): one created
                # a moment ago whose definition or routes have not landed here. Wait for them
                # (bounded), as for a newer epoch
                later(index, message, epoch)
                return None
            shard = stream.shard_for(message.topic, message.key).index
            if not view.owns(stream.name, shard):
                assignment = view.owner(stream.name, shard)
                known = assignment.epoch if assignment is not None else 0
                if later is not None and epoch > known:
                    message.stream, message.shard = stream.name, shard
                    later(index, message, epoch)
                    return None
                outcome.code = pb.NOT_OWNER
                outcome.epoch = known
                outcome.reason = f"node {self.node_id} does not own {stream.name}/{shard} now; retry"
                return None
            # counted once, by the node its client published to
            future = broker.publish(message, counted=False)
        except PublishRejected as exc:
            outcome.code = pb.NOT_OWNER if isinstance(exc, ShardUnavailable) else pb.REJECTED
            outcome.reason = str(exc)
            return None
        except (CoreError, ValueError) as exc:  # a bad topic, say: this message only
            outcome.code = pb.REJECTED
            outcome.reason = str(exc)
            return None
        outcome.offset = message.offset
        return future
