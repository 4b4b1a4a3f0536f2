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
  restart; QoS 2 releases stay releases.
- **The holder is dead.** The snapshot is also kept in etcd, written when the session goes
  offline (one write per disconnect, never per message: an offline session's cursors do not
  move, so that snapshot is exact). The new node resumes from it; the dead node's reliable
  shards are read once it is back. While its client is connected, a session whose cursors
  moved is checkpointed at least every `CHECKPOINT_S` (below), and up to `MAX_BATCH_PUTS` of
  them every `SOON_CHECKPOINT_S`: a holder that died leaves the last checkpoint, and what was
  acknowledged since comes again (at least once, never lost: a checkpoint keeps in-flight
  messages unacknowledged).
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
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..core.durable import DurableSubscription
from ..core.message import Message, now_ms
from ..core.outbox import SLOW_SUBSCRIBER
from ..core.records import RecordFormatError, decode_to_message, encode_message
from ..core.subscriptions import Subscription, SubscriptionType
from ..protocols.mqtt import packets as p
from ..protocols.mqtt.session import (
    NEVER_EXPIRES,
    MqttSession,
    Outgoing,
    Queued,
    SessionOfAnotherUser,
    SubscriptionOptions,
)
from . import keys
from .control import ClaimRefused
from .etcd import EtcdError, KeyValue, delete_op, mod_revision_is, put_op
from .set_aside import UNREADABLE, SetAside, decode_record
from .shard_reader import OwnerLog
from .state_rpc import StateCallError, StateRpc

if TYPE_CHECKING:
    from ..core.broker import Broker
    from ..protocols.mqtt.service import MqttService
    from .control import ClusterNode
    from .data_plane import DataPlane

log = logging.getLogger(__name__)

# How long a CONNECT waits for its session to come from another node before it gets a new one.
TAKEOVER_TIMEOUT_S = 5.0
RELEASE_CALL_TIMEOUT_S = 3.0
# A graceful stop hands its persistent sessions to live nodes within this long, this many at
# a time (`SessionHandover.hand_over_offline`).
HAND_OVER_S = 10.0
# How long a takeover (CONNACK, a leaving node's handover) waits for what the old node's
# stand-in took for the session while it moved (then it comes in the background).
COLLECT_WAIT_S = 2.0
HAND_OVER_PARALLEL = 16
# How long a node that handed a session over keeps its shared groups' messages for the new
# node (`GroupStandIn`) when that node does not collect them (it died meanwhile).
STAND_IN_TIMEOUT_S = 30.0
# A cursor the old node did not have for a shard starts this long before the snapshot: that
# node had received no matching message of the shard, so nothing there is delivered twice.
NO_CURSOR_MARGIN_MS = 5_000
SNAPSHOT_VERSION = 1
# Streams every node keeps for itself (its $SYS topics): never handed over.
LOCAL_STREAMS = frozenset({"sys"})
# How often a connected persistent session whose cursors moved has its snapshot written to
# etcd (as durable subscriptions' `durables.CHECKPOINT_S`): a holder that dies loses at most
# this much of its sessions' acknowledgements (those messages come again, never fewer).
CHECKPOINT_S = 2.0
# ... and sooner for a bounded number of them: every `SOON_CHECKPOINT_S`, up to
# `MAX_BATCH_PUTS` (one more etcd transaction at most), those checkpointed longest ago first.
SOON_CHECKPOINT_S = 0.5
# One etcd transaction of the state writer holds at most this many puts (etcd's
# --max-txn-ops is 128) and this many bytes of values (its request limit is 1.5 MiB).
MAX_BATCH_PUTS = 100
MAX_BATCH_BYTES = 1_000_000


def checkpoints_due(moved: dict[str, float], now: float) -> list[str]:
    """Which of the sessions whose cursors moved (client id -> when its last checkpoint was
    queued, monotonic seconds) get one now: every one last checkpointed `CHECKPOINT_S` ago or
    more, and up to `MAX_BATCH_PUTS` more last checkpointed at least `SOON_CHECKPOINT_S` ago,
    longest ago first (so sooner checkpoints cost etcd one transaction at most)."""
    due = [client_id for client_id, at in moved.items() if now - at >= CHECKPOINT_S]
    sooner = sorted((at, client_id) for client_id, at in moved.items()
                    if SOON_CHECKPOINT_S <= now - at < CHECKPOINT_S)
    return due + [client_id for _at, client_id in sooner[:MAX_BATCH_PUTS]]


class SessionUnavailable(Exception):
    """A persistent session held elsewhere could not be brought here now (etcd or its holder
    not answering): its CONNECT is refused with "server unavailable", never given a new one."""


def _message_data(message: Message) -> str:
    return base64.b64encode(encode_message(message)).decode()


def _message(data: str, stream: str, shard: int, offset: int) -> Message | None:
    try:
        return decode_to_message(base64.b64decode(data), stream, shard, offset)
    except (RecordFormatError, ValueError) as exc:
        log.warning("cluster: a handed-over message of %s/%d@%d is unreadable: %s", stream, shard, offset, exc)
        return None


