"""Link inboxes: the receiving end of the peers' links. Each peer's link session has an inbox
(`_Inbox`) that applies its frames once each, in order: the routes (`routes.RemoteRoutes`), the
retained messages (`retained_sync.py`), the pushes (dispatched here to local subscribers), then
the forwarded publishes (stored by `owner_store.py`); it answers each frame once, and again when
the peer sends it again on a new stream.

A peer is a publisher like any other (`core.backpressure`): when its pushes fill a subscriber's
queue here, its link stops being read (`_PeerPushes`), so TCP holds the peer, whose own
publishers are then held by their link's credit (`peer_link.PUSH_HIGH_WATER`); what was read
meanwhile waits in the inbox's backlog.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..core.records import encode_message
from ..proto import cluster_pb2 as pb
from .cluster_port import LinkReplies
from .frames import (
    NO_GROUPS,
    RecordFormatError,
    message_from_push,
    record_of,
    routes_from_update,
    unpack_records,
)
from .link import LinkForgotten

if TYPE_CHECKING:
    from ..core.message import Message
    from .data_plane import DataPlane

log = logging.getLogger(__name__)


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


class Inboxes:
    """What this node applied of each peer's link session (one per data plane; the
    `cluster_port.LinkReceiver`)."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.remote = plane.remote
        self.links = plane.links
        self.stats = plane.stats
        self._inboxes: dict[str, _Inbox] = {}

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
                self.plane.sources.read_owner_again(peer)
                # its routes are those of its old session until the new one's arrive: what is
                # stored meanwhile waits for them
                self.remote.forget(peer)
                self.plane.unrouted.routes_known.discard(peer)
                self.plane.unrouted.refresh()
            self.plane.route_sync.pushes_under.pop(peer, None)  # a new session tells again
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
        if frame.replica:
            # (unnumbered, answered on the stream they came by: see `replica_rpc.py`)
            self._replica(peer, frame.replica, reply)
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

    def _replica(self, peer: str, requests: Sequence[pb.ReplicaRequest],
                 reply: Callable[[pb.PeerReply], None]) -> None:
        self.plane.replicas.serve_link(peer, requests, reply)

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
                if peer not in self.plane.unrouted.routes_known:
                    self.plane.unrouted.routes_known.add(peer)
                    # (the held messages it wants go before the answer below says so)
                    self.plane.unrouted.refresh()
            else:
                self.remote.apply(peer, delta)
            if update.generation:
                # what this node pushes from now on follows them: tell the peer behind what
                # it pushed before (`pushes_settled` on its side)
                back = self.links.get(peer)
                if back is not None:
                    back.mark_routes_applied(update.generation)
        if frame.retained:
            self.plane.retained_sync.apply(frame.retained)
        if frame.pushes_lost:
            # before this frame's pushes move the cursors past what was lost
            self.plane.sources.read_owner_again(peer)
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
        if frame.routes_applied:
            self.plane.route_sync.pushes_applied_under(peer, frame.routes_applied)
        if frame.forwards or frame.batches:
            self.plane.store.store_forwards(sequence, frame.forwards, frame.batches, inbox.answer)
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
        broker = self.plane.broker
        dispatch = broker.dispatch
        received = self.plane.sources.received
        publisher = inbox.publisher
        with broker.back_pressure.publishing(publisher):
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
