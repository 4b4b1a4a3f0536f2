"""Forwarding: a publish to a shard another node owns is sent to that owner over the link to
it (`peer_link.PeerLink`), and sent again where the shard lives now when the owner refused it
as not its own under a newer epoch.

Ownership is the control plane's (`membership.ClusterView`); the owner checks it again for
every forwarded message (`owner_store.py`) and answers `NOT_OWNER` when the map moved, so a
message is stored only by the node that owns its shard under the current epoch. A node whose
view is behind the epoch another node knows waits (bounded, `VIEW_CATCH_UP_S`) for its etcd
watch to catch up before it decides.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.errors import PublishRejected, ShardUnavailable
from .outbox import fail

if TYPE_CHECKING:
    from ..core.message import Message
    from .data_plane import DataPlane
    from .peer_link import PeerLink

log = logging.getLogger(__name__)

# A node whose view of the shard map is behind a peer's waits this long for its etcd watch
# to catch up before it refuses a message it is not (yet) the owner of.
VIEW_CATCH_UP_S = 5.0
# Streams every node keeps for itself, never placed nor forwarded: its own $SYS topics.
NODE_LOCAL_STREAMS = frozenset({"sys"})


class Forwarding:
    """Sends publishes to their shard's owner and re-routes the refused ones (one per data
    plane; see the module docstring)."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
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

    def view_changed(self) -> None:
        """The view moved: forget the owners asked so far, and settle who waited for it."""
        self._forward_routes.clear()
        if self._epoch_waiters:
            self._check_epoch_waiters()

    def forget_routes(self) -> None:
        self._forward_routes.clear()

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
            fail(future, ShardUnavailable(reason))
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
                fail(future, ShardUnavailable(
                    f"the owner of {message.stream}/{message.shard} moved and this node has "
                    "not learned where yet; retry"))

        self.after_epoch(message.stream, message.shard, owner_epoch, caught_up)
        return True

    def _route_again(self, message: Message, future: asyncio.Future[None], refused_epoch: int) -> bool:
        assignment = self.view.leader(message.stream, message.shard)
        if assignment is None or assignment.leader_epoch <= refused_epoch:
            return False
        if assignment.leader == self.node_id:
            if not self.view.leads(message.stream, message.shard):
                return False
            try:
                stored = self.plane.broker.publish(message, counted=False)  # counted when it came in
            except PublishRejected as exc:
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



def settle(future: asyncio.Future[None], done: asyncio.Future[None]) -> None:
    """Settle a forward's `future` as the local store's `done` went."""
    if future.done():
        return
    if done.cancelled() or done.exception() is not None:
        error = "cancelled" if done.cancelled() else done.exception()
        fail(future, PublishRejected(f"the message could not be stored: {error}"))
    else:
        future.set_result(None)