def cursor_state(sub: DurableSubscription) -> tuple[list[list[Any]], list[list[Any]]]:
    """A durable subscription's cursors ([stream, shard, position, unacked offsets]) and the
    unacknowledged messages themselves ([stream, shard, offset, record]), for another node."""
    cursors = []
    messages = []
    for (stream, shard), cursor in sub.cursors.items():
        unacked = sorted(set(cursor.unacked) | set(cursor.pending_redelivery))
        cursors.append([stream, shard, cursor.position, unacked])
        for offset in unacked:
            delivery = cursor.unacked.get(offset)
            message = delivery.message if delivery is not None else cursor.restored.get(offset)
            if message is None:
                message = sub.read_message(stream, shard, offset)
            if message is not None:
                messages.append([stream, shard, offset, _message_data(message)])
    return cursors, messages


class CursorPlacer:
    """Puts cursors that come from another node on a durable subscription here: over this
    node's journal for the shards it owns, over the owner's (`OwnerLog`) for the others."""

    def __init__(self, node: ClusterNode, broker: Broker, plane: DataPlane, rpc: StateRpc) -> None:
        self.node = node
        self.broker = broker
        self.plane = plane
        self.rpc = rpc
        # Restored cursors still waiting for the shard map to name their shard's owner.
        self._unplaced_left = False

    def place(self, sub: DurableSubscription, cursors: list[list[Any]], messages: list[list[Any]],
              taken_ms: int) -> dict[tuple[str, int, int], Message]:
        """Place every cursor of a snapshot (before the subscription's filters are added, so
        that every push they bring is kept); shards the snapshot has no cursor for start a
        little before it was taken. Returns the handed-over messages by (stream, shard, offset)."""
        broker = self.broker
        found: dict[tuple[str, int], list[Message]] = {}
        for stream, shard, offset, data in messages:
            message = _message(data, stream, shard, offset)
            if message is not None:
                found.setdefault((stream, shard), []).append(message)
        placed: set[tuple[str, int]] = set()
        for stream, shard, position, unacked in cursors:
            shard_log = self._log_for(sub, stream, shard, position)
            if shard_log is None and stream not in broker.streams:
                continue
            sub.place_cursor(stream, shard, shard_log, int(position), unacked, found.get((stream, shard), ()))
            placed.add((stream, shard))
        since = taken_ms - NO_CURSOR_MARGIN_MS
        for broker_stream in broker.streams.values():
            for shard_entry in broker_stream.shards:
                key = (broker_stream.name, shard_entry.index)
                if key in placed or shard_entry.log is None or broker_stream.name in LOCAL_STREAMS:
                    continue
                shard_log = self._log_for(sub, broker_stream.name, shard_entry.index, None, since)
                if shard_log is not None:
                    start = 0 if isinstance(shard_log, OwnerLog) else shard_log.offset_for_timestamp(since)
                    sub.place_cursor(broker_stream.name, shard_entry.index, shard_log, start)
        if self.node.floors is not None:
            self.node.floors.report_soon()  # the owners keep what these cursors still need
        return {(m.stream, m.shard, m.offset): m for listed in found.values() for m in listed}

    def replay_restored(self) -> int:
        """Once the node has joined (the shard map is known): place the durable cursors this
        node restored from its own store, which waited unplaced until now (neither replaying
        nor taking pushes: `Broker.restored_cursors_wait`). On shards this node owns they
        continue over its journal; on shards another node owns they continue from that owner's
        journal at their saved floor (what was pushed here before the restart went with the
        process), then on the pushes, so unacknowledged messages come again. A cursor whose
        shard has no owner yet is placed when the shard map names one. Returns how many were
        placed on other owners' journals."""
        self.broker.restored_cursors_placed()
        count = self._place_waiting()
        if count:
            log.info("cluster: %d restored cursors replay from their shards' owners", count)
        if self._unplaced_left:
            self.node.view.on_change(self._place_when_owned)
        return count

    def _place_when_owned(self) -> None:
        if self._unplaced_left:
            self._place_waiting()

    def _waiting(self) -> list[tuple[DurableSubscription, Any]]:
        return [
            (sub, cursor)
            for sub in list(self.broker.subscriptions.values()) if isinstance(sub, DurableSubscription)
            for cursor in sub.unplaced_cursors()
        ]

    def _place_waiting(self) -> int:
        me = self.node.node_id
        count = 0
        self._unplaced_left = False
        for sub, cursor in self._waiting():
            stream, shard = cursor.stream, cursor.shard
            assignment = self.node.view.leader(stream, shard)
            if assignment is None:
                self._unplaced_left = True  # placed when the shard map names its owner
                continue
            if assignment.leader == me:
                sub.place_restored(cursor, None)
                continue
            sub.place_restored(cursor, self._owner_log(sub, stream, shard))
            count += 1
        return count

    def _owner_log(self, sub: DurableSubscription, stream: str, shard: int) -> Callable[[int], Any]:
        def read_from(start: int) -> Any:
            return OwnerLog(self.rpc, self.plane, stream, shard, start, self._filters_of(sub))
        return read_from

    @staticmethod
    def _filters_of(sub: DurableSubscription) -> Callable[[], list[str]]:
        return lambda: list(sub.filters)

    def _log_for(self, sub: DurableSubscription, stream: str, shard: int, position: int | None,
                 since_ms: int | None = None) -> Any:
        broker_stream = self.broker.streams.get(stream)
        if broker_stream is None or shard >= len(broker_stream.shards):
            return None
        local = broker_stream.shards[shard].log
        if local is None:
            return None
        assignment = self.node.view.leader(stream, shard)
        if assignment is None or assignment.leader == self.node.node_id:
            return local
        return OwnerLog(self.rpc, self.plane, stream, shard, position or 0,
                        lambda: list(sub.filters), since_ms)


