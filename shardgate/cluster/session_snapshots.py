"""MQTT session snapshots in etcd (`/shardgate/<cluster>.state/sessions/<client id>`): what a
node writes of the persistent sessions it holds, so that another can resume them when this
one is gone (`sessions.py` says when each is read).

`SessionSnapshots` keeps etcd's snapshot of each session in agreement with this node: written
when a session opens, changes its subscriptions or goes offline (`saved`, from the MQTT
service through the `RemoteSessions` port), removed when it ends here or started without
persistence (`forgotten`, `opened`); checkpointed while its client is connected and its
cursors move (`checkpoint`); swept once expired (`sweep`, by the controller). Writes go
through the `StateWriter`, batched; reads decode a `SessionSnapshot` of any version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.durable import DurableSubscription
from ..core.message import now_ms
from ..protocols.mqtt.session import NEVER_EXPIRES, MqttSession
from ..protocols.mqtt.snapshot import UNREADABLE, SessionSnapshot
from ..protocols.mqtt.snapshotting import capture
from .etcd import EtcdError, KeyValue
from .set_aside import SetAside, decode_record
from .state_writer import MAX_BATCH_PUTS, StateWriter

if TYPE_CHECKING:
    from ..protocols.mqtt.service import MqttService
    from .control import ClusterNode

log = logging.getLogger(__name__)

# How often a connected persistent session whose cursors moved has its snapshot written to
# etcd (as durable subscriptions' `durables.CHECKPOINT_S`): a holder that dies loses at most
# this much of its sessions' acknowledgements (those messages come again, never fewer).
CHECKPOINT_S = 2.0
# ... and sooner for a bounded number of them: every `SOON_CHECKPOINT_S`, up to
# `MAX_BATCH_PUTS` (one more etcd transaction at most), those checkpointed longest ago first.
SOON_CHECKPOINT_S = 0.5
# The largest session snapshot written to etcd (`etcd_value`): one value alone in a
# transaction of the state writer (`state_writer.MAX_BATCH_BYTES`).
MAX_SNAPSHOT_BYTES = 1_000_000


def checkpoints_due(moved: dict[str, float], now: float) -> list[str]:
    """Which of the sessions whose cursors moved (client id -> when its last checkpoint was
    queued, monotonic seconds) get one now: every one last checkpointed `CHECKPOINT_S` ago or
    more, and up to `MAX_BATCH_PUTS` more last checkpointed at least `SOON_CHECKPOINT_S` ago,
    longest ago first (so sooner checkpoints cost etcd one transaction at most)."""
    due = [client_id for client_id, at in moved.items() if now - at >= CHECKPOINT_S]
    sooner = sorted((at, client_id) for client_id, at in moved.items()
                    if SOON_CHECKPOINT_S <= now - at < CHECKPOINT_S)
    return due + [client_id for _at, client_id in sooner[:MAX_BATCH_PUTS]]


def etcd_value(state: SessionSnapshot, limit: int = MAX_SNAPSHOT_BYTES,
               trimmed: set[str] | None = None) -> bytes:
    """`state` as written to etcd: whole when it fits in `limit` bytes; else without the
    newest of the messages queued for it that no cursor holds (a non-reliable stream's, or a
    shared group's), as a full session queue drops the newest, logged. etcd refuses a larger
    request at all (its default limit is 1.5 MiB), and would refuse every later write of it.
    This snapshot serves only when its holder dies: a move between live nodes carries the
    whole session over the cluster port (`SessionRelease`). `trimmed`: the client ids whose
    trimming was logged already (a connected session's checkpoints would log it every
    write); a session that fits again leaves it, and is logged again if it grows over."""
    value = state.encode()
    if len(value) <= limit or not state.queued:
        if trimmed is not None:
            trimmed.discard(state.client_id)
        return value
    sizes = [len(json.dumps(entry.encode(), separators=(",", ":"))) + 1 for entry in state.queued]
    excess = len(value) - limit
    keep = len(sizes)
    while keep and excess > 0:
        keep -= 1
        excess -= sizes[keep]
    kept = dataclasses.replace(state, queued=state.queued[:keep])
    if trimmed is not None:
        if state.client_id in trimmed:
            return kept.encode()
        trimmed.add(state.client_id)
    log.warning("cluster: the snapshot of MQTT session %r is %d bytes, over the %d etcd takes: "
                "it is written there without the newest %d of its %d queued messages (they move "
                "with the session between live nodes, and are lost only if its node dies)",
                state.client_id, len(value), limit, len(sizes) - keep, len(sizes))
    return kept.encode()


def expired(state: SessionSnapshot, now: int | None = None, holder_gone_ms: int | None = None) -> bool:
    """Whether the session of a snapshot has expired. A snapshot taken while its client was
    connected (`online`) says nothing of when that connection ended: while its node lives, that
    node's expiry timer decides (not expired here); once the node is gone, the session counts
    as disconnected since `holder_gone_ms` (when this node saw it go)."""
    if state.expiry == NEVER_EXPIRES:
        return False
    disconnected = state.disconnected_ms or 0
    if state.online:
        if holder_gone_ms is None:
            return False
        disconnected = max(disconnected, holder_gone_ms)
    return disconnected + state.expiry * 1000 <= (now_ms() if now is None else now)


class SessionSnapshots:
    """Keeps etcd's snapshots of this node's MQTT sessions (module docstring). `releasing`:
    the client ids being handed to another node (shared with `SessionRelease`)."""

    def __init__(self, node: ClusterNode, service: MqttService, writer: StateWriter,
                 releasing: set[str]) -> None:
        self.node = node
        self.service = service
        self.writer = writer
        self.releasing = releasing
        self.prefix = node.settings.prefix.rstrip("/") + ".state/sessions/"
        # client ids whose session here started without persistence, and when: a snapshot of
        # an earlier session of theirs (whichever node wrote it) is void and leaves etcd
        self._void: dict[str, int] = {}
        # when this node saw each node that snapshots name go away (see `expired`)
        self._alive: set[str] = set()
        self._gone_since: dict[str, int] = {}
        # snapshots in etcd that cannot be restored: logged once each, left where they are
        self.set_aside = SetAside(log)
        # the cursors each connected session's snapshot in etcd was last queued with, and when
        self._checkpointed: dict[str, tuple[Any, float]] = {}
        # what each online session's snapshot last held of its subscriptions: saves that change
        # nothing of them (a QoS 2 release) write nothing to etcd
        self._subscribed: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        # sessions whose snapshot is over etcd's limit, logged once (`etcd_value`)
        self._trimmed: set[str] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._checkpointer: asyncio.Task[None] | None = None
        self.checkpoints = 0
        self.swept = 0

    def key(self, client_id: str) -> str:
        return self.prefix + client_id

    def install(self) -> None:
        self.node.view.on_change(self._note_departures)
        self._note_departures()

    def start(self) -> None:
        """Sweep expired sessions' snapshots (the controller does, every `session_sweep_s`),
        also those of nodes that died holding them; checkpoint connected persistent sessions
        whose cursors moved (`checkpoint`)."""
        loop = asyncio.get_running_loop()
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep_loop())
        if self._checkpointer is None:
            self._checkpointer = loop.create_task(self._checkpoint_loop())

    def stop(self) -> None:
        for task in (self._sweeper, self._checkpointer):
            if task is not None:
                task.cancel()
        self._sweeper = self._checkpointer = None

    def read(self, client_id: str, kv: KeyValue | None) -> SessionSnapshot | None:
        """The session snapshot `kv` holds; None (and set aside: the client gets a new
        session, as for a session a single node cannot restore) when it cannot be read."""
        if kv is None:
            return None
        what = f"the snapshot of MQTT session {client_id!r}"
        try:
            record = decode_record(kv.value)
        except ValueError as exc:
            self.set_aside(what, kv, exc)  # not even a JSON object
            return None
        try:
            return SessionSnapshot.decode(record)
        except UNREADABLE as exc:
            self.set_aside(what, None, exc, record)
            return None

    async def keep_released(self, state: SessionSnapshot) -> None:
        """A session this node handed over that its new node never collected (it may not have
        it: its call's answer was lost, then it gave up): etcd's snapshot becomes `state`,
        unless etcd holds a newer one (the new node's, `SessionSnapshot.newer_than`), so a
        later claim resumes it from there rather than from an older snapshot."""
        key = self.key(state.client_id)
        for _attempt in range(3):
            kv = await self.node.state_store.get(key)
            revision = 0
            if kv is not None:
                held = self.read(state.client_id, kv)
                if held is not None and held.newer_than(state):
                    return
                revision = kv.mod_revision
            written, _now = await self.node.state_store.put_at(key, revision, etcd_value(state, trimmed=self._trimmed))
            if written:
                log.info("cluster: session %r handed over and never collected: its snapshot "
                         "in etcd is the one it left with", state.client_id)
                return

    async def drop_moved(self) -> int:
        """At start: drop sessions restored from this node's store that ended or moved while
        this node was away: their snapshot in etcd names another node, or is gone (the client
        started clean elsewhere, or the session expired). On the first start of a data
        directory in a cluster, its sessions (from a single node) get their snapshots instead."""
        dropped = 0
        service = self.service
        for client_id, session in list(service.sessions.items()):
            if session.connection is not None or not session.durable:
                continue
            try:
                kv = await self.node.state_store.get(self.key(client_id))
            except EtcdError as exc:
                log.warning("cluster: cannot check where session %r lives: %s", client_id, exc)
                continue
            try:
                holder = decode_record(kv.value).get("node") if kv is not None else None
            except ValueError as exc:
                # kept here as it is: the snapshot says nothing of where the session lives
                self.set_aside(f"the snapshot of MQTT session {client_id!r}", kv, exc)
                continue
            if holder is None and self.node.first_cluster_start:
                self.went_offline(client_id)  # a single node's session joining the cluster
                continue
            if holder != self.node.node_id:
                self.releasing.add(client_id)
                try:
                    service.remove_session(session)
                finally:
                    self.releasing.discard(client_id)
                service.stop_timers(client_id, publish_will=False)
                dropped += 1
        if dropped:
            log.info("cluster: %d sessions restored here had moved to other nodes or ended; "
                     "dropped", dropped)
        return dropped

    # ------------------------------------------------------------ what the service tells
    def saved(self, client_id: str, *, offline: bool) -> None:
        """The service wrote a persistent session to this node's store: as it went offline,
        or connected (etcd's snapshot follows when its subscriptions changed)."""
        if offline:
            self._subscribed.pop(client_id, None)
            self.went_offline(client_id)
            return
        session = self.service.sessions.get(client_id)
        if session is None:
            return
        subscribed = (tuple(session.subscription.filters), tuple(session.shared))
        if self._subscribed.get(client_id) != subscribed:
            self._subscribed[client_id] = subscribed
            self.went_offline(client_id)  # the same write: the session as it is now

    def forgotten(self, client_id: str) -> None:
        self._subscribed.pop(client_id, None)
        self._trimmed.discard(client_id)
        if client_id not in self.releasing:
            self._sync(client_id)

    def opened(self, client_id: str) -> None:
        """A session opened here (new, resumed or taken over): the registry names this node;
        etcd's snapshot becomes this session's (online), or goes when the session is not
        persistent (an earlier session's snapshot must not come back elsewhere)."""
        session = self.service.sessions.get(client_id)
        if session is not None:
            self.node.claim_session_soon(client_id, session.owner, session.owned)
        else:
            self.node.claim_session_soon(client_id)
        if session is not None and not session.durable:
            self._void[client_id] = now_ms()
        self._sync(client_id)

    def went_offline(self, client_id: str) -> None:
        """The session went offline or changed its subscriptions: its snapshot is written."""
        self._sync(client_id)

    # ------------------------------------------------------------ checkpoints of connected sessions
    @staticmethod
    def _cursors_of(session: MqttSession) -> Any:
        """What a checkpoint is taken for: the session's cursors (position, unacknowledged)
        and its QoS 2 state (the packet ids it answered PUBREC for, those it sent PUBREL for:
        the replicated internal stream holds their changes first, `sessions.exactly_once`,
        and the checkpoint makes etcd's snapshot newer again within `CHECKPOINT_S`)."""
        sub = session.subscription
        qos2 = (frozenset(session.inbound_qos2 - session.qos2_committing),
                frozenset(pid for pid, o in session.inflight.items() if o.released))
        if not isinstance(sub, DurableSubscription):
            return qos2
        return [(key, cursor.position, frozenset(cursor.unacked), frozenset(cursor.pending_redelivery))
                for key, cursor in sub.cursors.items()], qos2

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(SOON_CHECKPOINT_S)
            try:
                self.checkpoint()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("cluster: checkpointing persistent sessions failed")

    def checkpoint(self, now: float | None = None) -> int:
        """Queue a snapshot of the connected persistent sessions here whose cursors moved since
        their last one (written by the state writer, batched): every one last checkpointed
        `CHECKPOINT_S` ago or more, and up to `MAX_BATCH_PUTS` more last checkpointed at least
        `SOON_CHECKPOINT_S` ago, longest ago first. Returns how many were queued."""
        now = time.monotonic() if now is None else now
        seen: dict[str, tuple[Any, float]] = {}
        moved: dict[str, tuple[Any, float]] = {}
        for client_id, session in self.service.sessions.items():
            if session.connection is None or not session.durable or client_id in self.releasing:
                continue
            cursors = self._cursors_of(session)
            last = self._checkpointed.get(client_id)
            if last is not None:
                seen[client_id] = last
                if last[0] == cursors:
                    continue
            moved[client_id] = (cursors, last[1] if last is not None else float("-inf"))
        due = checkpoints_due({client_id: at for client_id, (_cursors, at) in moved.items()}, now)
        for client_id in due:
            self.writer.put(self.key(client_id), self._checkpoint_of(client_id), replace=False)
            seen[client_id] = (moved[client_id][0], now)
        self._checkpointed = seen
        self.checkpoints += len(due)
        return len(due)

    def _checkpoint_of(self, client_id: str) -> Callable[[], bytes | None]:
        def make() -> bytes | None:
            # the session as it is when written; none once it went offline (its own exact
            # write is queued then) or is being handed over or held elsewhere
            session = self.service.sessions.get(client_id)
            if session is None or session.connection is None or not session.durable \
                    or client_id in self.releasing:
                return None
            if self.node.view.sessions.get(client_id) not in (None, self.node.node_id):
                return None
            return etcd_value(capture(session, self.node.node_id), trimmed=self._trimmed)
        return make

    def _sync(self, client_id: str) -> None:
        """Make etcd's snapshot of `client_id` agree with this node, in the background (what
        is written is the state when it is written): a persistent session here is put; a
        session that started here without persistence voids any earlier snapshot; a session
        that ended here removes its snapshot if that still names this node."""
        key = self.key(client_id)
        session_now = self.service.sessions.get(client_id)
        if session_now is not None and session_now.connection is not None:
            self._checkpointed[client_id] = (self._cursors_of(session_now), time.monotonic())
        else:
            self._checkpointed.pop(client_id, None)

        async def write() -> None:
            client = self.node.state_store
            session = self.service.sessions.get(client_id)
            if session is not None and session.durable:
                holder = self.node.view.sessions.get(client_id)
                if holder not in (None, self.node.node_id):
                    # another node took it over (the registry says so) while this one could
                    # not hand it over (stopping): that node's snapshot is the session now
                    return
                await client.put(key, etcd_value(capture(session, self.node.node_id), trimmed=self._trimmed))
                self._void.pop(client_id, None)
                return
            kv = await client.get(key)
            voided = self._void.get(client_id)
            state = self.read(client_id, kv)
            if kv is not None and state is not None:
                if (voided is not None and state.taken_ms <= voided) or (
                        session is None and state.node == self.node.node_id):
                    await client.delete_unchanged(key, kv.mod_revision)
            if self._void.get(client_id) == voided:
                self._void.pop(client_id, None)

        self.writer.run(key, write)

    # ------------------------------------------------------------ expiry everywhere
    def _note_departures(self) -> None:
        alive = set(self.node.view.nodes())
        now = now_ms()
        for node_id in self._alive - alive:
            self._gone_since.setdefault(node_id, now)
        for node_id in alive:
            self._gone_since.pop(node_id, None)
        self._alive = alive

    def holder_gone_ms(self, node_id: Any) -> int | None:
        """None while `node_id` is alive; else since when this node knows it is gone (first
        asked: now, which keeps a session longer rather than shorter)."""
        if node_id in self.node.view.nodes():
            return None
        return self._gone_since.setdefault(str(node_id), now_ms())

    def expired(self, state: SessionSnapshot) -> bool:
        return expired(state, holder_gone_ms=self.holder_gone_ms(state.node))

    async def _sweep_loop(self) -> None:
        interval = max(0.1, float(self.node.settings.session_sweep_s))
        while True:
            await asyncio.sleep(interval)
            if not self.node.is_controller:
                continue
            try:
                await self.sweep()
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                log.warning("cluster: sweeping expired session snapshots failed: %s", exc)

    async def sweep(self) -> int:
        """Delete the snapshots of expired sessions; returns how many."""
        client = self.node.state_store
        kvs, _revision = await client.get_prefix(self.prefix)
        now = now_ms()
        swept = 0
        for kv in kvs:
            try:
                state = SessionSnapshot.decode(kv.value)
            except UNREADABLE as exc:
                self.set_aside("an MQTT session snapshot", kv, exc)
                continue
            if not expired(state, now, self.holder_gone_ms(state.node)):
                continue
            if await client.delete_unchanged(kv.key, kv.mod_revision):
                swept += 1
                log.info("cluster: session %r expired; its snapshot is removed", state.client_id)
        self.swept += swept
        return swept
