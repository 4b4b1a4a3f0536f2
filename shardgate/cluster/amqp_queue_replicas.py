"""Durable AMQP queues that survive their home node, as RabbitMQ's quorum queues do: the home
keeps each queue's state replicated, and when the home dies another node takes the queue over
from it (`amqp_queues.py` says where a queue lives and how other nodes reach it).

**What is replicated.** A durable queue's messages are in reliable shards, replicated as
their stream says. What lived only on its home is the queue itself: its definition and its
durable cursors (per shard, the next offset to take and the offsets taken and not yet
acknowledged). The home writes that, whole, as one record (`queue_state.QueueState`) to the
cluster's internal state stream through `state_log.StateLog` (kind `queue_state.QUEUE_KIND`,
keyed by vhost, queue and incarnation, stamped with the queue's epoch; one shard, three
replicas capped by the live nodes, two in sync: as Kafka keeps consumer offsets in a topic, not
in ZooKeeper). It writes it at most every `WRITE_S` while the queue changes, and again every
`REFRESH_S` while it does not (the stream keeps an hour). The state is taken when the batch is
written, and not written once this node no longer holds the queue.
Before it answers a declare (passive too), bind, unbind or purge of the queue, the home waits
(bounded, `SETTLED_S`) until the state as it is then is committed there (`replicated`): what a
client saw answered is what a takeover starts from. An acknowledgement is a basic.ack with no
reply: one made less than `WRITE_S` before the home dies may come again (at least once).

**Who owns the queue.** etcd, as before: the queue's record names its home, now with an
`incarnation` (a random id from its declare) and an `epoch` (0 at the declare). When the home
is gone from the view (its lease expired), one live node running AMQP, chosen by rendezvous
hashing over the live nodes (`queue_state.taker`), reads the queue's latest state of that
incarnation and of the highest epoch up to the record's (`StateLog.latest(max_epoch=)`,
through the kind's index: a node taking over many queues reads the stream once, and each
later takeover only what was written since; the part older than `RECENT_S` only when the
recent part has no state of the record's epoch), and replaces the record with itself and the
next epoch in one compare-and-set on the revision it read: of several nodes trying, one
wins. It then makes the queue here from the state: its cursors are placed as a session's are
(`CursorPlacer.place`: over this node's journal, or the leader's, for every shard), the
offsets taken and not acknowledged are handed out again marked `redelivered`, what was
published after the state was written is read from the shards. Its first state record carries
the new epoch. Clients of every node find the new home through the record, as before.

**A home that lost its queue** (it was paused past its lease, or cut off, and resumes; or it
restarts after a takeover) sees a record naming another node with a later epoch: it drops its
copy (consumers cancelled, cursors forgotten) and never writes its state again; records it
wrote meanwhile carry the old epoch and are never read. A home writes state only while its
lease is known alive.

What this does not cover is in docs/OPERATIONS.md ("What a SIGKILL can still lose of a durable
AMQP queue").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from ..core.durable import DurableSubscription
from ..core.message import now_ms
from ..core.subscriptions import SubscriptionType
from ..protocols.amqp.remote import is_shared
from ..protocols.mqtt.snapshot import CursorState
from . import keys
from .queue_state import (
    LEGACY_STATE_STREAM,
    QUEUE_KIND,
    CursorEntry,
    QueueState,
    QueueStateError,
    decode_state,
    encode_state,
    record_fields,
    state_key,
    taker,
)
from .set_aside import decode_record
from .state_log import INTERNAL_STREAM, StateLog
from .waits import wait_within

if TYPE_CHECKING:
    from ..core.broker import Broker
    from .control import ClusterNode
    from .session_cursors import CursorPlacer

log = logging.getLogger(__name__)

# How often a changed queue's state is written, and an unchanged one's again (a log whose
# retention dropped a quiet queue's last record would leave nothing to take it over from).
WRITE_S = 0.1
REFRESH_S = 600.0
# How long a reply waits at most for the state to be committed (a state shard with no leader
# for a moment): then the reply goes, and the state is written when it can be.
SETTLED_S = 5.0
SETTLE_RETRY_S = 0.05
# Retrying a takeover (the state shard's leader died with the home: its successor comes
# within the failover time).
RETRY_MIN_S = 0.2
RETRY_MAX_S = 2.0
READ_TIMEOUT_S = 5.0
# A takeover first reads the states written this long ago and since (a live home writes each
# of its queues at least every REFRESH_S), and older ones only when those hold none of the
# record's epoch (its home died before writing one, or long ago).
RECENT_S = 2 * REFRESH_S
# Streams whose cursors are not part of a queue's state (every node's own; the state itself).
NOT_CARRIED = frozenset({"sys", INTERNAL_STREAM, LEGACY_STATE_STREAM})


def new_incarnation() -> str:
    return uuid.uuid4().hex


def queue_name_of(key: str) -> tuple[str, str] | None:
    """(vhost, queue) of a queue record's key (`amqp_queues.queue_key`), else None."""
    if not key.startswith(keys.AMQP):
        return None
    vhost, marker, name = key[len(keys.AMQP):].partition("/queues/")
    if not marker or not name or "/" in name:
        return None
    return unquote(vhost), unquote(name)