class _Put:
    """A queued put whose value is made when it is written (`make`: bytes, or None to skip)."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], bytes | None]) -> None:
        self.make = make


class StateWriter:
    """Writes snapshots to etcd in the background, the latest per key, in order, retrying
    while etcd is away. A value is made when it is written (`make` returns the bytes to put,
    or None to skip), so a burst of changes is one write. Puts queued one after another go
    to etcd together, up to `MAX_BATCH_PUTS` keys and `MAX_BATCH_BYTES` per transaction, one
    transaction at a time: a node's writes cost etcd one request per batch."""

    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        self._pending: dict[str, _Put | Callable[[], Awaitable[None]]] = {}
        self._wake = asyncio.Event()
        # set while nothing is queued or being written
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self.batches = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def put(self, key: str, make: Callable[[], bytes | None], *, replace: bool = True) -> None:
        """Queue a put of `key`; with `replace` False, a change of `key` already queued (which
        writes the state of its own moment) stays and this one is dropped."""
        if not replace and key in self._pending:
            return
        self._queue(key, _Put(make))

    def delete_if_mine(self, key: str, still_gone: Callable[[], bool]) -> None:
        """Delete `key` if its snapshot names this node (another may hold it by now)."""
        async def delete() -> None:
            if not still_gone():
                return
            kv = await self.node.client.get(key)
            if kv is None or _holder_in(kv.value) != self.node.node_id:
                return
            await self.node.client.txn([mod_revision_is(key, kv.mod_revision)], [delete_op(key)])
        self._queue(key, delete)

    def run(self, key: str, write: Callable[[], Awaitable[None]]) -> None:
        """Queue `write` as the latest change of `key` (it replaces one not yet made)."""
        self._queue(key, write)

    def _queue(self, key: str, write: _Put | Callable[[], Awaitable[None]]) -> None:
        self._pending.pop(key, None)
        self._pending[key] = write
        self._idle.clear()
        self._wake.set()

    def _take_puts(self) -> list[tuple[str, _Put]]:
        """The puts at the head of the queue, as many as one transaction takes."""
        taken: list[tuple[str, _Put]] = []
        for key, write in self._pending.items():
            if not isinstance(write, _Put) or len(taken) >= MAX_BATCH_PUTS:
                break
            taken.append((key, write))
        for key, _write in taken:
            del self._pending[key]
        return taken

    async def _write_puts(self, puts: list[tuple[str, _Put]]) -> None:
        """Put the values made now, in transactions of at most `MAX_BATCH_BYTES` (one larger
        value goes alone)."""
        chunk: list[Any] = []
        size = 0
        for key, put in puts:
            value = put.make()
            if value is None:
                continue
            if chunk and size + len(value) > MAX_BATCH_BYTES:
                await self.node.client.txn([], chunk)
                self.batches += 1
                chunk, size = [], 0
            chunk.append(put_op(key, value))
            size += len(value)
        if chunk:
            await self.node.client.txn([], chunk)
            self.batches += 1

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                puts = self._take_puts()
                if puts:
                    try:
                        await self._write_puts(puts)
                    except Exception as exc:  # noqa: BLE001 - retried while etcd is away
                        log.warning("cluster: cannot write %d snapshots to etcd yet (%s); retrying",
                                    len(puts), exc)
                        for key, put in puts:
                            self._pending.setdefault(key, put)
                        await asyncio.sleep(0.5)
                    continue
                key = next(iter(self._pending))
                write = self._pending.pop(key)
                assert not isinstance(write, _Put)
                try:
                    await write()
                except Exception as exc:  # noqa: BLE001 - retried while etcd is away
                    log.warning("cluster: cannot write %s to etcd yet (%s); retrying", key, exc)
                    self._pending.setdefault(key, write)
                    await asyncio.sleep(0.5)
            self._idle.set()

    async def drain(self, timeout_s: float = 2.0) -> None:
        """Wait (bounded) until every queued write is made: a graceful stop's last snapshots,
        before the node's cluster port closes (`SessionHandover._take_now` reads them then)."""
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout_s)

    async def stop(self, drain_s: float = 2.0) -> None:
        if self._task is None:
            return
        await self.drain(drain_s)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None


