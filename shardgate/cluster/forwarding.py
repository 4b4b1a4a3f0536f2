"""Forwarding: a publish to a shard another node owns is sent to that owner over the link to
it (`peer_link.PeerLink`), and sent again where the shard lives now when the owner refused it
as not its own under a newer epoch.

Ownership is the control plane's (`membership.ClusterView`); the owner checks it again for
every forwarded message (`owner_store.py`) and answers `NOT_OWNER` when the map moved, so a
message is stored only by the node that owns its shard under the current epoch. A node whose
view is behind the epoch another node knows waits (bounded, `VIEW_CATCH_UP_S`) for its etcd
watch to catch up before it decides.

During a failover a publish (QoS >= 1) whose shard has no leader this node can reach (the
leader died and no other is named yet, its link broke before it answered, or it refused the
message as not its own while this node's view names it still) is held here (`HeldForwards`)
and sent again, in order, once the view names a leader this node can reach: its client sees a
pause, not an error, as Kafka's producer retries within its delivery timeout. A held message is
refused (retryably) only `FORWARD_HOLD_S` (`[cluster] forward_hold_s`) after it was first
held, or past `MAX_HELD`; past `HOLD_HIGH_WATER` held messages, their publishers are held
(back-pressure). Held messages are tried again at every view change and every `HOLD_RETRY_S`
(one timer for all of them, no task per message). Resent, a message is stored once: it carries
the identity this node gave it, and its leader looks for it in its log first (`forward_ids.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from ..core.errors import PublishRejected, ShardUnavailable
from ..core.resends import mark_resent
from .forward_ids import ForwardIds
from .outbox import fail

if TYPE_CHECKING:
    from ..core.message import Message
    from .data_plane import DataPlane
    from .membership import ClusterView
    from .peer_link import PeerLink

log = logging.getLogger(__name__)

# A node whose view of the shard map is behind a peer's waits this long for its etcd watch
# to catch up before it refuses a message it is not (yet) the owner of.
VIEW_CATCH_UP_S = 5.0
# Streams every node keeps for itself, never placed nor forwarded: its own $SYS topics.
NODE_LOCAL_STREAMS = frozenset({"sys"})
# How long a forwarded publish may be held for its shard's next leader (see the module
# docstring): the default lease (5 s) runs out, and a new leader is named, well within it.
FORWARD_HOLD_S = 10.0
# Held messages are tried again this often (besides at every change of the view): a new
# leader that refused them a moment ago (its in-sync set not ready) may take them now.
HOLD_RETRY_S = 0.1
MAX_HELD = 20_000
HOLD_HIGH_WATER = 5_000
HOLD_LOW_WATER = 2_500


class Forwarding:
    """Sends publishes to their shard's owner and re-routes the refused ones (one per data
    plane; see the module docstring)."""

    def __init__(self, plane: DataPlane, hold_s: float | None = None) -> None:
        self.plane = plane
        # how long a held publish waits for a next leader (None: `FORWARD_HOLD_S`)
        self.hold_s = hold_s
        self.view = plane.view
        self.stats = plane.stats
        self.links = plane.links
        self.node_id = plane.node_id
        # (stream, shard) -> the link to its owner and the owner's epoch, as the view said
        # when last asked; forgotten at every change of the view (and every RECONCILE_S). A
        # stale entry is safe: the owner refuses what it does not own, and the sender re-routes.
        self._forward_routes: dict[tuple[str, int], tuple[PeerLink, int]] = {}
        # (deadline, stream, shard, epoch, then): waiting for this node's view to catch up.
        self._epoch_waiters: list[
            tuple[float, str, int, int, Callable[[], None], Callable[[], bool] | None]] = []
        self.held = HeldForwards(self)
        # the identity of the publishes forwarded from here, and (as a leader) the broker's
        # check of those sent again (`forward_ids.py`, `core/resends.py`)
        self.ids = ForwardIds(self.node_id)
        self.resends = plane.broker.resends

    def view_changed(self) -> None:
        """The view moved: forget the owners asked so far, and settle who waited for it."""
        self._forward_routes.clear()
        self.resends.forget()
        if self._epoch_waiters:
            self._check_epoch_waiters()
        if self.held.count:
            self.held.release()

    def stop(self) -> None:
        """The node stops: what is held is refused (retryably), and nothing is held again."""
        self._forward_routes.clear()
        self.held.refuse_all(ShardUnavailable(f"node {self.node_id} is stopping; retry"))

    def hold(self, message: Message, future: asyncio.Future[None] | None,
             error: PublishRejected) -> asyncio.Future[None]:
        """`message` cannot reach its shard's leader now: hold it for the next one (see
        `HeldForwards`); the future its publisher waits on (`future`, or a new one)."""
        return self.held.hold(message, future, error)

    def forward(self, message: Message) -> asyncio.Future[None]:
        if message.qos:
            self.ids.tag(message)  # (may be held and sent again: stored once, `forward_ids`)
        key = (message.stream, message.shard)
        if self.held.count and key in self.held.shards:
            # behind the held messages of its shard (its publisher's order is kept)
            return self.held.hold(message, None, ShardUnavailable(
                f"no node could take {message.stream}/{message.shard} in time; retry"))
        route = self._forward_routes.get(key)
        if route is not None:
            self.stats.forwarded += 1
            return route[0].forward(message, route[1])
        assignment = self.view.leader(message.stream, message.shard)
        link = None
        if assignment is not None and assignment.leader != self.node_id:
            link = self.links.get(assignment.leader)
        if link is None:
            if assignment is None:
                reason = f"no node owns {message.stream}/{message.shard} now; retry"
            elif assignment.leader == self.node_id:
                reason = f"this node cannot prove it owns {message.stream}/{message.shard} now; retry"
            else:
                reason = f"node {assignment.leader} owning {message.stream}/{message.shard} is not live"
            return self.held.hold(message, None, ShardUnavailable(reason))
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
        # (a refusal after its append, its leadership lost before the commit, may leave it in
        # the log the next leader has: that one looks for it first)
        mark_resent(message)
        if self._route_again(message, future, refused_epoch):
            return True
        if owner_epoch <= refused_epoch:
            if not message.qos:
                return False
            # the refusing node knows no newer owner either (a failover under way): held
            self.held.hold(message, future, ShardUnavailable(
                f"the owner of {message.stream}/{message.shard} refused it and no other took "
                "it in time; retry"))
            return True

        def caught_up() -> None:
            if not self._route_again(message, future, refused_epoch):
                self.held.hold(message, future, ShardUnavailable(
                    f"the owner of {message.stream}/{message.shard} moved and this node has "
                    "not learned where yet; retry"))

        self.after_epoch(message.stream, message.shard, owner_epoch, caught_up)
        return True

    def _route_again(self, message: Message, future: asyncio.Future[None], refused_epoch: int) -> bool:
        assignment = self.view.leader(message.stream, message.shard)
        if assignment is None or assignment.leader_epoch <= refused_epoch:
            return False
        if assignment.leader == self.node_id:
            if not self.plane.stores(message.stream, message.shard):
                return False
            try:
                stored = self.publish_here(message)
            except PublishRejected as exc:
                if isinstance(exc, ShardUnavailable) and message.qos:
                    self.held.hold(message, future, exc)  # (its new log not settled yet)
                else:
                    fail(future, exc)
                return True
            if stored is None:
                future.set_result(None)
            else:
                stored.add_done_callback(lambda done: settle(future, done))
            return True
        link = self.links.get(assignment.leader)
        if link is None:
            return False
        link.forward(message, assignment.leader_epoch, future)
        return True

    def publish_here(self, message: Message) -> asyncio.Future[None] | None:
        """Store a forwarded `message` here, its shard's leader now (counted when it came
        in); one that its earlier leader may have stored is looked for in the log first and
        acknowledged where it is (the broker's publish looks: `core/resends.py`)."""
        return self.plane.broker.publish(message, counted=False)

    def after_epoch(self, stream: str, shard: int, epoch: int, then: Callable[[], None],
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


class HeldForwards:
    """The forwarded publishes held for their shard's next leader (see the module
    docstring), in the order they were held: one timer for all, no task per message."""

    def __init__(self, forwarding: Forwarding) -> None:
        self.forwarding = forwarding
        self.plane = forwarding.plane
        # (message, its publisher's future, the error it gets at its deadline), in order
        self._held: deque[tuple[Message, asyncio.Future[None], PublishRejected]] = deque()
        # the shards with held messages: how many each
        self.shards: dict[tuple[str, int], int] = {}
        # a held publisher future -> its deadline (loop time), kept across holds until it
        # is settled (a message sent again and held again keeps its first deadline)
        self._deadlines: dict[asyncio.Future[None], float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._congested = False

    @property
    def count(self) -> int:
        return len(self._held)

    def hold(self, message: Message, future: asyncio.Future[None] | None,
             error: PublishRejected) -> asyncio.Future[None]:
        """Hold `message` (its publisher waits on `future`, or on the new future returned),
        or refuse it with `error` at once: a QoS 0 one, while the node stops, past its
        deadline or past `MAX_HELD`."""
        loop = asyncio.get_running_loop()
        if future is None:
            future = loop.create_future()
        if future.done():
            return future
        plane = self.plane
        deadline = self._deadlines.get(future)
        now = loop.time()
        if (not message.qos or plane.stopping or not plane.started or len(self._held) >= MAX_HELD
                or (deadline is not None and now >= deadline)):
            plane.stats.forward_failures += 1
            fail(future, error)
            return future
        if deadline is None:
            hold_s = self.forwarding.hold_s
            self._deadlines[future] = now + (FORWARD_HOLD_S if hold_s is None else hold_s)
            future.add_done_callback(self._settled)
        mark_resent(message)  # (its leader may have stored it before its answer was lost)
        self._held.append((message, future, error))
        key = (message.stream, message.shard)
        self.shards[key] = self.shards.get(key, 0) + 1
        if len(self._held) >= HOLD_HIGH_WATER and not self._congested:
            self._congested = True
            plane.broker.back_pressure.congested(self)
        if self._timer is None:
            self._timer = loop.call_later(HOLD_RETRY_S, self._tick)
        return future

    def _settled(self, future: asyncio.Future[None]) -> None:
        self._deadlines.pop(future, None)

    def _tick(self) -> None:
        self._timer = None
        try:
            self.release()
        except Exception:  # noqa: BLE001 - tried again on the next tick
            log.exception("cluster: sending held publishes again failed")
        if self._held and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(HOLD_RETRY_S, self._tick)

    def release(self) -> None:
        """Send each held message whose shard has a leader this node can reach now (in order
        per shard: one left held keeps the later ones of its shard), refuse those past their
        deadline, keep the others."""
        if not self._held:
            return
        forwarding, plane = self.forwarding, self.plane
        view, links, node_id = forwarding.view, plane.links, plane.node_id
        now = asyncio.get_running_loop().time()
        held, self._held = self._held, deque()
        self.shards = {}
        blocked: set[tuple[str, int]] = set()
        routes: dict[tuple[str, int], tuple[PeerLink | None, int] | None] = {}
        for message, future, error in held:
            if future.done():
                continue
            deadline = self._deadlines.get(future, now)
            if now >= deadline:
                plane.stats.forward_failures += 1
                fail(future, error)
                continue
            key = (message.stream, message.shard)
            route = None
            if key not in blocked:
                if key in routes:
                    route = routes[key]
                else:
                    route = routes[key] = self._route(view, links, node_id, key, plane.stores)
            if route is None:
                blocked.add(key)
                self._held.append((message, future, error))
                self.shards[key] = self.shards.get(key, 0) + 1
                continue
            link, epoch = route
            plane.stats.forwarded += 1
            if link is not None:
                link.forward(message, epoch, future)
                continue
            try:  # this node leads the shard now
                stored = forwarding.publish_here(message)
            except ShardUnavailable:
                # named leader, but its replicated log is not ready yet: a moment more
                plane.stats.forwarded -= 1
                blocked.add(key)
                self._held.append((message, future, error))
                self.shards[key] = self.shards.get(key, 0) + 1
                continue
            except PublishRejected as exc:
                fail(future, exc)
                continue
            if stored is None:
                future.set_result(None)
            else:
                stored.add_done_callback(partial(self._stored_here, message, future, error))
        if self._congested and len(self._held) <= HOLD_LOW_WATER:
            self._congested = False
            plane.broker.back_pressure.relieved(self)

    def _stored_here(self, message: Message, future: asyncio.Future[None],
                     error: PublishRejected, done: asyncio.Future[None]) -> None:
        """A held message this node stored as the shard's new leader: settled as its commit
        went; one whose leadership changed again before its commit is held once more."""
        if (not done.cancelled() and isinstance(done.exception(), ShardUnavailable)
                and not future.done()):
            self.hold(message, future, error)
            return
        settle(future, done)

    @staticmethod
    def _route(view: ClusterView, links: dict[str, PeerLink], node_id: str,
               key: tuple[str, int], stores: Callable[[str, int], bool],
               ) -> tuple[PeerLink | None, int] | None:
        """Where a held message of shard `key` goes now: the link to its leader (None: this
        node, which leads it) and the leader's epoch; None while no leader can be reached."""
        assignment = view.leader(*key)
        if assignment is None:
            return None
        if assignment.leader == node_id:
            # (not before its replicated log leads: a publish made here meanwhile waits too)
            return (None, assignment.leader_epoch) if stores(*key) else None
        link = links.get(assignment.leader)
        if link is None or not link.reachable:
            return None
        return link, assignment.leader_epoch

    def refuse_all(self, error: PublishRejected) -> None:
        held, self._held = self._held, deque()
        self.shards = {}
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for _message, future, _error in held:
            if not future.done():
                self.plane.stats.forward_failures += 1
                fail(future, error)
        if self._congested:
            self._congested = False
            self.plane.broker.back_pressure.relieved(self)


def settle(future: asyncio.Future[None], done: asyncio.Future[None]) -> None:
    """Settle a forward's `future` as the local store's `done` went."""
    if future.done():
        return
    if done.cancelled() or done.exception() is not None:
        error = "cancelled" if done.cancelled() else done.exception()
        fail(future, PublishRejected(f"the message could not be stored: {error}"))
    else:
        future.set_result(None)
