"""The old node's side of an MQTT session that moves (`sessions.py` says how sessions move):
`SessionRelease` ends the session here and hands its snapshot over when a peer takes it
(`ReleaseSession`), and leaves a `GroupStandIn` in its place until the new node collects
what the stand-in took meanwhile. `in_shard_order` puts those messages, on the new node, in
the order their shards gave them. It reaches the MQTT service through its own methods
(`MqttService.release_for_takeover`, `snapshot.capture`), never its attributes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..core.message import Message
from ..core.outbox import SLOW_SUBSCRIBER
from ..core.subscriptions import Subscription
from ..protocols.mqtt.session import MqttSession, Queued
from ..protocols.mqtt.snapshot import SessionSnapshot, message_record
from ..protocols.mqtt.snapshotting import capture
from .waits import wait_within

if TYPE_CHECKING:
    from ..core.broker import Broker
    from ..protocols.mqtt.service import MqttService
    from .control import ClusterNode
    from .data_plane import DataPlane

log = logging.getLogger(__name__)

# How long a node that handed a session over keeps its shared groups' messages for the new
# node (`GroupStandIn`) when that node does not collect them (it died meanwhile).
STAND_IN_TIMEOUT_S = 30.0
# How long a collect waits for the peers to say every push they chose this node for has
# arrived (`DataPlane.pushes_flushed`): a peer slower than this is taken as gone.
FLUSH_WAIT_S = 10.0


def _identity(message: Message) -> tuple[str, int, int, int, str]:
    return (message.stream, message.shard, message.offset, message.publish_time_ms, message.topic)


def in_shard_order(session: MqttSession, start: int, reliable: Callable[[str], bool]) -> int:
    """Put the messages of non-reliable streams queued for `session` from position `start` on
    (those a moving session got from its old node's stand-in and, meanwhile, from the owners
    directly) in the order their shards gave them, each once: while the session moved, both
    nodes were in the owners' routes for a moment, and the stand-in's came last. Each shard's
    messages keep the places its messages held in the queue. Returns how many duplicates
    were dropped."""
    queue = session.queue
    if len(queue) <= start:
        return 0
    window = list(queue)[start:]
    seen: set[tuple[str, int, int, int, str]] = set()
    kept: list[Queued] = []
    for item in window:
        message = item.message
        if message.offset >= 0 and not reliable(message.stream):
            identity = _identity(message)
            if identity in seen:
                continue
            seen.add(identity)
        kept.append(item)
    places: dict[tuple[str, int], list[int]] = {}
    for index, item in enumerate(kept):
        message = item.message
        if message.offset >= 0 and not reliable(message.stream):
            places.setdefault((message.stream, message.shard), []).append(index)
    for indexes in places.values():
        ordered = sorted((kept[index] for index in indexes), key=lambda item: item.message.offset)
        for index, item in zip(indexes, ordered, strict=True):
            kept[index] = item
    session.replace_queued_from(start, kept)
    return len(window) - len(kept)


class GroupStandIn:
    """Stands in for a session handed over to another node, until that node serves the
    session's routes and collects what the stand-in took meanwhile (`SessionRelease.collect`):
    in this node's shared subscription groups (so a group always has a node for every member
    while it moves, and the owners never find it empty and drop a message), and for the
    session's own filters (`own`: a plain subscription with the same filters, which takes the
    messages of non-reliable streams; the session's cursors carry the reliable ones). So what
    was on its way here for the session when it left follows it: a graceful handover carries
    everything it holds."""

    def __init__(self, client_id: str, groups: list[Subscription], to: str, limit: int,
                 own: Subscription | None = None, reliable: Callable[[str], bool] | None = None) -> None:
        self.client_id = client_id
        self.groups = groups  # the session's groups here, and `own` (left together)
        self.own = own
        self._reliable = reliable or (lambda stream: True)
        self.to = to  # the node the session went to: the one that collects
        # (group name, or "" for the session's own filters; the message; the filters it matched)
        self.messages: list[tuple[str, Message, tuple[str, ...]]] = []
        # at most what the session itself would queue (`mqtt.max_queued_messages`); beyond,
        # the newest are dropped and counted, as a full session queue does
        self.limit = limit
        self.dropped = 0
        self.timer: asyncio.TimerHandle | None = None
        # False once the new node collects: no longer a member in this node's routes, it only
        # takes what the owners had already sent here (`routes.local_routes`)
        self.in_routes = True
        # the answer to the new node's collect, once asked (kept for its retries until `timer`)
        self.collected: asyncio.Future[dict[str, Any]] | None = None
        # the session as it left here, until the new node collects (a sign it has it): asked
        # again when its first call failed, written to etcd when never collected
        self.state: SessionSnapshot | None = None
        self.left = False  # it left its groups

    @property
    def consumer_id(self) -> str:
        return self.client_id

    @property
    def available(self) -> bool:
        return False  # takes a message only when no member of the group can

    def deliver(self, message: Message, subscription: Subscription, filters: Any) -> None:
        own = subscription is self.own
        if own and self._reliable(message.stream):
            return  # in a journal: the session's cursors read it on its new node
        if len(self.messages) >= self.limit:
            self.dropped += 1
            return
        self.messages.append(("" if own else subscription.name, message, tuple(filters or ())))


class SessionRelease:
    """Ends sessions here that a peer took over and hands their state to it, standing in for
    them until it collects. `releasing` holds the client ids being handed over (shared with
    `SessionSnapshots`: their local forget is not an end)."""

    def __init__(self, node: ClusterNode, service: MqttService, broker: Broker, plane: DataPlane,
                 releasing: set[str],
                 keep: Callable[[SessionSnapshot], Awaitable[None]] | None = None) -> None:
        self.node = node
        # writes a session's state to etcd when its new node never collected it
        self.keep = keep
        self._keeping: set[asyncio.Task[None]] = set()
        self._keeping_by_client: dict[str, asyncio.Task[None]] = {}
        self.service = service
        self.broker = broker
        self.plane = plane
        self.releasing = releasing
        # sessions handed over whose messages wait here for their new node, by client id
        self.stand_ins: dict[str, GroupStandIn] = {}
        # set while every stand-in here has been collected (or there is none)
        self._all_collected = asyncio.Event()
        self._all_collected.set()
        self.handed_over = 0

    def reliable(self, stream: str) -> bool:
        broker_stream = self.broker.streams.get(stream)
        return broker_stream is None or broker_stream.reliable

    async def release(self, request: dict[str, Any]) -> dict[str, Any]:
        """A peer took this client's session: end it here and hand its state over. Its
        shared groups keep a stand-in here until the peer collects (`collect`)."""
        client_id = str(request["client_id"])
        to = str(request.get("to", "another node"))
        if request.get("collect"):
            return await self.collect(client_id, to)
        clean_start = bool(request.get("clean_start"))
        service = self.service
        # a takeover: the new connection owns the session now (a will without delay goes)
        session = service.release_for_takeover(client_id, to, clean_start=clean_start)
        if session is None:
            keeping = self._keeping_by_client.get(client_id)
            if keeping is not None:  # its snapshot is on its way to etcd: read it there after
                await asyncio.wait([keeping], timeout=5.0)
            stand_in = self.stand_ins.get(client_id)
            if (stand_in is not None and stand_in.to == to and stand_in.state is not None
                    and stand_in.collected is None):
                # `to` asks again: its call timed out, or its answer was lost. The session
                # left here already; what it took with it is kept until `to` collects
                return {"state": stand_in.state.to_dict(), "stand_in": True}
            return {"state": None}
        snapshot = (capture(session, self.node.node_id, group_messages=True)
                    if session.durable and not clean_start else None)
        state = None if snapshot is None else snapshot.to_dict()
        stand_in = None
        if snapshot is not None:
            stand_in = self._stand_in(session, to)
            stand_in.state = snapshot
        self.releasing.add(client_id)
        try:
            service.remove_session(session)
        finally:
            self.releasing.discard(client_id)
        self.handed_over += 1
        log.info("cluster: session %r handed over to %s", client_id, to)
        return {"state": state, "stand_in": stand_in is not None}

    def _stand_in(self, session: MqttSession, to: str) -> GroupStandIn:
        client_id = session.client_id
        earlier = self.stand_ins.get(client_id)
        taken: list[tuple[str, Message, tuple[str, ...]]] = []
        if earlier is not None:  # an earlier move's: what it took goes too, unless collected
            if earlier.collected is None:
                taken, earlier.messages = earlier.messages, []
            self.drop_stand_in(client_id)
        own = self._own_stand_in_subscription(session)
        groups = [sub for sub, _options in session.shared.values()]
        stand_in = GroupStandIn(client_id, [*groups, *([own] if own is not None else [])], to,
                                self.service.settings.max_queued_messages, own, self.reliable)
        stand_in.messages.extend(taken)
        for group in stand_in.groups:
            self.broker.attach(group, stand_in)  # before the session leaves: no route changes
        stand_in.timer = asyncio.get_running_loop().call_later(
            STAND_IN_TIMEOUT_S, self.drop_stand_in, client_id)
        self.stand_ins[client_id] = stand_in
        self._all_collected.clear()
        return stand_in

    def _own_stand_in_subscription(self, session: MqttSession) -> Subscription | None:
        """A plain subscription with `session`'s own filters, for its stand-in (made while the
        session still holds them: the node's routes do not change)."""
        filters = session.subscription.filters
        if not filters:
            return None
        broker = self.broker
        own = broker.subscription(f"mqtt:{session.client_id}:moving")
        for topic_filter, options in filters.items():
            broker.add_filter(own, topic_filter, options)
        return own

    async def collect(self, client_id: str, to: str) -> dict[str, Any]:
        """The session's new node `to` is in its groups now: the stand-in leaves them, and once
        every push a peer chose this node for before is here (`DataPlane.pushes_flushed`: the
        node's routes may not change at all, when other sessions here hold the same filters),
        what it took goes there. The answer is kept until the stand-in's time is up: a new
        node whose call timed out asks again and gets the same messages, never none."""
        stand_in = self.stand_ins.get(client_id)
        if stand_in is None or stand_in.to != to:
            return {"messages": []}
        if stand_in.collected is None:
            stand_in.collected = asyncio.ensure_future(self._collect(client_id, stand_in))
            stand_in.collected.add_done_callback(lambda _collected: self._note_collected())
        return await asyncio.shield(stand_in.collected)

    def _note_collected(self) -> None:
        if all(stand_in.collected is not None and stand_in.collected.done()
               for stand_in in self.stand_ins.values()):
            self._all_collected.set()

    async def collected_within(self, timeout_s: float) -> bool:
        """Whether every stand-in here is collected (or dropped) within `timeout_s`."""
        try:
            await wait_within(self._all_collected.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _collect(self, client_id: str, stand_in: GroupStandIn) -> dict[str, Any]:
        broker = self.broker
        stand_in.in_routes = False  # the peers stop sending the groups' messages here
        if broker.on_routes_changed is not None:
            broker.on_routes_changed()
        # a peer's pushes come on its own link, not the one its answer to the route change
        # came on: each peer says on its link, behind what it pushed before, that it applied
        # this node's routes as they are now, so once that arrived nothing for the stand-in is
        # still on its way
        flushed = self.plane.pushes_flushed(FLUSH_WAIT_S)
        if flushed is not None:
            await flushed
        self._leave_groups(stand_in)
        if stand_in.dropped:
            self.broker.stats.drop(SLOW_SUBSCRIBER, stand_in.dropped)
            log.warning("cluster: %d group messages for session %r were over the queue limit "
                        "while it moved; dropped", stand_in.dropped, client_id)
        taken, stand_in.messages = stand_in.messages, []
        return {"messages": [
            [group, message.stream, message.shard, message.offset, message_record(message), list(filters)]
            for group, message, filters in taken
        ]}

    def _leave_groups(self, stand_in: GroupStandIn) -> None:
        if stand_in.left:
            return
        stand_in.left = True
        broker = self.broker
        for group in stand_in.groups:
            broker.detach(group, stand_in)
            if not group.consumers and broker.subscriptions.get(group.name) is group:
                broker.remove_subscription(group.name)

    def drop_stand_in(self, client_id: str) -> None:
        stand_in = self.stand_ins.pop(client_id, None)
        if stand_in is None:
            return
        self._note_collected()
        if stand_in.timer is not None:
            stand_in.timer.cancel()
        self._leave_groups(stand_in)
        if stand_in.collected is not None:
            return
        if stand_in.messages:
            log.warning("cluster: %d group messages kept for session %r were never collected by "
                        "its new node; dropped", len(stand_in.messages), client_id)
        if stand_in.state is not None and self.keep is not None:
            task = asyncio.ensure_future(self._keep(stand_in.state))
            self._keeping.add(task)
            self._keeping_by_client[client_id] = task
            task.add_done_callback(self._keeping.discard)
            task.add_done_callback(lambda _task: self._keeping_by_client.pop(client_id, None))

    async def _keep(self, state: SessionSnapshot) -> None:
        assert self.keep is not None
        try:
            await self.keep(state)
        except Exception as exc:  # noqa: BLE001 - etcd away: the older snapshot stays
            log.warning("cluster: cannot write the snapshot of session %r, handed over and never "
                        "collected, to etcd: %s", state.client_id, exc)

    async def keep_uncollected(self) -> None:
        """A graceful stop: every session handed over whose new node has not collected it goes
        to etcd as it left here (`keep`), before the cluster port closes."""
        for client_id in [client_id for client_id, stand_in in self.stand_ins.items()
                          if stand_in.collected is None]:
            self.drop_stand_in(client_id)
        if self._keeping:
            await asyncio.wait(list(self._keeping), timeout=5.0)