def snapshot(session: MqttSession, node_id: str, *, group_messages: bool = False) -> dict[str, Any]:
    """Everything needed to resume `session` on another node (JSON). With `group_messages`
    (a handover to a live node), also what its shared subscription groups handed it and it
    has not acknowledged, in flight or queued: a group's message stays with the member it was
    given to, as it does on one node while that member is offline [MQTT-4.8.2], so it follows
    the member to its new node (a live group keeps no cursor of its own to replay it from)."""
    sub = session.subscription
    own = [
        [f, o.qos, o.no_local, o.retain_as_published, o.retain_handling, o.subscription_id]
        for f, o in sub.filters.items()
    ]
    shared = [
        [name, shared_sub.type.value, list(shared_sub.filters), o.qos, o.retain_as_published, o.subscription_id]
        for name, (shared_sub, o) in session.shared.items()
    ]
    cursors, messages = cursor_state(sub) if isinstance(sub, DurableSubscription) else ([], [])
    inflight = [
        [pid, o.message.stream, o.message.shard, o.message.offset, o.qos, o.released, o.retain,
         list(o.subscription_ids)]
        for pid, o in session.inflight.items()
        if o.source is sub and o.message.offset >= 0
    ]
    shared_inflight = []
    if group_messages:
        for pid, o in session.inflight.items():
            group = _group_of(session, o.source)
            if group is not None:
                message = o.message
                shared_inflight.append([pid, group, message.stream, message.shard, message.offset,
                                        o.qos, o.released, o.retain, list(o.subscription_ids),
                                        _message_data(message)])
    # queued messages no cursor holds (non-reliable streams, shared groups): carried as they
    # are, in their order; a group's entry ends with the group's name
    queued: list[list[Any]] = []
    for item in session.queue:
        if item.source is not None and item.source is not sub:
            group = _group_of(session, item.source) if group_messages else None
            if group is not None:
                message = item.message
                queued.append([message.stream, message.shard, message.offset, item.qos, item.retain,
                               list(item.subscription_ids), _message_data(message), group])
            continue  # without a handover, the queue of a group dies with this node
        message = item.message
        cursor = sub.cursors.get((message.stream, message.shard)) if isinstance(sub, DurableSubscription) else None
        if cursor is not None and message.offset in cursor.unacked:
            continue
        queued.append([message.stream, message.shard, message.offset, item.qos, item.retain,
                       list(item.subscription_ids), _message_data(message)])
    return {
        "version": SNAPSHOT_VERSION, "node": node_id, "client_id": session.client_id,
        "online": session.connection is not None,
        "expiry": session.expiry_interval, "disconnected_ms": session.disconnected_at_ms or now_ms(),
        "taken_ms": now_ms(), "subscriptions": own, "shared": shared, "cursors": cursors,
        "messages": messages, "inflight": inflight, "queued": queued,
        "qos2": sorted(session.inbound_qos2),
        **({"shared_inflight": shared_inflight} if shared_inflight else {}),
        # the user who made it goes with it: another user's CONNECT does not get it anywhere
        **({"owner": session.owner} if session.owned else {}),
    }


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


def _holder_in(raw: bytes) -> Any:
    """The node a session snapshot names; None when it cannot be read."""
    try:
        return decode_record(raw).get("node")
    except ValueError:
        return None


def _group_of(session: MqttSession, source: Any) -> str | None:
    """The name of the shared subscription group `source` is, if it is one of `session`'s."""
    if source is None or source is session.subscription:
        return None
    entry = session.shared.get(source.name)
    return source.name if entry is not None and entry[0] is source else None


def expired(state: dict[str, Any], now: int | None = None, holder_gone_ms: int | None = None) -> bool:
    """Whether the session of a snapshot has expired. A snapshot taken while its client was
    connected (`online`) says nothing of when that connection ended: while its node lives, that
    node's expiry timer decides (not expired here); once the node is gone, the session counts
    as disconnected since `holder_gone_ms` (when this node saw it go)."""
    expiry = int(state.get("expiry", 0))
    if expiry == NEVER_EXPIRES:
        return False
    disconnected = int(state.get("disconnected_ms") or 0)
    if state.get("online"):
        if holder_gone_ms is None:
            return False
        disconnected = max(disconnected, holder_gone_ms)
    return disconnected + expiry * 1000 <= (now_ms() if now is None else now)