class QueueReplicas:
    """Writes the state of the durable queues homed here, and takes over those whose home
    died (module docstring)."""

    def __init__(self, node: ClusterNode, broker: Broker, placer: CursorPlacer) -> None:
        self.node = node
        self.broker = broker
        self.placer = placer
        self.states = StateLog(node, broker, QUEUE_KIND, indexed=True)
        self.amqp: Any = None
        # per queue (vhost, name): what its last written state looked like, when, and the
        # commit of the latest write
        self._written: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._written_at: dict[tuple[str, str], float] = {}
        self._commits: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._seq = time.time_ns()  # the state's own `seq` (the log's stamp is `StateLog`'s)
        self._taking: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self.taken_over = 0

    def install(self, amqp: Any) -> None:
        self.amqp = amqp
        self._task = asyncio.get_running_loop().create_task(self._writes())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for task in list(self._taking.values()):
            task.cancel()

    # ------------------------------------------------------------ the home's writes
    def _record(self, vhost: str, name: str) -> dict[str, Any] | None:
        from .amqp_queues import queue_key

        value = self.node.view.documents.get(queue_key(vhost, name))
        if value is None:
            return None
        try:
            return decode_record(value)
        except ValueError:
            return None

    def _homed(self) -> Iterator[tuple[Any, Any, dict[str, Any]]]:
        """(vhost, queue, record) of every durable queue whose record names this node."""
        me = self.node.node_id
        for vhost in list(self.amqp.vhosts.values()):
            for name, queue in list(vhost.queues.items()):
                if not queue.durable or not is_shared(queue):
                    continue
                if not isinstance(queue.subscription, DurableSubscription):
                    continue
                record = self._record(vhost.name, name)
                if record is not None and record.get("node") == me:
                    yield vhost, queue, record

    @staticmethod
    def _signature(queue: Any) -> tuple[Any, ...]:
        """What changes whenever the queue's state does: a cursor's unacknowledged set only
        grows as its position moves, and shrinks by acknowledgements."""
        sub = queue.subscription
        return (tuple(sorted(queue.bindings)),
                tuple((key, cursor.position, len(cursor.unacked), len(cursor.pending_redelivery))
                      for key, cursor in sub.cursors.items()))

    def state_of(self, vhost: Any, queue: Any, record: dict[str, Any]) -> QueueState:
        incarnation, epoch = record_fields(record)
        self._seq = max(self._seq + 1, time.time_ns())
        cursors = []
        for (stream, shard), cursor in list(queue.subscription.cursors.items()):
            if stream in NOT_CARRIED:
                continue
            unacked = set(cursor.unacked)
            unacked.update(cursor.pending_redelivery)
            cursors.append(CursorEntry(stream, shard, cursor.position, sorted(unacked)))
        return QueueState(vhost.name, queue.name, incarnation, epoch, self._seq,
                          vhost.queue_entry(queue), cursors, now_ms())

    def _write(self, vhost: Any, queue: Any, record: dict[str, Any], *, force: bool = False) -> None:
        key = (vhost.name, queue.name)
        signature = self._signature(queue)
        if not force and self._written.get(key) == signature:
            return
        if not self.node.view.lease_alive():
            return  # fenced: a node that cannot prove its lease may have lost the queue
        self._written[key] = signature
        self._written_at[key] = time.monotonic()
        incarnation, epoch = record_fields(record)
        me = self.node.node_id

        def value() -> bytes | None:
            # taken as the batch is written (or written again): the state as it is then, unless
            # the queue left this node meanwhile
            current = self._record(vhost.name, queue.name)
            if (queue.deleted or current is None or current.get("node") != me
                    or record_fields(current) != (incarnation, epoch)
                    or not self.node.view.lease_alive()):
                if self._written.get(key) == signature:
                    self._written.pop(key, None)
                return None
            return encode_state(self.state_of(vhost, queue, current))

        commit = self.states.put(state_key(vhost.name, queue.name, incarnation), value, epoch)

        def landed(done: asyncio.Future[None]) -> None:
            if done.cancelled() or done.exception() is not None:
                if self._written.get(key) == signature:
                    self._written.pop(key, None)
                log.debug("cluster: the state of AMQP queue %r was not committed: %s", queue.name,
                          None if done.cancelled() else done.exception())

        commit.add_done_callback(landed)
        self._commits[key] = commit

    def replicated(self, vhost: str, name: str) -> asyncio.Future[None] | None:
        """`remote.QueueDirectory.replicated`: done once the queue's state as it is now is
        committed in the state stream (at most `SETTLED_S`)."""
        if self.amqp is None:
            return None
        host = self.amqp.vhosts.get(vhost)
        queue = host.queues.get(name) if host is not None else None
        if queue is None or not queue.durable or not is_shared(queue):
            return None
        record = self._record(vhost, name)
        if record is None or record.get("node") != self.node.node_id:
            return None
        if not isinstance(queue.subscription, DurableSubscription):
            return None
        self._write(host, queue, record)
        if self._committed(host, queue):
            return None
        return asyncio.ensure_future(self._settle(host, queue, SETTLED_S))

    def _committed(self, vhost: Any, queue: Any) -> bool:
        """Whether the queue's state as it is now is committed."""
        key = (vhost.name, queue.name)
        commit = self._commits.get(key)
        return (commit is not None and commit.done() and not commit.cancelled()
                and commit.exception() is None and self._written.get(key) == self._signature(queue))

    async def _settle(self, vhost: Any, queue: Any, within: float) -> None:
        """Write the queue's state until the state as it is now is committed (a first write
        may find the state stream not placed yet), for at most `within` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        key = (vhost.name, queue.name)
        while not self._committed(vhost, queue):
            record = self._record(vhost.name, queue.name)
            if record is None or record.get("node") != self.node.node_id or queue.deleted:
                return
            self._write(vhost, queue, record)
            remaining = deadline - loop.time()
            if remaining <= 0:
                log.warning("cluster: the state of AMQP queue %r is not replicated yet; answering "
                            "anyway", queue.name)
                return
            commit = self._commits.get(key)
            if commit is not None and not commit.done():
                with contextlib.suppress(Exception):
                    await wait_within(asyncio.shield(commit), remaining)
            else:
                await asyncio.sleep(min(SETTLE_RETRY_S, remaining))

    async def _writes(self) -> None:
        while True:
            await asyncio.sleep(WRITE_S)
            try:
                self.write_round()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("cluster: writing the state of AMQP queues failed")

    def write_round(self) -> None:
        now = time.monotonic()
        here = set()
        for vhost, queue, record in self._homed():
            key = (vhost.name, queue.name)
            here.add(key)
            due = now - self._written_at.get(key, 0.0) >= REFRESH_S
            self._write(vhost, queue, record, force=due)
        for key in [key for key in self._written if key not in here]:
            self._written.pop(key, None)
            self._written_at.pop(key, None)
            self._commits.pop(key, None)

    def forget(self, vhost: str, name: str) -> None:
        """The queue left this node (deleted, or taken over elsewhere)."""
        self._written.pop((vhost, name), None)
        self._written_at.pop((vhost, name), None)
        self._commits.pop((vhost, name), None)

    # ------------------------------------------------------------ taking over
    def candidates(self) -> list[str]:
        """The live nodes that may take a queue over: not leaving, serving AMQP."""
        view = self.node.view
        found = []
        for node_id in view.nodes():
            registration = view.registrations.get(node_id)
            if registration is None:
                continue
            if registration.leaving:
                continue
            listeners = registration.listeners
            if listeners and "amqp" not in listeners and "amqps" not in listeners:
                continue
            found.append(node_id)
        return found

    def consider(self) -> None:
        """Take over (in the background) the durable queues whose home is gone and that this
        node is the one to take."""
        if self.amqp is None:
            return
        view = self.node.view
        live = view.nodes()
        me = self.node.node_id
        candidates: list[str] | None = None
        for key, value in list(view.documents.items()):
            names = queue_name_of(key)
            if names is None or key in self._taking:
                continue
            try:
                record = decode_record(value)
            except ValueError:
                continue
            home = record.get("node")
            if home is None or home == me or home in live or not record.get("durable", True):
                continue
            if names[0] not in self.amqp.vhosts:
                continue
            if candidates is None:
                candidates = self.candidates()
            if taker(key, candidates) != me:
                continue
            self._taking[key] = asyncio.get_running_loop().create_task(self._take_over(key, *names))

    async def _take_over(self, key: str, vhost: str, name: str) -> None:
        delay = RETRY_MIN_S
        try:
            while True:
                try:
                    done = await self._try_take_over(key, vhost, name)
                except Exception as exc:  # noqa: BLE001 - tried again
                    log.warning("cluster: taking AMQP queue %r over failed: %s; retrying", name, exc)
                    done = None
                if done is not None:
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
        finally:
            self._taking.pop(key, None)

    async def _try_take_over(self, key: str, vhost_name: str, name: str) -> bool | None:
        """True: taken over; False: not (or no longer) this node's to take; None: try again."""
        me = self.node.node_id
        store = self.node.state_store
        kv = await store.get(self.node.key(key))
        if kv is None:
            return False
        record = decode_record(kv.value)
        home = record.get("node")
        if home is None or home == me or home in self.node.view.nodes() or not record.get("durable", True):
            return False
        if taker(key, self.candidates()) != me:
            return False
        vhost = self.amqp.vhosts.get(vhost_name)
        if vhost is None:
            return False
        existing = vhost.queues.get(name)
        if existing is not None and not is_shared(existing):
            return False  # a connection's own queue of that name lives here
        incarnation, epoch = record_fields(record)
        state = await self.read_latest(vhost_name, name, incarnation, epoch)
        if state is None:
            log.warning("cluster: AMQP queue %r of vhost %r has no replicated state (declared "
                        "before its state was kept); it waits for its home node %s",
                        name, vhost_name, home)
            return False
        claimed = dict(record, node=me, epoch=epoch + 1, incarnation=incarnation)
        value = keys.encode(claimed)
        written, _current = await store.put_at(self.node.key(key), kv.mod_revision, value)
        if not written:
            return None  # it changed meanwhile: read it again
        self.node.view.documents[key] = value
        if existing is not None:
            vhost.delete_queue(existing)  # a stale copy of an earlier life here
        self.adopt(vhost, state)
        self.taken_over += 1
        log.info("cluster: AMQP queue %r of vhost %r taken over from node %s (epoch %d)",
                 name, vhost_name, home, epoch + 1)
        return True

    async def read_latest(self, vhost: str, name: str, incarnation: str, max_epoch: int) -> QueueState | None:
        """The queue's latest committed state of `incarnation` and of the highest epoch up to
        `max_epoch` (module docstring); raises `ShardUnreadable` while that cannot be read."""
        key = state_key(vhost, name, incarnation)
        state = None
        for since_ms in (now_ms() - int(RECENT_S * 1000), 0):
            data = await self.states.latest(key, since_ms, READ_TIMEOUT_S, max_epoch=max_epoch)
            if data is None:
                continue
            try:
                state = decode_state(data)
            except QueueStateError as exc:
                log.warning("cluster: an unreadable state of AMQP queue %r: %s", name, exc)
                state = None
                continue
            if state.epoch == max_epoch:
                break
        if state is None or state.incarnation != incarnation or state.epoch > max_epoch:
            return None
        return state

    def adopt(self, vhost: Any, state: QueueState) -> Any:
        """Make the queue here from `state`: its durable subscription with the cursors placed,
        then the queue with its bindings; its state is written with this node's epoch."""
        from ..protocols.amqp.vhost import DURABLE_QUEUE_OPTIONS

        broker = self.broker
        sub_name = f"amqp:{vhost.name}:{state.name}"
        if sub_name in broker.subscriptions:
            broker.remove_subscription(sub_name)
        sub = broker.durable_subscription(sub_name, SubscriptionType.EXCLUSIVE,
                                          options=DURABLE_QUEUE_OPTIONS)
        cursors = [CursorState(c.stream, c.shard, c.position, list(c.unacked)) for c in state.cursors]
        self.placer.place(sub, cursors, [], state.taken_ms)
        queue = vhost.adopt_queue(dict(state.definition, name=state.name), sub)
        self.forget(vhost.name, state.name)
        record = self._record(vhost.name, state.name)
        if record is not None:
            self._write(vhost, queue, record, force=True)
        return queue


