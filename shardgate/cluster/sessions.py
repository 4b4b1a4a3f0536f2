"""MQTT persistent sessions that resume on any node of a cluster, with what was published while
their client was away.

The design: a session lives on one node at a time (the registry `sessions/<client id>` in etcd
says which, under that node's lease). Its backlog is never copied: the messages are in the
journals of their shards' owners, and the session's durable cursors (per shard: the next
offset to deliver and the offsets delivered but unacknowledged, in the owner's numbering) say
how far it got. Moving a session moves its state, not its messages:

- **Takeover from a live node.** A CONNECT with clean start 0 for a client whose session is
  elsewhere waits (before CONNACK) while this node claims the registry entry and asks the
  holder over the cluster port (`ReleaseSession`, `state_rpc.py`). The holder ends the old
  connection with DISCONNECT 0x8E, snapshots the session (subscriptions, cursors, in-flight
  packet ids with their messages, QoS 2 receive state, queued messages of non-reliable
  streams) and drops it. This node rebuilds the session from the snapshot; cursors of shards
  it owns replay its own journal, the others read the owner's journal (`shard_reader.OwnerLog`)
  until they meet the live pushes. Unacknowledged messages are resent with DUP, as after a
  restart; QoS 2 releases stay releases. A `ReleaseSession` whose answer does not come in
  time (the holder may have ended the session already) is asked again while the holder is
  live, and the holder keeps what it handed over until this node collects it: this node never
  resumes from an older snapshot then (`_release_from`, `_in_doubt`). The holder's stand-in
  (`session_release.GroupStandIn`) takes the session's messages that were on their way to it
  until this node serves its routes and every peer's earlier pushes have arrived there
  (`RouteSync.pushes_flushed`), then hands them over.
- **The holder is dead.** The snapshot is also kept in etcd, written when the session goes
  offline (one write per disconnect, never per message: an offline session's cursors do not
  move, so that snapshot is exact). The new node resumes from it; the dead node's reliable
  shards are read once it is back. While its client is connected, a session whose cursors
  moved is checkpointed at least every `CHECKPOINT_S` (below), and up to `MAX_BATCH_PUTS` of
  them every `SOON_CHECKPOINT_S`: a holder that died leaves the last checkpoint, and what was
  acknowledged since comes again (at least once, never lost: a checkpoint keeps in-flight
  messages unacknowledged). Its QoS 2 state is newer than that when it changed since: each
  change is replicated in the internal stream (`state_log.StateLog`) before the PUBREC,
  PUBCOMP or PUBREL reporting it leaves (`exactly_once`), and the new node resumes the newer
  of the two (`_newest`).
- **The holder was frozen** (SIGSTOP, or cut off from etcd, past its lease) while its client
  resumed the session on another node: that node's `ReleaseSession` never reached it, and it
  still holds the session as it was when it froze. When the client comes back to it, the
  registry names the other node, so the CONNECT brings the session from there as for a
  session not held here, and the old copy gives way to it (`moved_on`, `_give_way`).
  Resuming the old copy would send the client again everything it acknowledged elsewhere
  since the freeze.
- **The holder stops (SIGTERM).** Its clients reconnect elsewhere while it is still stopping:
  it writes the snapshots of the sessions its stop took offline before its cluster port
  closes (`StateWriter.drain`), so a node whose `ReleaseSession` is refused reads the
  snapshot again and resumes where the client left it.
- **etcd is not the store for cursors in motion.** A connected session moves its cursors with
  every acknowledgement: those stay in the node's own metadata store (as on a single node, saved
  in batches and at stop) and travel exactly at takeover, over the peer link. etcd gets a
  checkpoint of the sessions whose cursors moved every `CHECKPOINT_S`, batched
  (`StateWriter`: up to `MAX_BATCH_PUTS` snapshots per transaction, one transaction at a
  time), so a node with S moving sessions costs etcd at most S / `MAX_BATCH_PUTS`
  transactions per `CHECKPOINT_S` (10,000 sessions: 50 per 2 s). Sooner checkpoints add at
  most one transaction per `SOON_CHECKPOINT_S` (`MAX_BATCH_PUTS` sessions, those checkpointed
  longest ago first): with up to that many moving sessions on a node, each is checkpointed
  every `SOON_CHECKPOINT_S`.

Snapshots live outside the prefix every node watches (`/shardgate/<cluster>.state/`), so a
disconnect is one etcd write that no other node is woken for.

The modules: this one is the new node's side (`SessionHandover`, the MQTT service's
`RemoteSessions` port); `session_release.py` the old node's (ending the session, its
stand-in); `session_snapshots.py` the snapshots in etcd (writes, checkpoints, expiry, sweep);
`session_cursors.py` cursors placed from another node; `state_writer.py` the batched etcd
writer; `state_log.py` the replicated internal stream the QoS 2 state goes to. A snapshot is
a `protocols.mqtt.snapshot.SessionSnapshot`: the cluster reaches the MQTT service only
through that port and the service's own methods, never its attributes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from ..core.message import Message
from ..protocols.mqtt.session import SessionOfAnotherUser
from ..protocols.mqtt.snapshot import UNREADABLE, SessionSnapshot, record_message
from ..protocols.mqtt.snapshotting import capture, rebuild
from .control import ClaimRefused, SessionMovedOn
from .etcd import EtcdError, KeyValue
from .journal_search import ShardUnreadable
from .session_cursors import CursorPlacer
from .session_release import SessionRelease, in_shard_order
from .session_snapshots import SessionSnapshots
from .state_log import StateLog
from .state_rpc import StateCallError, StateRpc
from .state_writer import StateWriter
from .waits import wait_within

if TYPE_CHECKING:
    from ..core.broker import Broker
    from ..protocols.mqtt.service import MqttService
    from ..protocols.mqtt.session import MqttSession
    from .control import ClusterNode

log = logging.getLogger(__name__)

# How long a CONNECT waits for its session to come from another node before it gets a new one.
TAKEOVER_TIMEOUT_S = 5.0
RELEASE_CALL_TIMEOUT_S = 3.0
# How long a node keeps trying to bring a session whose holder may have handed it over
# without the answer arriving (`SessionHandover._settle_doubt`).
SETTLE_DOUBT_S = 60.0
# How long a `ReleaseSession` waits for the session it asks for to arrive here, when this node
# claimed it earlier and is still bringing it (within the caller's RELEASE_CALL_TIMEOUT_S).
ADOPTION_WAIT_S = 2.0
# A graceful stop hands its persistent sessions to live nodes within this long, this many at
# a time (`SessionHandover.hand_over_offline`).
HAND_OVER_S = 10.0
HAND_OVER_PARALLEL = 16
# How long a takeover (CONNACK, a leaving node's handover) waits for what the old node's
# stand-in took for the session while it moved (then it comes in the background).
COLLECT_WAIT_S = 2.0
# How long the new node keeps trying to collect what the old node's stand-in took (within the
# stand-in's own STAND_IN_TIMEOUT_S), and how long one call may take (the old node waits for
# its peers' pushes, up to `session_release.FLUSH_WAIT_S`).
COLLECT_S = 25.0
COLLECT_CALL_TIMEOUT_S = 12.0
# The sessions' QoS 2 state in the replicated internal stream (`state_log.StateLog`), and how
# far before a snapshot's time its records are read (the nodes' clocks may differ by this
# much: as much as the cluster port's signatures allow, `link_auth`).
EXACTLY_ONCE_KIND = "mqtt-sessions"
CLOCK_SKEW_MS = 120_000


class SessionUnavailable(Exception):
    """A persistent session held elsewhere could not be brought here now (etcd or its holder
    not answering): its CONNECT is refused with "server unavailable", never given a new one."""


class SessionHandover:
    """Moves MQTT persistent sessions between this node and the others (module docstring):
    the MQTT service's `RemoteSessions`."""

    def __init__(self, node: ClusterNode, service: MqttService, broker: Broker, placer: CursorPlacer,
                 rpc: StateRpc, writer: StateWriter) -> None:
        self.node = node
        self.service = service
        self.broker = broker
        self.placer = placer
        self.rpc = rpc
        # client ids being handed to another node (their local forget is not an end)
        releasing: set[str] = set()
        self.snapshots = SessionSnapshots(node, service, writer, releasing)
        self.state_log = StateLog(node, broker, EXACTLY_ONCE_KIND)
        self.resumed_from_log = 0
        self.releaser = SessionRelease(node, service, broker, placer.plane, releasing,
                                       self.snapshots.keep_released)
        self.taken_over = 0
        # sessions taken over from a stand-in: how long their queue was when adopted (what came
        # after is put in shard order once the stand-in's messages are in, `in_shard_order`)
        self._window: dict[str, int] = {}
        self._collecting: set[asyncio.Future[None]] = set()
        # sessions this node claimed and is bringing here, done once each is adopted (or not):
        # a later claim's `ReleaseSession` waits for it (`_release`)
        self._adopting: dict[str, asyncio.Future[None]] = {}
        # sessions this node claimed whose holder's `ReleaseSession` answer never came (the
        # holder may have handed them over): the holder, and the claim's user and `owned`
        # (holder None: it was gone, and its state could not be read yet)
        self._in_doubt: dict[str, tuple[str | None, str | None, bool]] = {}
        self._settling: dict[str, asyncio.Task[None]] = {}
        # sessions held here, offline, that another node took over while this one was away
        # (`moved_on`): a CONNECT here brings the session from that node, and this copy gives
        # way to it (`_adopt_taken`)
        self._superseded: dict[str, MqttSession] = {}

    def key(self, client_id: str) -> str:
        return self.snapshots.key(client_id)

    # ------------------------------------------------------------ wiring
    def install(self) -> None:
        self.service.join_cluster(self)
        self.rpc.on_release = self._release
        self.rpc.on_take = self.take_for_peer
        self.snapshots.install()

    def start(self) -> None:
        """Sweep expired snapshots and checkpoint connected sessions (`SessionSnapshots`)."""
        self.snapshots.start()

    def stop(self) -> None:
        self.snapshots.stop()
        for collecting in [*self._collecting, *self._settling.values()]:
            collecting.cancel()

    async def drop_moved(self) -> int:
        return await self.snapshots.drop_moved()

    def opened(self, client_id: str) -> None:
        self.snapshots.opened(client_id)

    # ------------------------------------------------------------ RemoteSessions
    def saved(self, client_id: str, *, offline: bool) -> None:
        self.snapshots.saved(client_id, offline=offline)

    def forgotten(self, client_id: str) -> None:
        self.snapshots.forgotten(client_id)

    def exactly_once(self, session: MqttSession) -> asyncio.Future[None]:
        """The session's QoS 2 state changed: its snapshot goes to the replicated internal
        stream in this turn's batch, taken as the batch is written (module docstring of
        `state_log.py`); the future is done once it is committed there."""
        client_id = session.client_id
        me = self.node.node_id
        releasing = self.snapshots.releasing

        def value() -> bytes | None:
            if self.service.sessions.get(client_id) is not session or client_id in releasing:
                return None  # ended or moved meanwhile: the node it went to has it
            return capture(session, me).encode()

        return self.state_log.put(client_id, value)

    async def _newest(self, client_id: str, state: SessionSnapshot | None) -> SessionSnapshot | None:
        """The session as its last holder left it, when that holder is gone: `state` (its
        etcd snapshot) or, when newer, what the holder replicated as its QoS 2 state changed
        (`exactly_once`): that is what the holder acknowledged PUBRECs, PUBCOMPs and PUBRELs
        by. Raises StateCallError when the internal stream cannot be read now (the CONNECT is
        refused and tried again, never resumed without what it may hold)."""
        if state is None:
            return None
        since = max(0, state.taken_ms - CLOCK_SKEW_MS) if state.taken_ms else 0
        try:
            data = await self.state_log.latest(client_id, since)
        except ShardUnreadable as exc:
            raise StateCallError(f"the QoS 2 state of session {client_id!r}: {exc}") from None
        if data is None:
            return state
        try:
            replicated = SessionSnapshot.decode(data)
        except UNREADABLE as exc:
            self.snapshots.set_aside(f"the replicated state of MQTT session {client_id!r}", None,
                                     exc, data.decode(errors="replace"))
            return state
        if replicated.client_id != client_id or not replicated.newer_than(state):
            return state
        self.resumed_from_log += 1
        log.info("cluster: session %r resumes from the state %s replicated (newer than its "
                 "etcd snapshot)", client_id, replicated.node)
        return replicated

    def moved_on(self, client_id: str) -> bool:
        """Whether the registry names another node for a session held here: that node took it
        over while this one was away (frozen or cut off past its lease, so the takeover's
        `ReleaseSession` never reached it, and the registry entry it had went with its
        lease). The copy here stopped where this node stopped; the session went on there."""
        holder = self.node.view.sessions.get(client_id)
        return holder is not None and holder != self.node.node_id

    def find(self, client_id: str, clean_start: bool, username: str | None = None) -> asyncio.Future[None] | None:
        """A CONNECT for a session not held here waits for its claim (every kind of session:
        the registry orders takeovers) and, when another node held it, for that node to end
        its connection and hand the session over. A session another user made is neither
        claimed nor ended (with `mqtt.session_takeover_by_other_user = "refuse"`): the future
        fails with SessionOfAnotherUser, and the CONNECT is refused as on the holder. A copy
        held here that moved on (`moved_on`) is replaced by what the claim brings."""
        left = self.service.sessions.get(client_id)
        return asyncio.ensure_future(self._find(client_id, clean_start, username, left))

    async def _find(self, client_id: str, clean_start: bool, username: str | None,
                    left: MqttSession | None) -> None:
        if left is None:
            await self._take(client_id, clean_start, username, owned=True)
            return
        self._superseded[client_id] = left
        log.info("cluster: session %r is held here as it was when node %s took it over; it "
                 "comes from there", client_id, self.node.view.sessions.get(client_id))
        try:
            await self._take(client_id, clean_start, username, owned=True)
        finally:
            if self._superseded.get(client_id) is left:
                del self._superseded[client_id]

    def _here(self, client_id: str) -> MqttSession | None:
        """The session held here for `client_id`, unless it is a copy that moved on."""
        session = self.service.sessions.get(client_id)
        if session is None or session is self._superseded.get(client_id):
            return None
        return session

    def _give_way(self, client_id: str) -> None:
        """The copy that moved on leaves this node (its snapshot in etcd, and the session's
        registry entry, are the session's new node's: untouched), for the session the claim
        brought."""
        stale = self._superseded.pop(client_id, None)
        if stale is None or self.service.sessions.get(client_id) is not stale:
            return
        releasing = self.snapshots.releasing
        releasing.add(client_id)
        try:
            self.service.remove_session(stale)
        finally:
            releasing.discard(client_id)
        self.service.stop_timers(client_id, publish_will=False)

    # ------------------------------------------------------------ the new node
    async def _take(self, client_id: str, clean_start: bool, username: str | None, *,
                    owned: bool, check_owner: bool = True, held_by: str | None = None) -> None:
        try:
            await wait_within(
                self._take_now(client_id, clean_start, username, owned=owned,
                               check_owner=check_owner, held_by=held_by),
                TAKEOVER_TIMEOUT_S)
        except SessionOfAnotherUser:
            raise
        except (TimeoutError, EtcdError, StateCallError) as exc:
            if isinstance(exc, TimeoutError) and self._here(client_id) is not None:
                # it came here; only what the old node kept for it while it moved is still on
                # its way (`_collect_from`, in the background): the CONNECT goes on with it
                log.info("cluster: session %r taken over; what it took while it moved comes "
                         "in the background", client_id)
                return
            if not clean_start:
                # the session (and the backlog its cursors hold) is not lost for a moment
                # without etcd: the CONNECT is refused (server unavailable) and tried again
                log.warning("cluster: session %r could not be taken over (%s); its CONNECT is "
                            "refused, to be tried again", client_id, exc)
                raise SessionUnavailable(
                    f"the session could not be brought to this node now ({exc}); try again") from None
            log.warning("cluster: session %r could not be ended elsewhere (%s); it starts anew",
                        client_id, exc)
        except Exception as exc:
            log.exception("cluster: taking session %r over failed", client_id)
            if not clean_start:
                # as without etcd above: never a new, empty session in place of one that
                # may still be held elsewhere
                raise SessionUnavailable(
                    f"the session could not be brought to this node now ({exc}); try again") from None

    def _refuses(self, kv: KeyValue | None, username: str | None) -> bool:
        """Whether the session snapshot `kv` is another user's than `username`'s: asked by
        `ClusterNode.claim_session` when the registry names no node for the session (its
        holder is gone: the registry entry went with that node's lease; a live holder's entry
        says who owns it), in step with the claim's transaction."""
        if kv is None:
            return False
        try:
            state = SessionSnapshot.decode(kv.value)
        except UNREADABLE:
            return False  # set aside when it is taken (`SessionSnapshots.read`)
        if not state.owned or state.owner == username:
            return False
        return not self.snapshots.expired(state)

    async def _take_now(self, client_id: str, clean_start: bool, username: str | None, *,
                        owned: bool, check_owner: bool, held_by: str | None) -> None:
        adopted = asyncio.get_running_loop().create_future()
        earlier = self._adopting.get(client_id)
        self._adopting[client_id] = adopted
        try:
            if earlier is not None:  # this node's earlier claim of it comes first
                await asyncio.wait([earlier], timeout=TAKEOVER_TIMEOUT_S)
            await self._claim_and_adopt(client_id, clean_start, username, owned=owned,
                                        check_owner=check_owner, held_by=held_by, adopted=adopted)
        finally:
            if self._adopting.get(client_id) is adopted:
                del self._adopting[client_id]
            if not adopted.done():
                adopted.set_result(None)

    async def _release(self, request: dict[str, Any]) -> dict[str, Any]:
        """A peer's `ReleaseSession`: a session this node claimed before that peer and is
        still bringing here is handed on once it is here (claims are ordered by etcd, each
        waits only for an earlier one), not answered with "no session" while it is on its
        way (that peer's client would get a new, empty session)."""
        client_id = str(request["client_id"])
        adopting = self._adopting.get(client_id)
        if adopting is not None and not request.get("collect"):
            await asyncio.wait([adopting], timeout=ADOPTION_WAIT_S)
        if (not request.get("collect") and client_id in self._in_doubt
                and client_id not in self.service.sessions):
            # this node claimed it and does not know yet whether its holder handed it over:
            # "no session" would give the asking node's client a new, empty one
            self._settle_soon(client_id)
            return {"in_doubt": True}
        return await self.releaser.release(request)

    async def _claim_and_adopt(self, client_id: str, clean_start: bool, username: str | None, *,
                               owned: bool, check_owner: bool, held_by: str | None,
                               adopted: asyncio.Future[None]) -> None:
        node = self.node
        me = node.node_id
        refuse = check_owner and self.service.settings.session_takeover_by_other_user == "refuse"
        # one transaction (again only when another claim came first): who held it, its last
        # snapshot, and the registry now names this node (and the user claiming it)
        try:
            holder, reads = await node.claim_session(
                client_id, also_read=[self.key(client_id)], owner=username, owned=owned,
                refuse_other_user=refuse,
                vacant_refuses=(self.key(client_id), lambda kv: self._refuses(kv, username)),
                held_by=held_by)
        except ClaimRefused as exc:
            raise SessionOfAnotherUser(str(exc)) from None
        except SessionMovedOn as exc:
            # a leaving node's handover of a session whose client resumed it elsewhere
            # meanwhile: that node has it (taking it from there would take it from its client)
            log.info("cluster: session %r not taken over from %s: %s", client_id, held_by, exc)
            return
        saved_kv = reads[0]
        state = self.snapshots.read(client_id, saved_kv[0] if saved_kv else None)
        doubt = self._in_doubt.get(client_id)
        if doubt is not None and (holder is None or holder == me):
            if self._here(client_id) is not None:
                self._in_doubt.pop(client_id, None)  # it came here after all
            else:
                holder = doubt[0]  # an earlier claim here asked it and never heard back
        if holder is not None and holder != me and holder in node.view.nodes():
            stood_in = False
            try:
                reply = await self._release_from(str(holder), client_id, clean_start,
                                                 (username, owned))
                released = reply.get("state")
                state = None if released is None else self._released(client_id, released)
                stood_in = bool(reply.get("stand_in"))
                if released is None and doubt is not None and not clean_start:
                    # asked again after an answer that never came: the holder's stand-in is
                    # gone, and what it kept is in etcd (`SessionRelease.drop_stand_in`)
                    state = await self._newest(client_id, self.snapshots.read(
                        client_id, await node.state_store.get(self.key(client_id))))
            except StateCallError as exc:
                log.warning("cluster: node %s did not hand session %r over (%s); resuming from "
                            "its last snapshot", holder, client_id, exc)
                # read again: a holder that stops gracefully writes its sessions' snapshots
                # (also those it handed over and that were never collected) before its
                # cluster port closes, maybe after the claim above read the older one
                state = self.snapshots.read(client_id, await node.state_store.get(self.key(client_id)))
                if not clean_start:
                    state = await self._newest(client_id, state)
            self._in_doubt.pop(client_id, None)
            if stood_in:
                # the holder's stand-in takes the session's messages there until this node
                # serves its routes (adopted, and the peers know), then hands over what it
                # took: CONNACK (and a leaving node's handover) waits for that, bounded by
                # COLLECT_WAIT_S (then it comes in the background)
                try:
                    await self._adopt_taken(client_id, clean_start, state, stood_in=True)
                finally:
                    adopted.set_result(None)
                    collecting = asyncio.ensure_future(self._collect_from(str(holder), client_id))
                    self._collecting.add(collecting)
                    collecting.add_done_callback(self._collecting.discard)
                with contextlib.suppress(TimeoutError):
                    await wait_within(asyncio.shield(collecting), COLLECT_WAIT_S)
                return
        elif holder != me and not clean_start and self._here(client_id) is None:
            # its holder is gone: its last snapshot, or the newer state it replicated
            try:
                state = await self._newest(client_id, state)
            except StateCallError:
                # The registry names this node now, and the session is not here: a peer
                # asking for it (its client resumes there) must wait, not hear "no session"
                # and give the client a new, empty one. This node brings it in the background.
                self._in_doubt[client_id] = (holder, username, owned)
                self._settle_soon(client_id)
                raise
        self._in_doubt.pop(client_id, None)
        await self._adopt_taken(client_id, clean_start, state)

    async def _release_from(self, holder: str, client_id: str, clean_start: bool,
                            claimant: tuple[str | None, bool]) -> dict[str, Any]:
        """`holder`'s `ReleaseSession` answer. A call whose outcome is unknown (it timed out:
        the holder may have ended the session and kept it for this node, `SessionRelease`)
        is made again while the holder is live: resuming from an older snapshot then would
        lose what the holder handed over. While unknown, a later claim here asks the holder
        again (`_in_doubt`), and this node settles it in the background when no client does
        (`_settle_doubt`). Raises StateCallError when the holder did not do it (refused, or
        its cluster port is closed: a stopping holder wrote what it kept to etcd before)."""
        request = {"client_id": client_id, "to": self.node.node_id, "clean_start": clean_start}
        if clean_start:
            return await self.rpc.release_session(holder, request, RELEASE_CALL_TIMEOUT_S)
        self._in_doubt[client_id] = (holder, *claimant)
        settled = False
        try:
            while True:
                try:
                    reply = await self.rpc.release_session(holder, request, RELEASE_CALL_TIMEOUT_S)
                except StateCallError as exc:
                    if not exc.outcome_unknown or holder not in self.node.view.nodes():
                        settled = True
                        raise
                    log.info("cluster: asking node %s again for session %r (%s)", holder,
                             client_id, exc)
                    await asyncio.sleep(0.1)
                    continue
                if reply.get("in_doubt"):  # the holder is waiting on its own earlier holder
                    await asyncio.sleep(0.2)
                    continue
                settled = True
                return reply
        finally:
            if not settled:  # (cancelled: this CONNECT's time is up) settled later
                self._settle_soon(client_id)

    def _settle_soon(self, client_id: str) -> None:
        if client_id in self._settling:
            return
        task = asyncio.ensure_future(self._settle_doubt(client_id))
        self._settling[client_id] = task
        task.add_done_callback(lambda _task: self._settling.pop(client_id, None))

    async def _settle_doubt(self, client_id: str) -> None:
        """Bring here a session whose holder may have handed it to this node without the
        answer arriving (`_release_from`), when no client claims it meanwhile: the registry
        names this node, so until then no other node could resume it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_DOUBT_S
        while loop.time() < deadline:
            await asyncio.sleep(0.5)
            doubt = self._in_doubt.get(client_id)
            if doubt is None or self._here(client_id) is not None:
                self._in_doubt.pop(client_id, None)
                return
            if client_id in self._adopting:
                continue  # a claim here is under way
            _holder, username, owned = doubt
            with contextlib.suppress(SessionUnavailable):
                await self._take(client_id, False, username, owned=owned, check_owner=False)
        if self._in_doubt.pop(client_id, None) is not None:
            log.warning("cluster: session %r: whether its last holder handed it over stays "
                        "unknown", client_id)

    def _released(self, client_id: str, released: Any) -> SessionSnapshot | None:
        """The snapshot a holder's `ReleaseSession` answer carries; None (set aside: the
        client gets a new session) when it cannot be read."""
        try:
            return SessionSnapshot.decode(released)
        except UNREADABLE as exc:
            self.snapshots.set_aside(f"the snapshot of MQTT session {client_id!r}", None, exc,
                                     released)
            return None

    async def take_for_peer(self, request: dict[str, Any]) -> dict[str, Any]:
        """A leaving node asks this one to take a persistent session over (offline): as if its
        client connected here, but no connection attaches."""
        client_id = str(request["client_id"])
        if client_id in self.service.sessions:
            return {"taken": False}
        owner = request.get("owner")
        try:
            # the registry names the session's own owner (the leaving node's), as it did there;
            # taken only while the registry names the leaving node (`from`): a client that
            # resumed its session elsewhere meanwhile keeps it there
            held_by = request.get("from")
            await self._take(client_id, False, None if owner is None else str(owner),
                             owned="owner" in request, check_owner=False,
                             held_by=None if held_by is None else str(held_by))
        except SessionUnavailable as exc:
            return {"taken": False, "error": str(exc)}
        return {"taken": client_id in self.service.sessions}

    async def hand_over_offline(self, timeout_s: float = HAND_OVER_S) -> int:
        """A graceful stop, once its clients are gone and before its cluster port closes: every
        persistent session held here goes to a live node that is not leaving (spread over
        them), with what it holds, so that what is published for it from now on is kept there
        until its client comes back (a node that keeps no session for it would let non-reliable
        messages go). Bounded by `timeout_s`; what is not handed over stays in its etcd
        snapshot, as before. Returns how many were handed over."""
        me = self.node.node_id
        targets = sorted(node for node, registration in self.node.view.registrations.items()
                         if node != me and not registration.leaving)
        clients = [client_id for client_id, session in self.service.sessions.items()
                   if session.durable and session.connection is None]
        if not targets or not clients:
            return 0
        limit = asyncio.Semaphore(HAND_OVER_PARALLEL)
        handed = 0

        async def one(index: int, client_id: str) -> None:
            nonlocal handed
            target = targets[index % len(targets)]
            async with limit:
                session = self.service.sessions.get(client_id)
                if session is None:
                    return  # its client took it elsewhere meanwhile
                request: dict[str, Any] = {"client_id": client_id, "from": me}
                if session.owned:
                    request["owner"] = session.owner
                try:
                    reply = await self.rpc.take_session(target, request, TAKEOVER_TIMEOUT_S)
                except StateCallError as exc:
                    log.warning("cluster: node %s did not take session %r over: %s", target,
                                client_id, exc)
                    return
                if reply.get("taken"):
                    handed += 1

        tasks = [asyncio.ensure_future(one(index, client_id)) for index, client_id in enumerate(clients)]
        _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        log.info("cluster: %d of %d persistent sessions handed over to live nodes", handed,
                 len(clients))
        await self._stand_ins_collected(timeout_s)
        return handed

    async def _stand_ins_collected(self, timeout_s: float) -> None:
        """Wait (bounded) until the new nodes have collected what this node's stand-ins took
        for the sessions handed over: the stand-ins need this node's links and cluster port."""
        if await self.releaser.collected_within(timeout_s):
            return
        stand_ins = self.releaser.stand_ins
        log.warning("cluster: %d sessions handed over did not collect what was kept for them "
                    "here while they moved", sum(1 for stand_in in stand_ins.values()
                                                 if stand_in.collected is None))
        await self.releaser.keep_uncollected()

    async def _collect_from(self, holder: str, client_id: str) -> None:
        """What `holder`'s stand-in took for the session: to the session here (queued for it,
        as for any offline member), or to nobody when the session did not come here. Asked
        once every peer serves this node's routes for the session (the stand-in leaves then:
        a peer that still knew only the holder would send the session's messages nowhere),
        and asked again when a call fails (the holder keeps its answer for the retries)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + COLLECT_S
        while (ready := self.placer.plane.routes_ready()) is not None and loop.time() < deadline:
            await ready
        request = {"client_id": client_id, "to": self.node.node_id, "collect": True}
        while True:
            try:
                reply = await self.rpc.release_session(
                    holder, request, max(1.0, min(COLLECT_CALL_TIMEOUT_S, deadline - loop.time())))
                break
            except StateCallError as exc:
                # (also while the holder is out of the view: a loaded holder whose lease ran
                # out registers again, and its stand-in waits for this node until then)
                if loop.time() >= deadline:
                    log.warning("cluster: node %s did not hand over the messages it took for "
                                "session %r while it moved (%s)", holder, client_id, exc)
                    return
                log.info("cluster: asking node %s again for the messages of session %r (%s)",
                         holder, client_id, exc)
                await asyncio.sleep(0.2)
        session = self.service.sessions.get(client_id)
        stand_in = self.releaser.stand_ins.get(client_id)  # the session moved on meanwhile
        if stand_in is not None and stand_in.collected is not None:
            stand_in = None  # (and its new node collected already)
        start = self._window.pop(client_id, None)
        lost = 0
        for group, stream, shard, offset, data, *matched in reply.get("messages", []):
            message = _message(data, stream, shard, offset)
            filters = tuple(matched[0]) if matched else ()
            if message is None:
                lost += 1
            elif session is not None and not group:
                own = session.subscription
                wanted = [topic_filter for topic_filter in filters if topic_filter in own.filters]
                if wanted:  # (none: the session unsubscribed meanwhile)
                    session.deliver(message, own, wanted)
            elif session is not None and group in session.shared:
                session.deliver(message, session.shared[group][0], ())
            elif stand_in is not None:
                stand_in.messages.append((group, message, filters))
            else:
                lost += 1
        if session is not None and start is not None:
            in_shard_order(session, start, self.releaser.reliable)
        if lost:
            log.warning("cluster: %d messages taken for session %r while it moved had nowhere to "
                        "go here", lost, client_id)

    async def _adopt_taken(self, client_id: str, clean_start: bool, state: SessionSnapshot | None,
                           *, stood_in: bool = False) -> None:
        if self._here(client_id) is not None:
            return  # a connection here made one meanwhile
        if clean_start or state is None or self.snapshots.expired(state):
            return  # a new session: opening it replaces or removes the snapshot (`opened`)
        self._give_way(client_id)
        try:
            session = rebuild(self.service, state, self.placer.place_snapshot, _unreadable)
        except UNREADABLE as exc:
            # the client gets a new session, as for a session a single node cannot restore
            self.snapshots.set_aside(f"the snapshot of MQTT session {client_id!r}", None, exc,
                                     state.to_dict())
            return
        if stood_in:
            # what comes from here on (the stand-in's, then the pushes) is put in shard order
            self._window[client_id] = len(session.queue)
        self.taken_over += 1
        log.info("cluster: session %r taken over from %s", client_id, state.node)
        self.snapshots.went_offline(client_id)  # etcd now names this node
        # CONNACK waits (bounded) until the peers know this node serves the session's routes:
        # a message published after it reaches the session here, as after a SUBACK (its
        # cursors replay only what the owners' reliable shards held when it came), and the
        # old node's stand-in can leave. Nothing to wait for when the peers know them already.
        ready = self.broker.routes_ready()
        if ready is not None:
            await ready


def _unreadable(entry: Any, exc: Exception) -> None:
    log.warning("cluster: a handed-over message of %s/%d@%d is unreadable: %s", entry.stream,
                entry.shard, entry.offset, exc)


def _message(data: str, stream: str, shard: int, offset: int) -> Message | None:
    try:
        return record_message(data, stream, shard, offset)
    except ValueError as exc:
        log.warning("cluster: a handed-over message of %s/%d@%d is unreadable: %s", stream, shard,
                    offset, exc)
        return None