class GroupStandIn:
    """Stands in for a session handed over to another node, until that node serves the
    session's routes and collects what the stand-in took meanwhile (`SessionHandover.collect`):
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


class SessionHandover:
    """Moves MQTT persistent sessions between this node and the others (module docstring)."""

    def __init__(self, node: ClusterNode, service: MqttService, broker: Broker, placer: CursorPlacer,
                 rpc: StateRpc, writer: StateWriter) -> None:
        self.node = node
        self.service = service
        self.broker = broker
        self.placer = placer
        self.rpc = rpc
        self.writer = writer
        self.prefix = node.settings.prefix.rstrip("/") + ".state/sessions/"
        # client ids being handed to another node (their local forget is not an end)
        self._releasing: set[str] = set()
        # client ids whose session here started without persistence, and when: a snapshot of
        # an earlier session of theirs (whichever node wrote it) is void and leaves etcd
        self._void: dict[str, int] = {}
        # when this node saw each node that snapshots name go away (see `expired`)
        self._alive: set[str] = set()
        self._gone_since: dict[str, int] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self.taken_over = 0
        self.handed_over = 0
        self.swept = 0
        # sessions handed over whose messages wait here for their new node, by client id
        self._stand_ins: dict[str, GroupStandIn] = {}
        # sessions taken over from a stand-in: how long their queue was when adopted (what came
        # after is put in shard order once the stand-in's messages are in, `in_shard_order`)
        self._window: dict[str, int] = {}
        # snapshots in etcd that cannot be restored: logged once each, left where they are
        self.set_aside = SetAside(log)
        self._collecting: set[asyncio.Future[None]] = set()
        # the cursors each connected session's snapshot in etcd was last queued with, and when
        self._checkpointed: dict[str, tuple[Any, float]] = {}
        self._checkpointer: asyncio.Task[None] | None = None
        self.checkpoints = 0

    def key(self, client_id: str) -> str:
        return self.prefix + client_id

    # ------------------------------------------------------------ wiring
    def install(self) -> None:
        self.service.find_session_elsewhere = self.find
        self.service.store = SnapshottingStore(self.service.store, self)
        self.rpc.on_release = self.release
        self.rpc.on_take = self.take_for_peer
        self.node.view.on_change(self._note_departures)
        self._note_departures()

    def start_sweeping(self) -> None:
        """Remove expired sessions' snapshots from etcd (the controller does, every
        `session_sweep_s`), also those of nodes that died holding them."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    def start_checkpointing(self) -> None:
        """Checkpoint connected persistent sessions whose cursors moved (`checkpoint`)."""
        if self._checkpointer is None:
            self._checkpointer = asyncio.get_running_loop().create_task(self._checkpoint_loop())

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._checkpointer is not None:
            self._checkpointer.cancel()
            self._checkpointer = None
        for collecting in list(self._collecting):
            collecting.cancel()

    async def drop_moved(self) -> int:
        """At start: drop sessions restored from this node's store that ended or moved while
        this node was away: their snapshot in etcd names another node, or is gone (the client
        started clean elsewhere, or the session expired). On the first start of a data
        directory in a cluster, its sessions (from a single node) get their snapshots instead."""
        dropped = 0
        for client_id, session in list(self.service.sessions.items()):
            if session.connection is not None or not session.durable:
                continue
            try:
                kv = await self.node.client.get(self.key(client_id))
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
                self._releasing.add(client_id)
                try:
                    del self.service.sessions[client_id]
                    session.discard()
                finally:
                    self._releasing.discard(client_id)
                timer = self.service._expiry_timers.pop(client_id, None)
                if timer is not None:
                    timer.cancel()
                dropped += 1
        if dropped:
            log.info("cluster: %d sessions restored here had moved to other nodes or ended; "
                     "dropped", dropped)
        return dropped

    # ------------------------------------------------------------ the new node
    def find(self, client_id: str, clean_start: bool, username: str | None = None) -> asyncio.Future[None] | None:
        """A CONNECT for a session not held here waits for its claim (every kind of session:
        the registry orders takeovers) and, when another node held it, for that node to end
        its connection and hand the session over. A session another user made is neither
        claimed nor ended (with `mqtt.session_takeover_by_other_user = "refuse"`): the future
        fails with SessionOfAnotherUser, and the CONNECT is refused as on the holder."""
        return asyncio.ensure_future(self._take(client_id, clean_start, username, owned=True))

    async def _take(self, client_id: str, clean_start: bool, username: str | None, *,
                    owned: bool, check_owner: bool = True) -> None:
        try:
            await asyncio.wait_for(
                self._take_now(client_id, clean_start, username, owned=owned, check_owner=check_owner),
                TAKEOVER_TIMEOUT_S)
        except SessionOfAnotherUser:
            raise
        except (TimeoutError, EtcdError, StateCallError) as exc:
            if not clean_start:
                # the session (and the backlog its cursors hold) is not lost for a moment
                # without etcd: the CONNECT is refused (server unavailable) and tried again
                log.warning("cluster: session %r could not be taken over (%s); its CONNECT is "
                            "refused, to be tried again", client_id, exc)
                raise SessionUnavailable(
                    f"the session could not be brought to this node now ({exc}); try again") from None
            log.warning("cluster: session %r could not be ended elsewhere (%s); it starts anew",
                        client_id, exc)
        except Exception:
            log.exception("cluster: taking session %r over failed", client_id)

    def _refuses(self, kv: KeyValue | None, username: str | None) -> bool:
        """Whether the session snapshot `kv` is another user's than `username`'s: asked by
        `ClusterNode.claim_session` when the registry names no node for the session (its
        holder is gone: the registry entry went with that node's lease; a live holder's entry
        says who owns it), in step with the claim's transaction."""
        if kv is None:
            return False
        try:
            state = decode_record(kv.value)
        except ValueError:
            return False  # set aside when it is taken (`_snapshot_in`)
        if "owner" not in state or state["owner"] == username:
            return False
        return not expired(state, holder_gone_ms=self.holder_gone_ms(state.get("node")))

    async def _take_now(self, client_id: str, clean_start: bool, username: str | None, *,
                        owned: bool, check_owner: bool) -> None:
        node = self.node
        me = node.node_id
        refuse = check_owner and self.service.settings.session_takeover_by_other_user == "refuse"
        # one transaction (again only when another claim came first): who held it, its last
        # snapshot, and the registry now names this node (and the user claiming it)
        try:
            holder, reads = await node.claim_session(
                client_id, also_read=[self.key(client_id)], owner=username, owned=owned,
                refuse_other_user=refuse,
                vacant_refuses=(self.key(client_id), lambda kv: self._refuses(kv, username)))
        except ClaimRefused as exc:
            raise SessionOfAnotherUser(str(exc)) from None
        saved_kv = reads[0]
        state = self._snapshot_in(client_id, saved_kv[0] if saved_kv else None)
        if holder is not None and holder != me and holder in node.view.nodes():
            try:
                reply = await self.rpc.release_session(
                    holder, {"client_id": client_id, "to": me, "clean_start": clean_start},
                    RELEASE_CALL_TIMEOUT_S)
                state = reply.get("state")
                stood_in = bool(reply.get("stand_in"))
            except StateCallError as exc:
                log.warning("cluster: node %s did not hand session %r over (%s); resuming from "
                            "its last snapshot", holder, client_id, exc)
                stood_in = False
                # read again: a holder that stops gracefully writes its sessions' snapshots
                # before its cluster port closes, maybe after the claim above read the older
                # one (its client reconnected here while it was stopping)
                state = self._snapshot_in(client_id, await node.client.get(self.key(client_id)))
            if stood_in:
                # the holder's stand-in takes the session's messages there until this node
                # serves its routes (adopted, and the peers know), then hands over what it
                # took: CONNACK (and a leaving node's handover) waits for that, bounded by
                # COLLECT_WAIT_S (then it comes in the background)
                try:
                    await self._adopt_taken(client_id, clean_start, state, stood_in=True)
                finally:
                    collecting = asyncio.ensure_future(self._collect_from(str(holder), client_id))
                    self._collecting.add(collecting)
                    collecting.add_done_callback(self._collecting.discard)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(collecting), COLLECT_WAIT_S)
                return
        await self._adopt_taken(client_id, clean_start, state)

    def _snapshot_in(self, client_id: str, kv: KeyValue | None) -> dict[str, Any] | None:
        """The session snapshot `kv` holds; None (and set aside: the client gets a new
        session, as for a session a single node cannot restore) when it cannot be read."""
        if kv is None:
            return None
        try:
            return decode_record(kv.value)
        except ValueError as exc:
            self.set_aside(f"the snapshot of MQTT session {client_id!r}", kv, exc)
            return None

    async def take_for_peer(self, request: dict[str, Any]) -> dict[str, Any]:
        """A leaving node asks this one to take a persistent session over (offline): as if its
        client connected here, but no connection attaches."""
        client_id = str(request["client_id"])
        if client_id in self.service.sessions:
            return {"taken": False}
        owner = request.get("owner")
        try:
            # the registry names the session's own owner (the leaving node's), as it did there
            await self._take(client_id, False, None if owner is None else str(owner),
                             owned="owner" in request, check_owner=False)
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
                if client_id not in self.service.sessions:
                    return  # its client took it elsewhere meanwhile
                session = self.service.sessions.get(client_id)
                if session is None:
                    return  # its client took it elsewhere meanwhile
                request: dict[str, Any] = {"client_id": client_id}
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
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        log.info("cluster: %d of %d persistent sessions handed over to live nodes", handed,
                 len(clients))
        return handed

    async def _collect_from(self, holder: str, client_id: str) -> None:
        """What `holder`'s stand-in took for the session: to the session here (queued for it,
        as for any offline member), or to nobody when the session did not come here."""
        try:
            reply = await self.rpc.release_session(
                holder, {"client_id": client_id, "to": self.node.node_id, "collect": True},
                RELEASE_CALL_TIMEOUT_S)
        except StateCallError as exc:
            log.warning("cluster: node %s did not hand over the group messages of session %r "
                        "(%s)", holder, client_id, exc)
            return
        session = self.service.sessions.get(client_id)
        stand_in = self._stand_ins.get(client_id)  # the session moved on meanwhile
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
            in_shard_order(session, start, self._reliable)
        if lost:
            log.warning("cluster: %d messages taken for session %r while it moved had nowhere to "
                        "go here", lost, client_id)

    async def _adopt_taken(self, client_id: str, clean_start: bool, state: dict[str, Any] | None,
                           *, stood_in: bool = False) -> None:
        if client_id in self.service.sessions:
            return  # a connection here made one meanwhile
        if clean_start or state is None or expired(state, holder_gone_ms=self.holder_gone_ms(state.get("node"))):
            return  # a new session: opening it replaces or removes the snapshot (`opened`)
        try:
            session = self.adopt(state)
        except UNREADABLE as exc:
            # the client gets a new session, as for a session a single node cannot restore
            self.set_aside(f"the snapshot of MQTT session {client_id!r}", None, exc, state)
            return
        if stood_in:
            # what comes from here on (the stand-in's, then the pushes) is put in shard order
            self._window[client_id] = len(session.queue)
        self.taken_over += 1
        log.info("cluster: session %r taken over from %s", client_id, state.get("node"))
        self.went_offline(client_id)  # etcd now names this node
        if session.shared or stood_in:
            # CONNACK waits (bounded) until the peers know this node serves the session's
            # routes: a message published after it reaches the session here, as after a
            # SUBACK, and the old node's stand-in can leave (its cursors replay the owners'
            # reliable shards in any case)
            ready = self.broker.routes_ready()
            if ready is not None:
                await ready

    def adopt(self, state: dict[str, Any]) -> MqttSession:
        """Rebuild a session from a snapshot, offline (its connection is about to attach)."""
        service = self.service
        client_id = str(state["client_id"])
        session = MqttSession(service, client_id, durable=True)
        try:
            self._rebuild(session, state)
        except BaseException:
            session.discard()  # what was made of it leaves the broker
            raise
        service.sessions[client_id] = session
        return session

    def _rebuild(self, session: MqttSession, state: dict[str, Any]) -> None:
        service, broker = self.service, self.broker
        client_id = session.client_id
        session.expiry_interval = int(state.get("expiry", 0))
        session.disconnected_at_ms = state.get("disconnected_ms")
        if "owner" in state:
            owner = state["owner"]
            session.owner, session.owned = None if owner is None else str(owner), True
        sub = session.subscription
        assert isinstance(sub, DurableSubscription)
        handed = self.placer.place(sub, state.get("cursors", []), state.get("messages", []),
                                   int(state.get("taken_ms", now_ms())))
        for topic_filter, qos, no_local, rap, handling, sub_id in state.get("subscriptions", []):
            broker.add_filter(sub, topic_filter, SubscriptionOptions(qos, no_local, rap, handling, sub_id))
        broker.attach(sub, session)
        for name, sub_type, shared_filters, qos, rap, sub_id in state.get("shared", []):
            shared_sub = broker.subscription(name, SubscriptionType(sub_type))
            for topic_filter in shared_filters:
                broker.add_filter(shared_sub, topic_filter)
            broker.attach(shared_sub, session)
            session.shared[name] = (shared_sub, SubscriptionOptions(qos, False, rap, 0, sub_id))
        for pid, stream, shard, offset, qos, released, retain, ids in state.get("inflight", []):
            message = handed.get((stream, shard, offset))
            if message is None:
                continue
            session.inflight[int(pid)] = Outgoing(message, qos, retain, tuple(ids), sub, released)
            sub.adopt(message, session)
        for pid, group, stream, shard, offset, qos, released, retain, ids, data in state.get(
                "shared_inflight", []):
            entry = session.shared.get(group)
            message = _message(data, stream, shard, offset)
            if entry is not None and message is not None and int(pid) not in session.inflight:
                session.inflight[int(pid)] = Outgoing(message, qos, retain, tuple(ids), entry[0], released)
        for stream, shard, offset, qos, retain, ids, data, *group in state.get("queued", []):
            source: Subscription | None = sub
            if group:
                entry = session.shared.get(group[0])
                if entry is None:
                    continue
                source = entry[0]
            message = _message(data, stream, shard, offset)
            if message is not None:
                session._enqueue(Queued(message, qos, retain, tuple(ids), source))
        session.inbound_qos2 = set(state.get("qos2", []))
        if session.inbound_qos2 and service.store is not None:
            service.store.save_qos2([(client_id, packet_id, True) for packet_id in session.inbound_qos2])

    # ------------------------------------------------------------ the old node
    async def release(self, request: dict[str, Any]) -> dict[str, Any]:
        """A peer took this client's session: end it here and hand its state over. Its
        shared groups keep a stand-in here until the peer collects (`collect`)."""
        client_id = str(request["client_id"])
        to = str(request.get("to", "another node"))
        if request.get("collect"):
            return await self.collect(client_id, to)
        clean_start = bool(request.get("clean_start"))
        service = self.service
        session = service.sessions.get(client_id)
        if session is None:
            return {"state": None}
        connection = session.connection
        if connection is not None:
            # a takeover: the new connection owns the session now (a will without delay goes)
            session.connection = None
            connection.close(p.ReasonCode.SESSION_TAKEN_OVER, f"session taken over on {to}")
        self._cancel_timers(client_id, publish_will=clean_start)
        state = (snapshot(session, self.node.node_id, group_messages=True)
                 if session.durable and not clean_start else None)
        stand_in = None
        if state is not None:
            earlier = self._stand_ins.get(client_id)
            taken: list[tuple[str, Message, tuple[str, ...]]] = []
            if earlier is not None:  # an earlier move's, not collected yet: what it took goes too
                taken, earlier.messages = earlier.messages, []
                self._drop_stand_in(client_id)
            own = self._own_stand_in_subscription(session)
            groups = [sub for sub, _options in session.shared.values()]
            stand_in = GroupStandIn(client_id, [*groups, *([own] if own is not None else [])], to,
                                    service.settings.max_queued_messages, own, self._reliable)
            stand_in.messages.extend(taken)
            for group in stand_in.groups:
                self.broker.attach(group, stand_in)  # before the session leaves: no route changes
            stand_in.timer = asyncio.get_running_loop().call_later(
                STAND_IN_TIMEOUT_S, self._drop_stand_in, client_id)
            self._stand_ins[client_id] = stand_in
        self._releasing.add(client_id)
        try:
            if service.sessions.get(client_id) is session:
                del service.sessions[client_id]
            session.discard()
        finally:
            self._releasing.discard(client_id)
        self.handed_over += 1
        log.info("cluster: session %r handed over to %s", client_id, to)
        return {"state": state, "stand_in": stand_in is not None}

    def _reliable(self, stream: str) -> bool:
        broker_stream = self.broker.streams.get(stream)
        return broker_stream is None or broker_stream.reliable

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
        the peers know (and what they pushed meanwhile has arrived), what it took goes there."""
        stand_in = self._stand_ins.get(client_id)
        if stand_in is None or stand_in.to != to:
            return {"messages": []}
        broker = self.broker
        stand_in.in_routes = False  # the peers stop sending the groups' messages here
        if broker.on_routes_changed is not None:
            broker.on_routes_changed()
        # a peer's pushes come on its own link, not the one its answer to the route change
        # came on: each peer says on its link, behind what it pushed before, that it applied
        # the change, so once that arrived nothing for the stand-in is still on its way
        settled = self.placer.plane.pushes_settled()
        if settled is not None:
            await settled
        if self._stand_ins.get(client_id) is stand_in:
            del self._stand_ins[client_id]
        if stand_in.timer is not None:
            stand_in.timer.cancel()
        self._leave_groups(stand_in)
        if stand_in.dropped:
            self.broker.stats.drop(SLOW_SUBSCRIBER, stand_in.dropped)
            log.warning("cluster: %d group messages for session %r were over the queue limit "
                        "while it moved; dropped", stand_in.dropped, client_id)
        return {"messages": [
            [group, message.stream, message.shard, message.offset, _message_data(message), list(filters)]
            for group, message, filters in stand_in.messages
        ]}

    def _leave_groups(self, stand_in: GroupStandIn) -> None:
        broker = self.broker
        for group in stand_in.groups:
            broker.detach(group, stand_in)
            if not group.consumers and broker.subscriptions.get(group.name) is group:
                broker.remove_subscription(group.name)

    def _drop_stand_in(self, client_id: str) -> None:
        stand_in = self._stand_ins.pop(client_id, None)
        if stand_in is None:
            return
        if stand_in.timer is not None:
            stand_in.timer.cancel()
        self._leave_groups(stand_in)
        if stand_in.messages:
            log.warning("cluster: %d group messages kept for session %r were never collected by "
                        "its new node; dropped", len(stand_in.messages), client_id)

    def _cancel_timers(self, client_id: str, *, publish_will: bool) -> None:
        service = self.service
        timers: dict[str, Any] = service._will_timers
        pending_will = timers.pop(client_id, None)
        if pending_will is not None:
            pending_will[0].cancel()
            if publish_will:
                service._publish_will(client_id, pending_will[1])
        expiry = service._expiry_timers.pop(client_id, None)
        if expiry is not None:
            expiry.cancel()

    # ------------------------------------------------------------ snapshots in etcd
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

    def ended(self, client_id: str) -> None:
        if client_id not in self._releasing:
            self._sync(client_id)

    # ------------------------------------------------------------ checkpoints of connected sessions
    @staticmethod
    def _cursors_of(session: MqttSession) -> Any:
        """What a checkpoint is taken for: the session's cursors (position, unacknowledged)."""
        sub = session.subscription
        if not isinstance(sub, DurableSubscription):
            return None
        return [(key, cursor.position, frozenset(cursor.unacked), frozenset(cursor.pending_redelivery))
                for key, cursor in sub.cursors.items()]

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
            if session.connection is None or not session.durable or client_id in self._releasing:
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
                    or client_id in self._releasing:
                return None
            if self.node.view.sessions.get(client_id) not in (None, self.node.node_id):
                return None
            return keys.encode(snapshot(session, self.node.node_id))
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
            client = self.node.client
            session = self.service.sessions.get(client_id)
            if session is not None and session.durable:
                holder = self.node.view.sessions.get(client_id)
                if holder not in (None, self.node.node_id):
                    # another node took it over (the registry says so) while this one could
                    # not hand it over (stopping): that node's snapshot is the session now
                    return
                await client.put(key, keys.encode(snapshot(session, self.node.node_id)))
                self._void.pop(client_id, None)
                return
            kv = await client.get(key)
            voided = self._void.get(client_id)
            state = self._snapshot_in(client_id, kv)
            if kv is not None and state is not None:
                if (voided is not None and int(state.get("taken_ms", 0)) <= voided) or (
                        session is None and state.get("node") == self.node.node_id):
                    await client.txn([mod_revision_is(key, kv.mod_revision)], [delete_op(key)])
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
        client = self.node.client
        kvs, _revision = await client.get_prefix(self.prefix)
        now = now_ms()
        swept = 0
        for kv in kvs:
            try:
                state = decode_record(kv.value)
                gone = expired(state, now, self.holder_gone_ms(state.get("node")))
            except UNREADABLE as exc:
                self.set_aside("an MQTT session snapshot", kv, exc)
                continue
            if not gone:
                continue
            result = await client.txn([mod_revision_is(kv.key, kv.mod_revision)], [delete_op(kv.key)])
            if result.succeeded:
                swept += 1
                log.info("cluster: session %r expired; its snapshot is removed", state.get("client_id"))
        self.swept += swept
        return swept


