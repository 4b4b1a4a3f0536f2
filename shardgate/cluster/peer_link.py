"""This node's outgoing link to one peer (`PeerLink`): the forwarded publishes and pushes it
queues, the frames it writes, and the link session it keeps across broken connections.

A link is a TCP connection carrying numbered frames (`proto/cluster.proto`, framed by
`link.py`). It writes everything queued during one loop turn as one frame, at the end of that
turn (no timer, no task and no await per message); while the peer is behind reading, the
transport pauses and messages gather into bigger frames (`outbox.py` packs them). It is
bounded: past `MAX_FORWARDS_IN_FLIGHT` forwarded publishes waiting for their owner, further
ones are refused with `ShardUnavailable` (the client's retryable error; while the peer is
unreachable, they are held for the shard's next leader by `forwarding.HeldForwards`); past
`MAX_PUSHES_QUEUED` queued pushes, pushes are dropped and counted as a slow subscriber's would
be. A broken connection is redialed and the session resumed: the frames not answered are sent
again, and the peer applies each frame of a session once (`inbox.py`).

A peer whose cluster port refuses connections dial after dial for `PEER_GONE_AFTER_S` (its
process is gone: a frozen or cut-off one does not refuse) is reported to the data plane's
`PeerWatch` once per run of refusals, as the view showed it when they began (the control
plane ends that registration's lease, so that its shards fail over without waiting for the
lease to run out; a later registration, a new process, keeps its own).

It also carries the replica protocol's requests of this node's followers to the shards the
peer leads (`replica_call`): unnumbered frames on the connection open now, never sent again
(a request whose connection breaks fails with `ConnectionError`, and its follower asks
again), answered on the same connection by their request's id.

It decides no route: a publish its owner refused as not its own goes back to the data plane
(`forwarding.Forwarding.reroute`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING

import grpc

from ..core.errors import PublishRejected, ShardUnavailable
from ..proto import cluster_pb2 as pb
from .link import LinkClient, PeerEnded
from .membership import NodeInfo
from .outbox import (
    FRAME_MAX_MESSAGES,
    Queued,
    SentBatch,
    SentFrame,
    Shared,
    Waiter,
    fail,
    seen,
    settle_batch,
    take_batches,
    take_pushes,
)
from .waits import wait_within

if TYPE_CHECKING:
    from ..core.message import Message
    from .data_plane import DataPlane

log = logging.getLogger(__name__)

MAX_FORWARDS_IN_FLIGHT = 20_000
MAX_PUSHES_QUEUED = 100_000
# A link's credit for pushes: past this many pushes queued or not answered, the publisher
# whose messages are pushed is held (back-pressure) until the peer has answered all but
# PUSH_LOW_WATER; a peer answers a frame once it dispatched its pushes, so a subscriber behind
# on the peer holds the publisher here, and QoS >= 1 pushes are not dropped.
PUSH_HIGH_WATER = 10_000
PUSH_LOW_WATER = 5_000
DIAL_TIMEOUT_S = 5.0
# A peer silent for this long (frozen: SIGSTOP, a stalled VM) is given up on (see PeerSilent).
LINK_TIMEOUT_S = 3.0
RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 1.0
# A broken stream is resumed (its unanswered frames sent again) while its oldest unanswered
# frame is younger than this; older, their publishes fail retryably instead of waiting on.
RESUME_LIMIT_S = 10.0
# Dials refused this long in a row: the peer's process is gone (see the module docstring).
PEER_GONE_AFTER_S = 0.25


class PeerSilent(ConnectionError):
    """The peer said nothing (no reply, no heartbeat) for the link's timeout: it is frozen or
    cut off, though its connection may look open."""


class PeerLink:
    """This node's outgoing link to one peer: one `Link` stream at a time, batched, bounded,
    redialed, and resumed after a break (the frames not answered are sent again)."""

    def __init__(self, plane: DataPlane, node: NodeInfo) -> None:
        self.plane = plane
        self.node = node
        # Frames are numbered within this session, across the streams it opens.
        self.session = random.getrandbits(62) + 1
        self._next_sequence = 1
        self._unanswered: dict[int, SentFrame] = {}
        self._answered_floor = 1  # every frame below it was answered
        # Publishes to forward: (message, epoch, its future or None, the shared future of
        # the QoS 0 ones or None).
        self._forwards: list[Queued] = []
        self._shared: Shared | None = None
        # Stored messages to push, with the share groups chosen here for each.
        self._pushes: list[tuple[Message, tuple[str, ...]]] = []
        self._routes: list[pb.RouteUpdate] = []
        self._routes_generation = 0
        self._retained: list[pb.Retained] = []
        # Replica requests to send, and those sent on the current connection not answered yet.
        self._replica_out: list[pb.ReplicaRequest] = []
        self._replica_waiting: dict[int, asyncio.Future[pb.ReplicaAnswer]] = {}
        self._in_flight = 0  # forwards queued or not answered
        self._pushes_held = 0  # pushes queued or not answered
        # Pushes put into frames (or dropped with them, `_fail_all`) since the link began: with
        # the queued ones, `pushes_queued`; see `pushes_settled`.
        self._pushes_framed = 0
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
        # when the dials began to be refused (monotonic) and the peer as the view showed it
        # then (None: out of the view), and whether told so
        self._refused_since: tuple[float, NodeInfo | None] | None = None
        self._gone_told = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"link-{node.node_id}")

    def __repr__(self) -> str:
        return f"PeerLink({self.node.node_id} at {self.node.cluster_address})"

    @property
    def pushes_queued(self) -> int:
        """How many pushes were queued on this link since it began (dropped ones not counted)."""
        return self._pushes_framed + len(self._pushes)

    @property
    def pushes_settled(self) -> int:
        """How many of the pushes queued on this link, in order, are settled: answered by the
        peer (it dispatched them), or given up with the peer (`_fail_all`). A replicated
        shard's leader tells its followers how far its dispatch reached every node from it
        (`dispatch_marks.py`)."""
        oldest = next(iter(self._unanswered.values()), None)
        return oldest.pushes_before if oldest is not None else self._pushes_framed

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
        future it shares with the other QoS 0 messages of this write (see `Shared`)."""
        if not self.reachable:
            # (a failover, most likely: held for the shard's next leader)
            return self.plane.forwarding.hold(message, future, ShardUnavailable(
                f"node {self.node.node_id} owning {message.stream}/{message.shard} is unreachable"))
        if self._in_flight >= MAX_FORWARDS_IN_FLIGHT:
            if future is None:
                future = self._loop.create_future()
            fail(future, ShardUnavailable(
                f"too many publishes waiting for node {self.node.node_id}; retry"))
            self.plane.stats.forward_failures += 1
            return future
        self._in_flight += 1
        if not self._flush_scheduled:
            self._flush_soon()
        if future is None and not message.qos:
            shared = self._shared
            if shared is None:
                shared = self._shared = Shared(self._loop.create_future())
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
            self.lost_pushes()
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

    def lost_pushes(self) -> None:
        """Pushes to the peer were dropped: its durable cursors must read this node's journal
        again (told on the next frame, sent soon even when nothing else is queued)."""
        self._pushes_lost = True
        if not self._flush_scheduled:
            self._flush_soon()

    def replica_call(self, request: pb.ReplicaRequest) -> asyncio.Future[pb.ReplicaAnswer]:
        """Send a replica request (its `id` unique on this link) at the end of this loop turn,
        with the others of the turn in one frame; the future fails with `ConnectionError` when
        the link is not up, or when its connection ends before the answer."""
        future: asyncio.Future[pb.ReplicaAnswer] = self._loop.create_future()
        connection = self._connection
        if connection is None or connection.closing:
            future.set_exception(ConnectionError(f"no link to node {self.node.node_id} now"))
            return future
        key = request.id
        waiting = self._replica_waiting
        waiting[key] = future

        def done(_future: asyncio.Future[pb.ReplicaAnswer]) -> None:
            if waiting.get(key) is _future:  # (given up on: a late answer finds nothing)
                del waiting[key]

        future.add_done_callback(done)
        self._replica_out.append(request)
        self._flush_soon()
        return future

    def _replica_ended(self) -> None:
        """The connection ended: the replica requests sent on it will never be answered."""
        self._replica_out = []
        waiting, self._replica_waiting = self._replica_waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(ConnectionError(
                    f"the link to node {self.node.node_id} broke before it answered"))

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
        if self._replica_out and not connection.closing:
            # small, and waited on by followers: sent even while the peer is behind reading
            requests, self._replica_out = self._replica_out, []
            connection.send(pb.PeerFrame(sequence=0, replica=requests))
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
        except asyncio.CancelledError:
            # the link's task ends so; a cancellation of the caller itself goes on, once what
            # the link held is given up on
            caller = asyncio.current_task()
            if caller is not None and caller.cancelling():
                self._fail_all(ShardUnavailable(f"node {self.node.node_id} left the cluster"))
                raise
        except Exception:  # noqa: BLE001 - the link is closed; how its task ended is moot
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
                if isinstance(exc, ConnectionRefusedError) and not self.connected:
                    self._note_refused()
                else:
                    self._refused_since = None
                # a silent peer is away (frozen): its clients get retryable errors at once
                was_reachable = self.reachable
                self.reachable = (self._failed_dials < 2 and not isinstance(exc, PeerSilent)
                                  and not self._closed)
                if was_reachable and not self.reachable and not self.connected:
                    self.plane.route_sync.link_state_changed()  # SUBACKs stop waiting for it
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
                    self.plane.route_sync.link_state_changed()
            if self._closed:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_MAX_S)

    def _note_refused(self) -> None:
        """A dial was refused: past `PEER_GONE_AFTER_S` of refusals, tell the data plane once."""
        now = time.monotonic()
        if self._refused_since is None:
            # the peer as the view shows it now (its registration's lease): the refusals are
            # seen against that registration, not a later one (a new process)
            seen = self.plane.view.nodes().get(self.node.node_id)
            self._refused_since = (now, seen)
            self._gone_told = False
            return
        if not self._gone_told and now - self._refused_since[0] >= PEER_GONE_AFTER_S:
            self._gone_told = True
            seen = self._refused_since[1]
            if seen is not None:
                self.plane.peers.peer_gone(seen)

    async def _serve(self) -> None:
        """One connection of the link session: dial, say hello, send again what the last
        connection left unanswered, then the route set; return (raise) when it ends."""
        host, _, port = self.node.cluster_address.rpartition(":")
        host = host.strip("[]")
        tls = self.plane.credentials.tls
        _transport, connection = await wait_within(
            self._loop.create_connection(
                lambda: LinkClient(self._on_reply, self._flush_soon, self.plane.credentials,
                                   self.node.node_id, self.plane.link_timeout_s),
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
            self._routes = [self.plane.route_sync.snapshot()]
            self._routes_generation = self.plane.route_sync.generation
            self._retained = self._retained + self.plane.retained_sync.snapshot()
            self._connection = connection
            self._refused_since = None
            if not self.connected:
                self.connected = self.reachable = True
                log.info("cluster link to %s up", self)
                self.plane.route_sync.link_state_changed()
            self._flush()
            raise await self._watch(connection, timeout)
        finally:
            self._connection = None
            connection.close()
            self._replica_ended()

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
                return await wait_within(asyncio.shield(closed), timeout - silent)
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
        batches: list[SentBatch] = []
        if self._forwards:
            batches, count, size = take_batches(self._forwards, frame, self._refuse_unpackable)
        pushes = 0
        pushes_before = self._pushes_framed
        if self._pushes and count < FRAME_MAX_MESSAGES:
            pushes = take_pushes(self._pushes, frame, count, size)
            self._pushes_framed += pushes
        if self._routes_mark and not self._pushes:
            frame.routes_applied = self._routes_mark
            self._routes_mark = 0
        forwarded = sum(len(batch.messages) for batch in batches)
        self._unanswered[sequence] = SentFrame(frame, batches, forwarded, pushes, route_generation,
                                               pushes_before)
        return frame

    def _refuse_unpackable(self, waiter: Waiter, error: PublishRejected) -> None:
        """A queued publish a record cannot hold: refused here, never sent."""
        self._in_flight -= 1
        self._settle_one(waiter, error)

    def _settle_one(self, waiter: Waiter, error: PublishRejected | None) -> None:
        if error is not None:
            self.plane.stats.forward_failures += 1
        if isinstance(waiter, Shared):
            waiter.settle(1, error)
        elif not waiter.done():
            if error is None:
                waiter.set_result(None)
            else:
                fail(waiter, error)

    def _on_reply(self, reply: pb.PeerReply) -> None:
        """The peer answered a frame: settle its forwards (stored, re-routed or refused); or
        it answered replica requests."""
        if reply.replica:
            waiting = self._replica_waiting
            for answer in reply.replica:
                future = waiting.pop(answer.id, None)
                if future is not None and not future.done():
                    future.set_result(answer)
        sent = self._unanswered.pop(reply.sequence, None)
        if sent is None:
            return
        self._pushes_held -= sent.pushes
        if self._over_credit:
            self._credit_returned()
        if sent.route_generation > self.routes_answered:
            self.routes_answered = sent.route_generation
            self.plane.route_sync.link_state_changed()
        if not sent.batches:
            return
        self.plane.stats.forward_latency.observe(time.perf_counter() - sent.written_at)
        self._in_flight -= sent.forwarded
        results = reply.batches
        node_id, settle_one, rerouted = self.node.node_id, self._settle_one, self._rerouted
        for index, batch in enumerate(sent.batches):
            settle_batch(batch, results[index] if index < len(results) else None, node_id,
                         settle_one, rerouted)

    def _rerouted(self, message: Message, future: asyncio.Future[None] | None, epoch: int,
                  outcome: pb.Outcome) -> bool:
        """Send a message the owner refused as not its own where the shard is now, when the
        view has moved on (see `DataPlane.reroute`)."""
        if outcome.code != pb.NOT_OWNER:
            return False
        if future is None:  # a QoS 0 message: its own future, which nobody waits on
            future = self._loop.create_future()
            future.add_done_callback(seen)
        return self.plane.forwarding.reroute(message, future, epoch, outcome.epoch)

    def _fail_all(self, error: PublishRejected) -> None:
        """Give up on every forward not yet answered and drop the pushes: the owner may or
        may not have stored them. A publish with its own future is held for the shard's next
        leader (`forwarding.HeldForwards`: sent again, so at least once, never acknowledged
        and lost); the others' clients get a retryable error. Used when the peer is away, not
        when a stream merely broke."""
        waiters: list[Waiter] = []
        held: list[tuple[Message, asyncio.Future[None]]] = []
        for message, _epoch, future, shared in self._forwards:
            if future is not None:
                held.append((message, future))
            else:
                waiters.append(shared)  # type: ignore[arg-type]
        dropped = len(self._pushes)
        lost = False
        for sent in self._unanswered.values():
            for batch in sent.batches:
                if batch.unacknowledged:
                    waiters += batch.waiters
                else:
                    held += zip(batch.messages, batch.waiters, strict=True)  # type: ignore[arg-type]
            dropped += sent.pushes
            lost = lost or sent.frame.pushes_lost
        self._forwards = []
        self._shared = None
        self._pushes_framed += len(self._pushes)
        self._unanswered = {}
        self._answered_floor = self._next_sequence
        self._in_flight = 0
        self._pushes = []
        self._pushes_held = 0
        self._credit_returned()
        self.plane.stats.pushes_dropped += dropped
        if dropped or lost:
            self.lost_pushes()
        for waiter in waiters:
            self._settle_one(waiter, error)
        hold = self.plane.forwarding.hold
        for message, future in held:
            hold(message, future, error)


def _short(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__
