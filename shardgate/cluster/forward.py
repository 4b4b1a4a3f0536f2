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

An owner can store a message before it knows what every other node's clients hold: it has just
joined (or restarted) and a peer's route set is still on its way over that peer's link, or a peer
dialed it before its own view lists that peer (no link to push on yet). Such a message is pushed
at once to the nodes whose routes are known, and held (`_Unrouted`) for the others: once a
node's whole route set arrives, and this node links to it, the held messages it wants are pushed
to it, in order, before anything stored later. Nothing is acknowledged later for it, as a push
never is. Bounded: a node whose routes do not come within `UNROUTED_WAIT_S` (or past
`MAX_UNROUTED` held messages), is given up on, counted as dropped pushes and told so
(`pushes_lost`: its durable cursors read this node's journal again), as for a full link.
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct
import time
from collections import deque
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from ..core.errors import CoreError, PublishRejected, ShardUnavailable
from ..core.records import encode_message
from ..core.subscriptions import Subscription, SubscriptionType
from ..proto import cluster_pb2 as pb
from ..storage.interfaces import LatencyHistogram
from .frames import (
    NO_GROUPS,
    RecordFormatError,
    body_of,
    message_from_forward,
    message_from_push,
    pack_records,
    push_frame,
    record_of,
    route_update,
    routes_from_update,
    unpack_records,
)
from .link import ClusterPortProtocol, LinkClient, LinkForgotten, LinkReplies, PeerEnded
from .link_auth import HANDSHAKE_TIMEOUT_S, CallAuthenticator, NodeCredentials
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
# A link's credit for pushes: past this many pushes queued or not answered, the publisher
# whose messages are pushed is held (back-pressure) until the peer has answered all but
# PUSH_LOW_WATER; a peer answers a frame once it dispatched its pushes, so a subscriber behind
# on the peer holds the publisher here, and QoS >= 1 pushes are not dropped.
PUSH_HIGH_WATER = 10_000
PUSH_LOW_WATER = 5_000
FRAME_MAX_MESSAGES = 2_000
FRAME_MAX_BYTES = 4 << 20
MAX_GRPC_MESSAGE = 512 << 20
DIAL_TIMEOUT_S = 5.0
# A peer silent for this long (frozen: SIGSTOP, a stalled VM) is given up on (see PeerSilent).
LINK_TIMEOUT_S = 3.0
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
# A message stored while some node's routes are not known here yet waits this long for them
# (see the module docstring); at most this many such messages are held.
UNROUTED_WAIT_S = 10.0
MAX_UNROUTED = MAX_PUSHES_QUEUED
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
    pushes_dropped: int = 0  # pushes dropped on a full or broken link, or for unknown routes
    frames_out: int = 0  # frames written to peers (each a batch of forwards and pushes)
    frames_in: int = 0  # frames received from peers
    # Write of a frame of forwards → the owner's answer, once per frame.
    forward_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


class PeerSilent(ConnectionError):
    """The peer said nothing (no reply, no heartbeat) for the link's timeout: it is frozen or
    cut off, though its connection may look open."""


class _Shared:
    """The one future of the QoS 0 publishes queued for a peer between two writes: nobody
    waits on them one by one (an MQTT QoS 0 publisher never looks; an AMQP transient publish
    with confirms is confirmed with its batch). It resolves once the owner has taken every
    one of them, and fails when the owner refused any (a retryable error: at least once)."""

    __slots__ = ("future", "pending", "error")

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future
        self.pending = 0
        self.error: PublishRejected | None = None

    def settle(self, count: int, error: PublishRejected | None = None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.pending -= count
        if self.pending <= 0 and not self.future.done():
            if self.error is None:
                self.future.set_result(None)
            else:
                _fail(self.future, self.error)


class _SentBatch:
    """A `ForwardBatch` written and not answered yet: its messages, and for each the future
    of its publisher (the `_Shared` of its write for an unacknowledged batch)."""

    __slots__ = ("messages", "waiters", "epoch", "unacknowledged")

    def __init__(self, messages: list[Message], waiters: list[asyncio.Future[None] | _Shared],
                 epoch: int, unacknowledged: bool) -> None:
        self.messages = messages
        self.waiters = waiters
        self.epoch = epoch
        self.unacknowledged = unacknowledged


class _Unrouted:
    """A message stored while the routes of `waiting` (nodes) were not known here: pushed to
    each of them that wants it once its routes are (`DataPlane._release_unrouted`). `groups`:
    the share groups it was given to already (or taken by here), never given again."""

    __slots__ = ("message", "waiting", "groups", "held_at")

    def __init__(self, message: Message, waiting: set[str], groups: set[str], held_at: float) -> None:
        self.message = message
        self.waiting = waiting
        self.groups = groups
        self.held_at = held_at


class _Sent:
    """A frame written to the peer and not answered yet: written again on a new stream of the
    same session after a break, until its answer comes."""

    __slots__ = ("frame", "batches", "forwarded", "pushes", "route_generation", "written_at")

    def __init__(
        self, frame: pb.PeerFrame, batches: list[_SentBatch], forwarded: int,
        pushes: int, route_generation: int,
    ) -> None:
        self.frame = frame
        self.batches = batches
        self.forwarded = forwarded  # messages in the batches
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
        # Publishes to forward: (message, epoch, its future or None, the shared future of
        # the QoS 0 ones or None).
        self._forwards: list[tuple[Message, int, asyncio.Future[None] | None, _Shared | None]] = []
        self._shared: _Shared | None = None
        # Stored messages to push, with the share groups chosen here for each.
        self._pushes: list[tuple[Message, tuple[str, ...]]] = []
        self._routes: list[pb.RouteUpdate] = []
        self._routes_generation = 0
        self._retained: list[pb.Retained] = []
        self._in_flight = 0  # forwards queued or not answered
        self._pushes_held = 0  # pushes queued or not answered
        # Whether this link holds publishers (over its credit, see PUSH_HIGH_WATER).
        self._over_credit = False
        # Pushes were dropped since the last frame: the next one says so (`pushes_lost`).
        self._pushes_lost = False
        # The last route generation of this node the peer has applied (SUBACK waits for it).
        self.routes_answered = 0
        # The peer's route generation this node applied, to tell the peer once every push
        # queued before it has left (`PeerFrame.routes_applied`); 0: nothing to tell.
        self._routes_mark = 0
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
        resolve when the message is re-routed after a refusal. A QoS 0 message gets the
        future it shares with the other QoS 0 messages of this write (see `_Shared`)."""
        if not self.reachable or self._in_flight >= MAX_FORWARDS_IN_FLIGHT:
            if future is None:
                future = self._loop.create_future()
            _fail(future, ShardUnavailable(
                f"node {self.node.node_id} owning {message.stream}/{message.shard} is unreachable"
                if not self.reachable else
                f"too many publishes waiting for node {self.node.node_id}; retry"
            ))
            self.plane.stats.forward_failures += 1
            return future
        self._in_flight += 1
        if not self._flush_scheduled:
            self._flush_soon()
        if future is None and not message.qos:
            shared = self._shared
            if shared is None:
                shared = self._shared = _Shared(self._loop.create_future())
            shared.pending += 1
            self._forwards.append((message, epoch, None, shared))
            return shared.future
        if future is None:
            future = self._loop.create_future()
        self._forwards.append((message, epoch, future, None))
        return future

    def push(self, message: Message, groups: tuple[str, ...] = ()) -> None:
        if self._pushes_held >= MAX_PUSHES_QUEUED or not self.reachable:
            self.plane.stats.pushes_dropped += 1
            self.plane.broker.stats.drop("cluster_link_full")
            self._lost_pushes()
            return
        self._pushes.append((message, groups))
        self._pushes_held += 1
        if self._pushes_held >= PUSH_HIGH_WATER:
            self._over_credit = True
            self.plane.broker.back_pressure.congested(self)
        if not self._flush_scheduled:
            self._flush_soon()

    def _credit_returned(self) -> None:
        if self._over_credit and self._pushes_held <= PUSH_LOW_WATER:
            self._over_credit = False
            self.plane.broker.back_pressure.relieved(self)

    def send_routes(self, update: pb.RouteUpdate, generation: int) -> None:
        self._routes.append(update)
        self._routes_generation = generation
        self._flush_soon()

    def mark_routes_applied(self, generation: int) -> None:
        """This node applied the peer's routes up to `generation`: say so on the frame that
        carries the last push queued before (the peer then knows none under its older routes
        is still on its way)."""
        if generation > self._routes_mark:
            self._routes_mark = generation
            self._flush_soon()

    def send_retained(self, retained: pb.Retained) -> None:
        self._retained.append(retained)
        self._flush_soon()

    def _lost_pushes(self) -> None:
        """Pushes to the peer were dropped: its durable cursors must read this node's journal
        again (told on the next frame, sent soon even when nothing else is queued)."""
        self._pushes_lost = True
        if not self._flush_scheduled:
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
        self._shared = None  # QoS 0 publishes from now on share another future
        stats = self.plane.stats
        while ((self._forwards or self._pushes or self._routes or self._retained or self._pushes_lost
                or self._routes_mark)
               and not connection.paused and not connection.closing):
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
                if (self.connected or self.reachable) and not self._closed:
                    # (a peer that stops ends its links in order: not a fault)
                    level = logging.INFO if isinstance(exc, PeerEnded) else logging.WARNING
                    log.log(level, "cluster link to %s lost: %s", self, _short(exc))
                # A stream that broke is resumed on the next (its frames are sent again), as is
                # one broken again while it opened; a peer that cannot be dialed twice in a row
                # is away: its clients get retryable errors.
                self._failed_dials = 0 if self.connected else self._failed_dials + 1
                # a silent peer is away (frozen): its clients get retryable errors at once
                was_reachable = self.reachable
                self.reachable = (self._failed_dials < 2 and not isinstance(exc, PeerSilent)
                                  and not self._closed)
                if was_reachable and not self.reachable and not self.connected:
                    self.plane.link_state_changed()  # SUBACKs stop waiting for it
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
        host = host.strip("[]")
        tls = self.plane.credentials.tls
        _transport, connection = await asyncio.wait_for(
            self._loop.create_connection(
                lambda: LinkClient(self._on_reply, self._flush_soon, self.plane.credentials,
                                   self.node.node_id),
                host, int(port),
                ssl=tls.client_context if tls is not None else None,
                server_hostname=tls.dial_name(host) if tls is not None else None),
            DIAL_TIMEOUT_S,
        )
        try:
            timeout = self.plane.link_timeout_s
            connection.send(pb.PeerFrame(
                sequence=0, from_node=self.plane.node_id, session=self.session,
                heartbeat_ms=round(timeout * 1000)))
            # A frozen peer's kernel accepts the connection: the link is up once the peer
            # itself answers the hello.
            await asyncio.wait((connection.answered, connection.closed), timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            if connection.closed.done():
                raise connection.closed.result()
            if not connection.answered.done():
                raise PeerSilent(f"no answer to the hello within {timeout:g} s")
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
            raise await self._watch(connection, timeout)
        finally:
            self._connection = None
            connection.close()

    async def _watch(self, connection: LinkClient, timeout: float) -> BaseException:
        """Wait for the connection to end, or for the peer to fall silent for `timeout` (it
        sends heartbeats while it has nothing else to say): what ended it."""
        closed = connection.closed
        while True:
            silent = connection.silent_for()
            if silent >= timeout:
                # (this node's own loop may have been the one stalled, with the peer's bytes
                # waiting in the socket: let them be read first)
                await asyncio.sleep(min(0.05, timeout / 10))
                silent = connection.silent_for()
                if silent >= timeout:
                    return PeerSilent(f"nothing heard from the peer for {silent:.1f} s")
            try:
                return await asyncio.wait_for(asyncio.shield(closed), timeout - silent)
            except TimeoutError:
                continue

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
        if self._pushes_lost:
            frame.pushes_lost = True
            self._pushes_lost = False
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
        batches: list[_SentBatch] = []
        if self._forwards:
            batches, count, size = self._take_batches(frame)
        pushes = 0
        if self._pushes and count < FRAME_MAX_MESSAGES:
            pushes = self._take_pushes(frame, count, size)
        if self._routes_mark and not self._pushes:
            frame.routes_applied = self._routes_mark
            self._routes_mark = 0
        forwarded = sum(len(batch.messages) for batch in batches)
        self._unanswered[sequence] = _Sent(frame, batches, forwarded, pushes, route_generation)
        return frame

    def _take_pushes(self, frame: pb.PeerFrame, count: int, size: int) -> int:
        """Move queued pushes (as many as the frame still holds) into `frame`, as one packed
        `PushBatch` per run of messages of one shard with the same share groups, in the
        queue's order. Returns how many."""
        runs: list[tuple[list[Message], tuple[str, ...]]] = []
        run_key: tuple[str, int, tuple[str, ...]] | None = None
        messages: list[Message] = []
        taken = 0
        for message, groups in self._pushes:
            if count >= FRAME_MAX_MESSAGES or (count and size >= FRAME_MAX_BYTES):
                break
            count += 1
            taken += 1
            size += len(message.payload) + len(message.topic)
            key = (message.stream, message.shard, groups)
            if key != run_key:
                run_key = key
                messages = []
                runs.append((messages, groups))
            messages.append(message)
        del self._pushes[:taken]
        for messages, groups in runs:
            first = messages[0]
            try:
                records = pack_records(messages)
            except (ValueError, OverflowError, struct.error):  # stored, so encodable; but safe
                log.exception("cluster: a stored message could not be packed for a push")
                continue
            frame.push_batches.add(
                stream=first.stream, shard=first.shard, records=records,
                offsets=[message.offset for message in messages], share_groups=groups,
            )
        return taken

    def _take_batches(self, frame: pb.PeerFrame) -> tuple[list[_SentBatch], int, int]:
        """Move the queued publishes (as many as a frame holds) into `frame`, as one packed
        `ForwardBatch` per run of messages to the same shard, epoch and acknowledgement; the
        runs keep the order of the queue. Returns the batches, the messages and their bytes."""
        batches: list[_SentBatch] = []
        count = size = 0
        run_key: tuple[str, int, int, bool, bool] | None = None
        messages: list[Message] = []
        waiters: list[asyncio.Future[None] | _Shared] = []
        for message, epoch, future, shared in self._forwards:
            if count >= FRAME_MAX_MESSAGES or (count and size >= FRAME_MAX_BYTES):
                break
            count += 1
            size += len(message.payload) + len(message.topic)
            key = (message.stream, message.shard, epoch, future is None, message.transient)
            if key != run_key:
                run_key = key
                messages, waiters = [], []
                batches.append(_SentBatch(messages, waiters, epoch, future is None))
            messages.append(message)
            waiters.append(future if future is not None else shared)  # type: ignore[arg-type]
        del self._forwards[:count]
        for batch in batches:
            first = batch.messages[0]
            try:
                records = pack_records(batch.messages)
            except (ValueError, OverflowError, struct.error):
                records = self._packable(batch)
            frame.batches.add(
                stream=first.stream, shard=first.shard, epoch=batch.epoch, records=records,
                unacknowledged=batch.unacknowledged, transient=first.transient,
            )
        return batches, count, size

    def _packable(self, batch: _SentBatch) -> bytes:
        """The records of the messages of `batch` that a record can hold; the others are
        refused here and leave the batch (a field too long for the record format, say)."""
        kept: list[Message] = []
        kept_waiters: list[asyncio.Future[None] | _Shared] = []
        for message, waiter in zip(batch.messages, batch.waiters, strict=True):
            try:
                pack_records((message,))
            except (ValueError, OverflowError, struct.error) as exc:
                self._in_flight -= 1
                self._settle_one(waiter, PublishRejected(f"the message cannot be forwarded: {exc}"))
                continue
            kept.append(message)
            kept_waiters.append(waiter)
        batch.messages[:] = kept
        batch.waiters[:] = kept_waiters
        return pack_records(kept)

    def _settle_one(self, waiter: asyncio.Future[None] | _Shared, error: PublishRejected | None) -> None:
        if error is not None:
            self.plane.stats.forward_failures += 1
        if isinstance(waiter, _Shared):
            waiter.settle(1, error)
        elif not waiter.done():
            if error is None:
                waiter.set_result(None)
            else:
                _fail(waiter, error)

    def _on_reply(self, reply: pb.PeerReply) -> None:
        """The peer answered a frame: settle its forwards (stored, re-routed or refused)."""
        sent = self._unanswered.pop(reply.sequence, None)
        if sent is None:
            return
        self._pushes_held -= sent.pushes
        if self._over_credit:
            self._credit_returned()
        if sent.route_generation > self.routes_answered:
            self.routes_answered = sent.route_generation
            self.plane.link_state_changed()
        if not sent.batches:
            return
        self.plane.stats.forward_latency.observe(time.perf_counter() - sent.written_at)
        self._in_flight -= sent.forwarded
        results = reply.batches
        for index, batch in enumerate(sent.batches):
            self._settle_batch(batch, results[index] if index < len(results) else None)

    def _settle_batch(self, batch: _SentBatch, result: pb.BatchOutcome | None) -> None:
        """The owner answered a batch: resolve its publishers' futures (stored), re-route the
        messages it did not own, fail the ones it refused."""
        messages, waiters = batch.messages, batch.waiters
        if result is None:  # the owner answered the frame without this batch
            for waiter in waiters:
                self._settle_one(waiter, _refusal(self.node.node_id, None))
            return
        refused: dict[int, pb.Outcome] = {}
        if result.refused:
            refused = {outcome.index: outcome for outcome in result.refused}
        if batch.unacknowledged:
            if not refused and waiters:
                # the common case: every message taken; count them down per shared future
                first = waiters[0]
                if waiters[-1] is first:
                    first.settle(len(waiters))  # type: ignore[union-attr]
                    return
            for index, waiter in enumerate(waiters):
                outcome = refused.get(index) if refused else None
                if outcome is None:
                    waiter.settle(1)  # type: ignore[union-attr]
                elif self._rerouted(messages[index], None, batch.epoch, outcome):
                    waiter.settle(1)  # type: ignore[union-attr]
                else:
                    self._settle_one(waiter, _refusal(self.node.node_id, outcome))
            return
        offsets = list(result.offsets)
        known = len(offsets)
        for index, message in enumerate(messages):
            future = waiters[index]
            if future.done():  # type: ignore[union-attr]
                continue
            outcome = refused.get(index) if refused else None
            if outcome is None and index < known:
                message.offset = offsets[index]
                future.set_result(None)  # type: ignore[union-attr]
            elif outcome is None or not self._rerouted(message, future, batch.epoch, outcome):  # type: ignore[arg-type]
                self._settle_one(future, _refusal(self.node.node_id, outcome))

    def _rerouted(self, message: Message, future: asyncio.Future[None] | None, epoch: int,
                  outcome: pb.Outcome) -> bool:
        """Send a message the owner refused as not its own where the shard is now, when the
        view has moved on (see `DataPlane.reroute`)."""
        if outcome.code != pb.NOT_OWNER:
            return False
        if future is None:  # a QoS 0 message: its own future, which nobody waits on
            future = self._loop.create_future()
            future.add_done_callback(_seen)
        return self.plane.reroute(message, future, epoch, outcome.epoch)

    def _fail_all(self, error: PublishRejected) -> None:
        """Fail every forward not yet answered and drop the pushes: the owner may or may not
        have stored them, so the clients get a retryable error (at least once, never
        acknowledged and lost). Used when the peer is away, not when a stream merely broke."""
        waiters: list[asyncio.Future[None] | _Shared] = [
            future if future is not None else shared  # type: ignore[misc]
            for _message, _epoch, future, shared in self._forwards
        ]
        dropped = len(self._pushes)
        lost = False
        for sent in self._unanswered.values():
            for batch in sent.batches:
                waiters += batch.waiters
            dropped += sent.pushes
            lost = lost or sent.frame.pushes_lost
        self._forwards = []
        self._shared = None
        self._unanswered = {}
        self._answered_floor = self._next_sequence
        self._in_flight = 0
        self._pushes = []
        self._pushes_held = 0
        self._credit_returned()
        self.plane.stats.pushes_dropped += dropped
        if dropped or lost:
            self._lost_pushes()
        for waiter in waiters:
            self._settle_one(waiter, error)


def _filters_of(sub: Subscription) -> Callable[[], Sequence[str]]:
    """The topic filters `sub` has when called (they change while a cursor reads)."""
    return lambda: list(sub.filters)


def _seen(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


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


class _Batch:
    """What the receiving owner answers for one `ForwardBatch`: each message's offset (an
    acknowledged batch) and the messages it refused."""

    __slots__ = ("offsets", "refused", "pending", "acknowledged")

    def __init__(self, unacknowledged: bool) -> None:
        self.acknowledged = not unacknowledged
        self.offsets: list[int] = []
        self.refused: list[pb.Outcome] = []
        # outcomes of the messages stored one by one, read when the answer is made
        self.pending: list[pb.Outcome] = []

    def size(self, count: int) -> None:
        if self.acknowledged:
            self.offsets = [-1] * count

    def stored(self, index: int, offset: int) -> None:
        if self.acknowledged:
            self.offsets[index] = offset

    def refuse(self, index: int, code: int, reason: str) -> None:
        self.refused.append(pb.Outcome(code=code, reason=reason, index=index))  # type: ignore[arg-type]

    def slow(self, index: int) -> pb.Outcome:
        outcome = pb.Outcome(index=index)
        self.pending.append(outcome)
        return outcome

    def outcome(self) -> pb.BatchOutcome:
        refused = self.refused
        for outcome in self.pending:
            if outcome.code == pb.STORED:
                self.stored(outcome.index, outcome.offset)
            else:
                refused.append(outcome)
        self.pending = []
        return pb.BatchOutcome(offsets=self.offsets, refused=refused)


class _Inbox:
    """What this node applied of one peer's link session: the highest frame applied (frames of
    a session are applied once, in order), and its answers the peer may not have received yet
    (sent again when the peer sends their frame again on a new stream)."""

    __slots__ = ("session", "applied", "answers", "reply", "_forgotten_below", "publisher",
                 "backlog")

    def __init__(self, session: int) -> None:
        self.session = session
        self.applied = 0
        self.answers: dict[int, pb.PeerReply] = {}
        self._forgotten_below = 1
        # Where answers go now: the session's current stream (None between streams).
        self.reply: Callable[[pb.PeerReply], None] | None = None
        # The peer as a publisher (back-pressure): held while its pushes fill a queue here;
        # what it sent meanwhile waits in `backlog`, applied in order once it is released.
        self.publisher = _PeerPushes(self)
        self.backlog: deque[Callable[[], None]] = deque()

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


class _PeerPushes:
    """A peer's link session as a publisher (`core.backpressure.Publisher`): holding it stops
    reading its link (TCP holds the peer, whose own publishers are then held by their link's
    credit, `PUSH_HIGH_WATER`) and keeps the rest of what was read for later."""

    __slots__ = ("inbox", "held", "on_release")

    def __init__(self, inbox: _Inbox) -> None:
        self.inbox = inbox
        self.held = False
        # applies the inbox's backlog (set by the data plane)
        self.on_release: Callable[[_Inbox], None] | None = None

    def hold(self) -> None:
        self.held = True
        self.pause()

    def pause(self) -> None:
        reply = self.inbox.reply
        if isinstance(reply, LinkReplies):
            reply.pause_reading()

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        reply = self.inbox.reply
        if isinstance(reply, LinkReplies):
            reply.resume_reading()
        if self.on_release is not None:
            self.on_release(self.inbox)


class DataPlane:
    """Forwarding, fanout and the route table of one node (see the module docstring)."""

    def __init__(
        self,
        broker: Broker,
        view: ClusterView,
        host: str = "127.0.0.1",
        port: int = 0,
        route_debounce_s: float = ROUTE_DEBOUNCE_S,
        link_timeout_s: float = LINK_TIMEOUT_S,
        credentials: NodeCredentials | None = None,
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
        self.route_debounce_s = route_debounce_s
        self.stats = DataPlaneStats()
        self.remote = RemoteRoutes()
        self.links: dict[str, PeerLink] = {}
        # (stream, shard) -> the link to its owner and the owner's epoch, as the view said
        # when last asked; forgotten at every change of the view (and every RECONCILE_S). A
        # stale entry is safe: the owner refuses what it does not own, and the sender re-routes.
        self._forward_routes: dict[tuple[str, int], tuple[PeerLink, int]] = {}
        self._advertised: set[Route] = set()
        self._flush_handle: asyncio.Handle | None = None
        self._last_flush = 0.0
        self._turns: dict[str, int] = {}
        # What this node applied of each peer's link session.
        self._inboxes: dict[str, _Inbox] = {}
        # Bumped by every route update sent; each link knows the last its peer applied.
        self.route_generation = 0
        self._route_waiters: list[tuple[int, asyncio.Future[None]]] = []
        # Per peer: the highest route generation of this node it had applied before the pushes
        # of the frames from it applied so far (`PeerFrame.routes_applied`), and who waits.
        self._pushes_under: dict[str, int] = {}
        self._push_waiters: list[tuple[int, asyncio.Future[None]]] = []
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
        # Peers whose whole route set this node applied in their current link session.
        self._routes_known: set[str] = set()
        # Peers a stored message cannot be routed to yet: in the view with their routes not
        # known, or with routes known and no link to push on. Empty in a steady cluster.
        self._unknown: frozenset[str] = frozenset()
        # Messages stored meanwhile, oldest first, held for those peers (see `_Unrouted`).
        self._unrouted: deque[_Unrouted] = deque()
        self._unrouted_timer: asyncio.TimerHandle | None = None

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
        try:
            tls = self.credentials.tls
            self._listener = await asyncio.get_running_loop().create_server(
                lambda: ClusterPortProtocol(self, ("127.0.0.1", grpc_port), self._connections,
                                            self.credentials, self.registered),
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
            self._storing or self._unrouted
            or any(link.holding for link in self.links.values() if link.connected)
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
        if self._unrouted_timer is not None:
            self._unrouted_timer.cancel()
            self._unrouted_timer = None
        self._unrouted.clear()
        self._unknown = frozenset()
        links, self.links = list(self.links.values()), {}
        self._forward_routes.clear()
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
        while self._started:
            await asyncio.sleep(RECONCILE_S)
            try:
                self._view_changed()
            except Exception:  # noqa: BLE001 - retried on the next round
                log.exception("cluster: checking the links against the view failed")

    def _view_changed(self) -> None:
        """Dial new peers, drop the links and routes of nodes that left or moved."""
        self._forward_routes.clear()
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
                    self._routes_known.discard(node_id)
                    # (its inbox stays: a node that comes back with the same link session
                    # sends again what it had no answer to, and what this node applied of it
                    # already must be answered, not stored twice; a restart brings a new session)
                    self._end_links_from(node_id)
                    self._read_owner_again(node_id)
                self.link_state_changed()
        for node_id, info in nodes.items():
            if node_id != self.node_id and node_id not in self.links:
                self.links[node_id] = PeerLink(self, info)
        self._refresh_unknown()
        self._repoint_cursors()

    def _end_links_from(self, node_id: str) -> None:
        """End the streams `node_id` opened to this node: its routes were forgotten with it (a
        node frozen past its lease leaves the view, and its stream may stay open), so it
        dials again and sends what this node did not answer, and its routes, on a new one."""
        for connection in list(self._connections):
            if connection.peer == node_id:
                connection.close()

    def _read_owner_again(self, node_id: str) -> None:
        """`node_id` left the view (its lease expired), started a new link session, or said
        it dropped pushes meant for this node: what it stored but did not push here never
        will be, so durable cursors following the pushes of its shards read its journal from
        their positions once it is back (`shard_reader.OwnerLog`), then the pushes again. Its
        reliable shards stay its own meanwhile (their log is on its disk)."""
        from ..core.durable import DurableSubscription

        reader = self.owner_reader
        if reader is None:
            return
        for sub in self.broker.subscriptions.values():
            if not isinstance(sub, DurableSubscription):
                continue
            moved = False
            for (stream, shard), cursor in sub.cursors.items():
                # (an OwnerLog past its hand-off follows the pushes too)
                if not (isinstance(cursor.log, ReceivedLog) or getattr(cursor.log, "remote_shard", False)):
                    continue
                assignment = self.view.leader(stream, shard)
                if assignment is None or assignment.leader != node_id:
                    continue
                cursor.log = reader(stream, shard, cursor.position, _filters_of(sub), None)
                cursor.live = False
                cursor.ahead = []
                moved = True
            if moved:
                sub.schedule_pump()

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
                assignment = view.leader(stream, shard)
                if assignment is None:
                    continue
                # (an OwnerLog of cluster.shard_reader also reads a shard another node owns)
                received = isinstance(cursor.log, ReceivedLog) or getattr(cursor.log, "remote_shard", False)
                if assignment.leader != self.node_id and not received:
                    cursor.log = self.received_log(stream, shard)
                elif assignment.leader == self.node_id and received:
                    local = broker.streams.get(stream)
                    if local is not None and shard < len(local.shards) and local.shards[shard].log:
                        cursor.log = local.shards[shard].log

    # ------------------------------------------------------------ ShardPlacement
    def serves(self, stream: str, shard: int) -> bool:
        return stream in NODE_LOCAL_STREAMS or self.view.leads(stream, shard)

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
        route = self._forward_routes.get((message.stream, message.shard))
        if route is not None:
            self.stats.forwarded += 1
            return route[0].forward(message, route[1])
        assignment = self.view.leader(message.stream, message.shard)
        link = None
        if assignment is not None and assignment.leader != self.node_id:
            link = self.links.get(assignment.leader)
        if link is None:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if assignment is None:
                reason = f"no node owns {message.stream}/{message.shard} now; retry"
            elif assignment.leader == self.node_id:
                reason = f"this node cannot prove it owns {message.stream}/{message.shard} now; retry"
            else:
                reason = f"node {assignment.leader} owning {message.stream}/{message.shard} is not live"
            _fail(future, ShardUnavailable(reason))
            self.stats.forward_failures += 1
            return future
        self.stats.forwarded += 1
        self._forward_routes[(message.stream, message.shard)] = (link, assignment.leader_epoch)  # type: ignore[union-attr]
        return link.forward(message, assignment.leader_epoch)  # type: ignore[union-attr]

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
        assignment = self.view.leader(message.stream, message.shard)
        if assignment is None or assignment.leader_epoch <= refused_epoch:
            return False
        if assignment.leader == self.node_id:
            if not self.view.leads(message.stream, message.shard):
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
        link = self.links.get(assignment.leader)
        if link is None:
            return False
        link.forward(message, assignment.leader_epoch, future)
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
            assignment = view.leader(stream, shard)
            if now >= deadline or (
                assignment is not None and assignment.leader_epoch >= epoch and (ready is None or ready())
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
        unknown = self._unknown
        if message.stream in NODE_LOCAL_STREAMS:
            return None
        if interest is NOBODY:
            if unknown:
                self._hold_unrouted(message, local, ())
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
        links = self.links
        given: list[str] = []
        for node_id, groups in targets.items():
            link = links.get(node_id)
            if link is not None and node_id not in unknown:
                link.push(message, tuple(groups))
                self.stats.pushed += 1
                given += groups
        if unknown:
            self._hold_unrouted(message, local, given)
        return allowed

    def wanted_elsewhere(self, topic: str) -> bool:
        return self.remote.lookup(topic) is not NOBODY

    def wanted_durably_elsewhere(self, topic: str) -> bool:
        # (a node whose routes are not known yet may hold a durable subscription: journaled)
        return bool(self._unknown) or self.remote.lookup(topic).durable

    # ------------------------------------------------------------ routes not known yet
    def unrouted_held(self) -> int:
        """How many stored messages wait for some node's routes (see `_Unrouted`)."""
        return len(self._unrouted)

    def _refresh_unknown(self) -> None:
        """Work out which peers a stored message cannot be routed to yet (see `_unknown`), and
        push the held messages to those that can be now."""
        nodes = self.view.nodes() if self._started else {}
        known, links = self._routes_known, self.links
        unknown = frozenset(
            [node for node in nodes if node != self.node_id and node not in known]
            + [node for node in known if node not in links]
        )
        if unknown == self._unknown:
            return
        before, self._unknown = self._unknown, unknown
        if self._unrouted and before - unknown:
            self._release_unrouted()

    def _hold_unrouted(self, message: Message, local: list[tuple[Subscription, tuple[str, ...]]],
                       given: Sequence[str]) -> None:
        """Hold `message` for the peers whose routes are not known yet. The share groups
        matched here, and those given to a known node, are not given again."""
        groups = {sub.name for sub, _ in local if sub.type is SubscriptionType.SHARED}
        groups.update(given)
        unrouted = self._unrouted
        if len(unrouted) >= MAX_UNROUTED:
            self._give_up(max(1, MAX_UNROUTED // 10))  # (a tenth at once: one warning each)
        unrouted.append(_Unrouted(message, set(self._unknown), groups, time.monotonic()))
        if self._unrouted_timer is None:
            self._unrouted_timer = asyncio.get_running_loop().call_later(
                UNROUTED_WAIT_S, self._give_up_late)

    def _release_unrouted(self) -> None:
        """Push each held message to every peer it waits for that is no longer unknown and
        wants it (oldest first, so before anything stored after); forget the peers that left."""
        unknown, links, lookup = self._unknown, self.links, self.remote.lookup
        kept: deque[_Unrouted] = deque()
        for held in self._unrouted:
            ready = [node for node in held.waiting if node not in unknown]
            for node in ready:
                held.waiting.discard(node)
                link = links.get(node)
                if link is None:
                    continue  # it left the view: its routes went with it
                interest = lookup(held.message.topic)
                groups = tuple(sorted(
                    group for group, members in interest.groups.items()
                    if group not in held.groups and any(member == node for member, _ in members)
                ))
                if node in interest.plain or groups:
                    link.push(held.message, groups)
                    self.stats.pushed += 1
                    held.groups.update(groups)
            if held.waiting:
                kept.append(held)
        self._unrouted = kept
        if not kept and self._unrouted_timer is not None:
            self._unrouted_timer.cancel()
            self._unrouted_timer = None

    def _give_up_late(self) -> None:
        """Give up the held messages older than UNROUTED_WAIT_S; look again when the next is."""
        self._unrouted_timer = None
        unrouted = self._unrouted
        limit = time.monotonic() - UNROUTED_WAIT_S
        late = 0
        while late < len(unrouted) and unrouted[late].held_at <= limit:
            late += 1
        if late:
            self._give_up(late)
        if unrouted:
            self._unrouted_timer = asyncio.get_running_loop().call_later(
                max(0.0, unrouted[0].held_at + UNROUTED_WAIT_S - time.monotonic()), self._give_up_late)

    def _give_up(self, count: int) -> None:
        """Drop the `count` oldest held messages, counted as pushes dropped for each node they
        waited for; those nodes are told (their durable cursors read this journal again)."""
        unrouted = self._unrouted
        nodes: dict[str, int] = {}
        for _ in range(min(count, len(unrouted))):
            for node in unrouted.popleft().waiting:
                nodes[node] = nodes.get(node, 0) + 1
        for node, dropped in nodes.items():
            self.stats.pushes_dropped += dropped
            self.broker.stats.drop("cluster_routes_unknown", dropped)
            link = self.links.get(node)
            if link is not None:
                link._lost_pushes()
            log.warning("cluster: the routes of node %s did not reach this node in time; %d "
                        "messages stored meanwhile were not pushed to it", node, dropped)

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
        update = route_update(RouteDelta(sorted(self._advertised), []), reset=True)
        update.generation = self.route_generation
        return update

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
        update.generation = self.route_generation
        for link in self.links.values():
            link.send_routes(update, self.route_generation)

    def routes_ready(self) -> asyncio.Future[None] | None:
        """None when every peer in the view has applied this node's routes as they are now
        (subscriptions made so far); else a future that resolves once they have, or after
        ROUTE_WAIT_S (a slow peer). A peer whose link is still dialing (a node just joined or
        restarted) is waited for too, as it may own a shard and store for the subscription
        before it knows of it; a peer found away (two failed dials, or silent) is not: it gets
        the whole route set when its link comes back."""
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
        return all(link.routes_answered >= target for link in self.links.values()
                   if link.connected or link.reachable)

    def pushes_settled(self) -> asyncio.Future[None] | None:
        """None when every peer this node is linked to has applied its routes as they are now
        and every push it chose this node for under older routes has arrived here and been
        dispatched; else a future that resolves once so (each peer says so on its own link,
        behind its pushes: `PeerFrame.routes_applied`), or after ROUTE_WAIT_S (a slow peer)."""
        target = self.route_generation + (1 if self._flush_handle is not None else 0)
        if self._pushes_reached(target):
            return None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._push_waiters.append((target, future))
        loop.call_later(ROUTE_WAIT_S, _resolve, future)
        return future

    def _pushes_reached(self, target: int) -> bool:
        if self._flush_handle is None:
            target = min(target, self.route_generation)
        under = self._pushes_under
        return all(under.get(peer, 0) >= target for peer, link in self.links.items() if link.connected)

    def _settle_push_waiters(self) -> None:
        waiting = []
        for target, future in self._push_waiters:
            if future.done():
                continue
            if self._pushes_reached(target):
                future.set_result(None)
            else:
                waiting.append((target, future))
        self._push_waiters = waiting

    def link_state_changed(self) -> None:
        """A link came up, went down, or its peer applied routes: settle the route waiters."""
        if self._push_waiters:
            self._settle_push_waiters()
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
            if self.view.leads(stream.name, stream.shard_for(topic, message.key).index):
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
            if inbox is not None:
                # A new session (the peer restarted, or dropped its link to this node when
                # this node left its view): what the old one had not pushed here never will
                # be. (The first session a peer opens to this process needs nothing: cursors
                # restored at start read the owners' journals from their saved floors,
                # `sessions.replay_restored`.)
                self._read_owner_again(peer)
                # its routes are those of its old session until the new one's arrive: what is
                # stored meanwhile waits for them
                self.remote.forget(peer)
                self._routes_known.discard(peer)
                self._refresh_unknown()
            self._pushes_under.pop(peer, None)  # a new session tells again
            if inbox is not None:
                inbox.backlog.clear()
                inbox.publisher.release()
            inbox = self._inboxes[peer] = _Inbox(session)
            inbox.publisher.on_release = self._apply_backlog
        inbox.reply = reply
        if inbox.publisher.held:
            inbox.publisher.pause()  # a new stream of a held session: held too

    def receive(self, peer: str, frame: pb.PeerFrame, reply: Callable[[pb.PeerReply], None]) -> None:
        """Apply one frame from `peer` once per session: routes, then retained messages, then
        pushes, then forwards; answered once every forward is stored (at once without any)."""
        inbox = self._inboxes.get(peer)
        if inbox is None:
            # this node forgot the session (the peer left the view): its frames would never be
            # answered on this stream, so it ends, and the peer resumes on a new one
            raise LinkForgotten(f"node {peer} left the view; its link session starts again")
        if inbox.reply is not reply:
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
        if inbox.backlog or inbox.publisher.held:
            # held: applied in order after what waits already (`_apply_backlog`)
            inbox.backlog.append(lambda: self._apply_frame(peer, inbox, frame))
            return
        self._apply_frame(peer, inbox, frame)

    def _apply_backlog(self, inbox: _Inbox) -> None:
        """A held peer was released: apply what it sent meanwhile, until it is held again."""
        backlog = inbox.backlog  # (cleared when a new session replaces the inbox)
        while backlog and not inbox.publisher.held:
            backlog.popleft()()

    def _apply_frame(self, peer: str, inbox: _Inbox, frame: pb.PeerFrame) -> None:
        """Apply one frame: routes, retained messages, pushes, then (`_frame_tail`) the rest."""
        if frame.HasField("routes"):
            update = frame.routes
            delta = routes_from_update(update)
            if update.reset:
                self.remote.reset(peer, delta.added)
                if peer not in self._routes_known:
                    self._routes_known.add(peer)
                    # (the held messages it wants go before the answer below says so)
                    self._refresh_unknown()
            else:
                self.remote.apply(peer, delta)
            if update.generation:
                # what this node pushes from now on follows them: tell the peer behind what
                # it pushed before (`pushes_settled` on its side)
                back = self.links.get(peer)
                if back is not None:
                    back.mark_routes_applied(update.generation)
        if frame.retained:
            self._apply_retained(frame.retained)
        if frame.pushes_lost:
            # before this frame's pushes move the cursors past what was lost
            self._read_owner_again(peer)
        pushed: deque[tuple[Message, frozenset[str], bytes | None]] = deque()
        if frame.pushes:
            self._decode_pushes(frame.pushes, pushed)
        if frame.push_batches:
            self._decode_push_batches(frame.push_batches, pushed)
        if pushed:
            self._dispatch_pushed(inbox, pushed, lambda: self._frame_tail(peer, inbox, frame))
        else:
            self._frame_tail(peer, inbox, frame)

    def _frame_tail(self, peer: str, inbox: _Inbox, frame: pb.PeerFrame) -> None:
        """What a frame says after its pushes (applied once they all are)."""
        sequence = frame.sequence
        if frame.routes_applied > self._pushes_under.get(peer, 0):
            self._pushes_under[peer] = frame.routes_applied
            if self._push_waiters:
                self._settle_push_waiters()
        if frame.forwards or frame.batches:
            self._store_forwards(sequence, frame.forwards, frame.batches, inbox.answer)
        else:
            inbox.answer(pb.PeerReply(sequence=sequence))

    def peer_link_ended(self, peer: str, reply: Callable[[pb.PeerReply], None]) -> None:
        """A stream from `peer` ended. Its routes stay: the peer resumes its session on a new
        stream, and a node that is gone leaves the view, which forgets them."""
        inbox = self._inboxes.get(peer)
        if inbox is not None and inbox.reply is reply:
            inbox.reply = None

    def _decode_pushes(self, pushes: Sequence[pb.Push],
                       out: deque[tuple[Message, frozenset[str], bytes | None]]) -> None:
        for push in pushes:
            try:
                message = message_from_push(push)
            except RecordFormatError as exc:
                log.warning("dropped a malformed message pushed by a peer: %s", exc)
                continue
            groups = push.share_groups
            out.append((message, frozenset(groups) if groups else NO_GROUPS, record_of(push)))

    def _decode_push_batches(self, batches: Sequence[pb.PushBatch],
                             out: deque[tuple[Message, frozenset[str], bytes | None]]) -> None:
        for batch in batches:
            stream, shard = batch.stream, batch.shard
            items = unpack_records(batch.records, stream, shard)
            offsets = batch.offsets
            if len(offsets) != len(items):
                log.warning("dropped a malformed batch of messages pushed by a peer: %d offsets "
                            "for %d messages", len(offsets), len(items))
                continue
            groups = frozenset(batch.share_groups) if batch.share_groups else NO_GROUPS
            for item, offset in zip(items, offsets, strict=True):
                if isinstance(item, RecordFormatError):
                    log.warning("dropped a malformed message pushed by a peer: %s", item)
                    continue
                item.offset = offset
                out.append((item, groups, None))

    def _dispatch_pushed(self, inbox: _Inbox,
                         pending: deque[tuple[Message, frozenset[str], bytes | None]],
                         then: Callable[[], None]) -> None:
        """Dispatch pushed messages in order, the peer being the current publisher: when a
        queue here fills up and holds it, the rest (and `then`) waits in its backlog."""
        dispatch = self.broker.dispatch
        received = self._received
        publisher = inbox.publisher
        with self.broker.back_pressure.publishing(publisher):
            while pending:
                if publisher.held:
                    inbox.backlog.appendleft(then)
                    inbox.backlog.appendleft(lambda: self._dispatch_pushed(inbox, pending, then))
                    return
                message, groups, record = pending.popleft()
                self.stats.pushed_in += 1
                key = (message.stream, message.shard)
                kept = received.get(key)
                if kept is not None:
                    kept.add(message.offset, message.publish_time_ms,
                             record if record is not None else encode_message(message))
                try:
                    dispatch(message, groups)
                except Exception:  # noqa: BLE001 - one message's failure must not end the link
                    log.exception("dispatching a message pushed by a peer failed")
                if kept is None and key in received:  # a durable subscription here just began
                    received[key].add(message.offset, message.publish_time_ms,
                                      record if record is not None else encode_message(message))
        then()

    def _store_forwards(
        self, sequence: int, forwards: Sequence[pb.Forward], batches: Sequence[pb.ForwardBatch],
        answer: Callable[[pb.PeerReply], None],
    ) -> None:
        """Store the forwarded messages of one frame and answer it once all are stored (an
        unacknowledged batch once its messages are published)."""
        outcomes = [pb.Outcome() for _ in forwards]
        # commit future -> the outcomes of the messages it stores
        waiting: dict[asyncio.Future[None], list[tuple[pb.Outcome, Message]]] = {}
        # commit future -> (batch, indices) of the batch messages it stores
        waiting_batches: dict[asyncio.Future[None], list[tuple[_Batch, list[int]]]] = {}
        # the pass below, each commit future waited on, and each message waiting for the view
        remaining = [1]
        self._storing += 1
        results: list[_Batch] = []

        def settled() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self._storing -= 1
                answer(pb.PeerReply(sequence=sequence, outcomes=outcomes,
                                    batches=[result.outcome() for result in results]))

        def landed(future: asyncio.Future[None]) -> None:
            failed = future.cancelled() or future.exception() is not None
            error = ("cancelled" if future.cancelled() else future.exception()) if failed else None
            for outcome, message in waiting.pop(future, ()):
                if failed:
                    outcome.code = pb.FAILED
                    outcome.reason = f"the owner could not store the message: {error}"
                else:
                    outcome.offset = message.offset
            if failed:
                for batch, indices in waiting_batches.pop(future, ()):
                    for index in indices:
                        batch.refuse(index, pb.FAILED, f"the owner could not store the message: {error}")
            settled()

        def wait_for(future: asyncio.Future[None]) -> None:
            if future not in waiting and future not in waiting_batches:
                remaining[0] += 1
                future.add_done_callback(landed)

        def later(outcome: pb.Outcome, message: Message, epoch: int) -> None:
            """The sender knew a newer shard map (or stream) than this node's view: stored
            (or refused) once the view has caught up."""
            remaining[0] += 1

            def again() -> None:
                future = self._store_forward(message, epoch, outcome, None)
                if future is not None:
                    wait_for(future)
                    waiting.setdefault(future, []).append((outcome, message))
                settled()

            def routed_here() -> bool:  # this node routes the topic to the sender's stream
                return self.broker.stream_for_topic(message.topic).name == message.stream

            self._after_epoch(message.stream, message.shard, epoch, again, routed_here)

        def one(message: Message, epoch: int, outcome: pb.Outcome, wait: bool = True) -> None:
            future = self._store_forward(message, epoch, outcome, later)
            if future is not None and wait:
                wait_for(future)
                waiting.setdefault(future, []).append((outcome, message))

        self.stats.forwarded_in += len(forwards)
        for index, forward in enumerate(forwards):
            try:
                message = message_from_forward(forward)
            except RecordFormatError as exc:
                outcomes[index].code = pb.REJECTED
                outcomes[index].reason = f"malformed forwarded message: {exc}"
                continue
            one(message, forward.epoch, outcomes[index])
        for batch in batches:
            result = _Batch(batch.unacknowledged)
            results.append(result)
            self._store_batch(batch, result, one, waiting_batches, wait_for)
        settled()

    def _store_batch(
        self, batch: pb.ForwardBatch, result: _Batch,
        one: Callable[[Message, int, pb.Outcome, bool], None],
        waiting: dict[asyncio.Future[None], list[tuple[_Batch, list[int]]]],
        wait_for: Callable[[asyncio.Future[None]], None],
    ) -> None:
        """Publish the messages of one packed batch here, their shard's owner: the messages
        this node routes to the batch's shard, while it owns it, as one `publish_many` (one
        journal append); any other one by one, as a lone forward is (`_store_forward`)."""
        stream_name, shard, epoch = batch.stream, batch.shard, batch.epoch
        items = unpack_records(batch.records, stream_name, shard)
        self.stats.forwarded_in += len(items)
        acknowledged = not batch.unacknowledged
        result.size(len(items))
        broker = self.broker
        owned = not self._stopping and self.view.leads(stream_name, shard)
        # topic -> whether this node routes it to the batch's shard (messages without a key)
        here: dict[str, bool] = {}
        direct: list[Message] = []
        direct_indices: list[int] = []
        for index, item in enumerate(items):
            if isinstance(item, RecordFormatError):
                result.refuse(index, pb.REJECTED, f"malformed forwarded message: {item}")
                continue
            if batch.transient:
                item.transient = True
            routed = here.get(item.topic) if item.key is None else None
            if routed is None:
                try:
                    stream = broker.stream_for_topic(item.topic)
                    routed = (stream.name == stream_name
                              and stream.shard_for(item.topic, item.key).index == shard)
                except (CoreError, ValueError):
                    routed = False
                if item.key is None:
                    here[item.topic] = routed
            if owned and routed:
                direct.append(item)
                direct_indices.append(index)
            else:
                one(item, epoch, result.slow(index), acknowledged)
        if not direct:
            return
        # counted once, by the node its client published to
        outcomes = broker.publish_many(direct, counted=False)
        commits: dict[asyncio.Future[None], list[int]] = {}
        for index, message, published in zip(direct_indices, direct, outcomes, strict=True):
            if published is None:
                result.stored(index, message.offset)
            elif isinstance(published, PublishRejected):
                code = pb.NOT_OWNER if isinstance(published, ShardUnavailable) else pb.REJECTED
                result.refuse(index, code, str(published))
            else:
                result.stored(index, message.offset)
                if acknowledged:
                    indices = commits.get(published)
                    if indices is None:
                        indices = commits[published] = []
                    indices.append(index)
        for future, indices in commits.items():
            wait_for(future)
            waiting.setdefault(future, []).append((result, indices))

    def _store_forward(
        self, message: Message, epoch: int, outcome: pb.Outcome,
        later: Callable[[pb.Outcome, Message, int], None] | None,
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
                later(outcome, message, epoch)
                return None
            shard = stream.shard_for(message.topic, message.key).index
            if not view.leads(stream.name, shard):
                assignment = view.leader(stream.name, shard)
                known = assignment.leader_epoch if assignment is not None else 0
                if later is not None and epoch > known:
                    message.stream, message.shard = stream.name, shard
                    later(outcome, message, epoch)
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