class SnapshottingStore:
    """The MQTT service's session store in a cluster: the node's own store, plus the session's
    snapshot in etcd each time a persistent session goes offline or its subscriptions change,
    removed when it ends."""

    def __init__(self, inner: Any, handover: SessionHandover) -> None:
        self._inner = inner
        self._handover = handover
        # what each online session's snapshot last held of its subscriptions: saves that change
        # nothing of them (a QoS 2 release) write nothing to etcd
        self._subscribed: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}

    def save_session(self, client_id: str, expiry_interval: int, disconnected_ms: int | None,
                     data: bytes) -> None:
        self._inner.save_session(client_id, expiry_interval, disconnected_ms, data)
        if disconnected_ms is not None:
            self._subscribed.pop(client_id, None)
            self._handover.went_offline(client_id)
            return
        session = self._handover.service.sessions.get(client_id)
        if session is None:
            return
        subscribed = (tuple(session.subscription.filters), tuple(session.shared))
        if self._subscribed.get(client_id) != subscribed:
            self._subscribed[client_id] = subscribed
            self._handover.went_offline(client_id)  # the same write: the session as it is now

    def forget_session(self, client_id: str) -> None:
        self._inner.forget_session(client_id)
        self._subscribed.pop(client_id, None)
        self._handover.ended(client_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
