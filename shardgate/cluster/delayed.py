"""Delayed messages as cluster state: kept in etcd, released once, by whichever node holds them.

A delayed message (`$delayed/{s}/{topic}`, headers `x-deliver-at` / `x-delay`, core/delayed.py)
accepted by any node is put in etcd before its publisher is acknowledged, under
`/shardgate/<cluster>.state/delayed/<holder node>/<deliver-at ms>-<id>` (outside the watched
prefix: no other node is woken for it). The value names the holder's lease and carries the
encoded message. The holder keeps a timer; when it fires it publishes the message through the
normal path (forwarded to the shard's owner, acknowledged by it), then deletes the key.

Why etcd and not a compacted internal stream: a delayed message costs two etcd writes (put,
delete), batched with others in one transaction each way, well within etcd's budget (about a
thousand fsynced writes a second) at the modest rates delayed delivery sees; etcd gives the
one thing a stream would have to rebuild, an atomic move of a message from a departed holder
to its taker under a compare on the revision read. To keep etcd healthy a message is bounded
(`MAX_RECORD_BYTES` encoded) and a node holds at most `MAX_HELD` of them; past either the
publish is refused with a clear error.

A holder that is gone (its lease expired after SIGKILL, or it left with SIGTERM) no longer
releases anything. The controller takes its messages over: for each key under the departed
node's name, one transaction at the revision read deletes it and puts it under the
controller's own name and lease; then the controller holds it as its own and releases it when
due (at once if its time has passed). A controller that dies leaves its keys under its own
name, and the next controller takes them over the same way. A node that restarts under the
same id takes over what its previous life left (keys naming an older lease) unless the
controller did first. A message held under a lease that is no longer this node's (its lease
lapsed and it registered again) is not released by the old timer: the takeover finds it.

Released once while the cluster is steady: only the holder releases a message, and a holder
is taken over only once it has left the view. Across the death of the releasing node it is
once too on a reliable stream: a holder can die after the owner of the shard acknowledged the
release and before its delete reached etcd, so the released copy carries a release id (the
key's `<deliver-at>-<id>`, in `Message.native_properties` under `RELEASE_FORMAT`, which no
protocol shows to its clients and the journal keeps), and a node releasing a message it took
over (from another holder or from its own previous life) first reads the topic's shard from
its deliver-at time on for that id (`journal_search.py`, as a will's claim is checked); found,
it only deletes the key. A non-reliable shard keeps no journal: there a takeover releases
again (at least once). A holder whose lease lapses (frozen, cut from etcd) while a release is
in flight may see its message released by the controller too, if the controller reads the
shard before that release reached it. Nothing is ever deleted before its release was
acknowledged.

On time: a holder releases on its own timer. A message due while its holder is dead (SIGKILL)
but not yet seen gone waits for the holder's lease to expire (`cluster.lease_ttl_s`) and the
controller's takeover, so it can be late by up to the lease TTL; releasing it earlier would
need someone else to act on a message its holder may still be releasing, which is what the
lease rules out. A holder that leaves with SIGTERM is seen gone at once (it revokes its lease).

Test hook (tests only, never set in production): when the environment variable
`SG_TEST_PAUSE_BEFORE_DELAYED_DELETE` names a file, a node whose release was acknowledged waits
while that file exists before it deletes the key, so that a test can kill it in between.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..core.errors import PublishRejected, ShardUnavailable, StoreFull
from ..core.message import Message, now_ms
from ..core.records import decode_to_message, encode_message
from . import keys
from .etcd import KeyValue
from .journal_search import shard_holds
from .set_aside import UNREADABLE, SetAside, decode_record
from .view_changes import ViewChanges
from .waits import wait_within
from .wills import pause_for_tests

if TYPE_CHECKING:
    from ..core.broker import Broker
    from .control import ClusterNode

log = logging.getLogger(__name__)

# The largest encoded message etcd keeps (a value grows by a third in base64).
MAX_RECORD_BYTES = 64 * 1024
# How many delayed messages one node holds at most (etcd's store is bounded too).
MAX_HELD = 10_000
# Puts or deletes in one etcd transaction, and their bytes (etcd's defaults: 128 operations,
# 1.5 MiB a request).
TXN_OPS = 64
TXN_BYTES = 1024 * 1024
# How often the controller looks for messages of departed holders even when no node left (a
# safety net: a node leaving the view starts a look at once).
SCAN_INTERVAL_S = 10.0
# How long a message held while the node joins waits for its lease before it is refused.
JOIN_WAIT_S = 10.0
# How long a release waits at most before trying again when its shard has no live owner now
# (the view's next change wakes it sooner).
RETRY_S = 1.0
# The released copy's release id, by this format name in `Message.native_properties`.
RELEASE_FORMAT = "shardgate-delayed-release"
# Where the search for an earlier release of a taken-over message starts, before its deliver-at
# time (the journal is found by time; the match itself is exact on the release id).
SEARCH_BEFORE_DUE_MS = 60_000
# Names a file: while it exists, a node whose release was acknowledged waits before deleting.
DELETE_PAUSE_ENV = "SG_TEST_PAUSE_BEFORE_DELAYED_DELETE"


@dataclass(slots=True)
class HeldMessage:
    message: Message
    at_ms: int
    # the lease it is held under here: a release under a lease no longer ours does nothing
    lease: int
    # taken over from a holder (or this node's previous life) that may have released it
    inherited: bool = False
    timer: asyncio.TimerHandle | None = None


def record(message: Message, at_ms: int, node: str, lease: int) -> bytes:
    """What etcd keeps of a held message."""
    return keys.encode({"node": node, "lease": lease, "at": at_ms,
                        "data": base64.b64encode(encode_message(message)).decode()})


class SharedDelayed:
    """Holds this node's delayed messages in etcd and takes over those of departed nodes
    (module docstring). Installed as `broker.delayed.shared` (core.delayed.SharedHold)."""

    def __init__(self, node: ClusterNode, publish: Callable[[Message], asyncio.Future[None] | None],
                 broker: Broker | None = None) -> None:
        self.node = node
        self.publish = publish
        self.view_changes = ViewChanges(node.view)
        # where a taken-over message's earlier release is looked for (None: never looked for)
        self.broker = broker
        self.prefix = node.settings.prefix.rstrip("/") + ".state/delayed/"
        # records in etcd that cannot be restored: logged once each, left where they are
        self.set_aside = SetAside(log)
        self._held: dict[str, HeldMessage] = {}
        # waiting for the next put transaction: (key, message, deliver-at, acknowledgement)
        self._puts: list[tuple[str, Message, int, asyncio.Future[None]]] = []
        # released, waiting for the next delete transaction
        self._deletes: list[str] = []
        self._writer: asyncio.Task[None] | None = None
        self._scanner: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake_scan = asyncio.Event()
        self._known_nodes: set[str] = set()
        self._was_controller = False
        self._closed = False
        self.released = 0
        self.taken_over = 0
        # taken-over messages found released already by their previous holder
        self.found_released = 0

    def __len__(self) -> int:
        return len(self._held) + len(self._puts)

    def own_prefix(self, node_id: str | None = None) -> str:
        return f"{self.prefix}{node_id or self.node.node_id}/"

    # ------------------------------------------------------------ holding (core.SharedHold)
    def hold(self, message: Message, at_ms: int) -> asyncio.Future[None]:
        if self._closed:
            raise ShardUnavailable("this node is stopping: publish the delayed message to another node")
        if len(self) >= MAX_HELD:
            raise StoreFull(
                f"this node holds {MAX_HELD} delayed messages already (the cluster limit per node); "
                "try again later or on another node")
        size = len(encode_message(message))
        if size > MAX_RECORD_BYTES:
            raise PublishRejected(
                f"a delayed message may be at most {MAX_RECORD_BYTES} bytes in a cluster "
                f"(this one is {size} bytes encoded)")
        key = f"{self.own_prefix()}{at_ms:013d}-{uuid.uuid4().hex}"
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.add_done_callback(_retrieved)  # a QoS 0 publisher never looks at its outcome
        self._puts.append((key, message, at_ms, done))
        self._kick_writer()
        return done

    def _kick_writer(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        """Put the waiting messages and delete the released ones, a transaction at a time."""
        while self._puts or self._deletes:
            if self._puts:
                await self._put_batch()
            if self._deletes:
                await self._delete_batch()

    async def _put_batch(self) -> None:
        loop = asyncio.get_running_loop()
        joining_until = loop.time() + JOIN_WAIT_S
        while not self.node.lease_id and loop.time() < joining_until:
            # held while the node is still joining: its join changes the view
            await self.view_changes.since(self.view_changes.count, joining_until - loop.time())
        batch: list[tuple[str, Message, int, asyncio.Future[None]]] = []
        puts: list[tuple[str, bytes]] = []
        size = 0
        node_id, lease = self.node.node_id, self.node.lease_id
        while self._puts and len(batch) < TXN_OPS and size < TXN_BYTES:
            key, message, at_ms, done = self._puts.pop(0)
            value = record(message, at_ms, node_id, lease)
            size += len(value)
            puts.append((key, value))
            batch.append((key, message, at_ms, done))
        try:
            if not lease or not self.node.view.lease_alive():
                raise ShardUnavailable("this node cannot prove its cluster membership now")
            await self.node.state_store.write(puts)
        except Exception as exc:  # noqa: BLE001 - the publishers are told, retryably
            refusal = exc if isinstance(exc, PublishRejected) else ShardUnavailable(
                f"the delayed message could not be stored in etcd: {exc}")
            for _key, _message, _at, done in batch:
                if not done.done():
                    done.set_exception(refusal)
            return
        for key, message, at_ms, done in batch:
            self._schedule(key, message, at_ms, lease)
            if not done.done():
                done.set_result(None)

    async def _delete_batch(self) -> None:
        batch, self._deletes = self._deletes[:TXN_OPS], self._deletes[TXN_OPS:]
        try:
            await self.node.state_store.write(deletes=batch)
        except Exception as exc:  # noqa: BLE001 - kept; deleted with the next batch
            log.warning("cluster: cannot delete %d released delayed messages from etcd yet: %s",
                        len(batch), exc)
            self._deletes[:0] = batch
            await asyncio.sleep(RETRY_S)

    def _schedule(self, key: str, message: Message, at_ms: int, lease: int, inherited: bool = False) -> None:
        old = self._held.pop(key, None)
        if old is not None and old.timer is not None:
            old.timer.cancel()
        held = self._held[key] = HeldMessage(message, at_ms, lease, inherited)
        delay = max(0.0, (at_ms - now_ms()) / 1000)
        held.timer = asyncio.get_running_loop().call_later(delay, self._due, key)

    # ------------------------------------------------------------ releasing
    def _due(self, key: str) -> None:
        held = self._held.get(key)
        if held is None or self._closed:
            return
        held.timer = None
        task = asyncio.get_running_loop().create_task(self._release(key, held))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, key: str, held: HeldMessage) -> None:
        """Publish a due message (retried while its shard has no live owner), then delete it."""
        logged = False
        while self._held.get(key) is held:
            seen = self.view_changes.count
            if held.lease != self.node.lease_id:
                # held under a lease that lapsed: the takeover (ours or the controller's) has it
                del self._held[key]
                return
            if self.node.view.lease_alive():
                release_id = key.rsplit("/", 1)[1]
                try:
                    if held.inherited and await self._released_before(held, release_id):
                        log.info("cluster: a taken-over delayed message for %r was released by its "
                                 "previous holder already", held.message.topic)
                        self.found_released += 1
                    else:
                        receipt = self.publish(released_copy(held.message, release_id))
                        if receipt is not None:
                            await receipt
                        self.released += 1
                except Exception as exc:  # noqa: BLE001 - a shard without live owner: retried
                    if not logged:
                        log.info("cluster: a delayed message for %r waits for its shard (%s)",
                                 held.message.topic, exc)
                        logged = True
                else:
                    await pause_for_tests(DELETE_PAUSE_ENV)
                    if self._held.get(key) is held:
                        del self._held[key]
                    self._deletes.append(key)
                    self._kick_writer()
                    return
            if self._closed:
                return  # stays in etcd: the takeover releases it
            # a shard's owner coming back, or this node's lease, changes the view
            await self.view_changes.since(seen, RETRY_S)

    async def _released_before(self, held: HeldMessage, release_id: str) -> bool:
        """Whether the topic's shard holds this message's release already (its previous holder
        died after the release and before the delete). False when that cannot be known (a
        non-reliable stream: released again); raises ShardUnreadable while the shard's owner
        cannot be read (the release waits for it as a publish would)."""
        if self.broker is None:
            return False
        wanted = release_id.encode()

        def same_release(message: Message) -> bool:
            native = message.native_properties
            return native is not None and native.get(RELEASE_FORMAT) == wanted

        found = await shard_holds(self.node, self.broker, held.message.topic,
                                  held.at_ms - SEARCH_BEFORE_DUE_MS, same_release)
        return bool(found)

    # ------------------------------------------------------------ taking over
    def start(self) -> None:
        self._known_nodes = set(self.node.view.nodes())
        self.node.view.on_change(self._view_changed)
        self._scanner = asyncio.get_running_loop().create_task(self._scan_loop())

    def _view_changed(self) -> None:
        view = self.node.view
        nodes = set(view.nodes())
        controller = view.controller_id == self.node.node_id
        if self._known_nodes - nodes or (controller and not self._was_controller):
            self._wake_scan.set()  # a node left, or this node became controller: take over
        self._known_nodes = nodes
        self._was_controller = controller

    async def _scan_loop(self) -> None:
        checked_lease = 0  # the lease this node's own keys were last taken over under
        while not self._closed:
            try:
                lease = self.node.lease_id
                if lease and lease != checked_lease and self.node.view.lease_alive():
                    # a first start, a restart, or a lease that lapsed: keys naming an older one
                    await self.take_over(self.own_prefix())
                    checked_lease = lease
                if self.node.is_controller:
                    await self.take_over_departed()
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                log.warning("cluster: looking for delayed messages of departed nodes failed: %s", exc)
            self._wake_scan.clear()
            try:
                await wait_within(self._wake_scan.wait(), SCAN_INTERVAL_S)
            except TimeoutError:
                pass

    async def take_over_departed(self) -> int:
        """The controller's round: take over the messages of every holder not in the view
        (their names are read first, then only the departed holders' messages)."""
        live = self.node.view.nodes()
        departed = {
            name[len(self.prefix):].split("/", 1)[0]
            for name in await self.node.state_store.get_keys(self.prefix)
        } - set(live) - {self.node.node_id}
        taken = 0
        for holder in sorted(departed):
            taken += await self.take_over(self.own_prefix(holder))
        return taken

    def _orphaned(self, kv: KeyValue, state: dict[str, Any]) -> bool:
        holder = kv.key[len(self.prefix):].split("/", 1)[0]
        if holder == self.node.node_id:
            # left by this node's previous life (or a lease that lapsed), not held here now
            return bool(state.get("lease") != self.node.lease_id)
        return holder not in self.node.view.nodes()

    async def take_over(self, prefix: str) -> int:
        """Move every message under `prefix` whose holder is gone to this node (module
        docstring); returns how many were taken."""
        if not self.node.lease_id or not self.node.view.lease_alive():
            return 0
        kvs, _revision = await self.node.state_store.get_prefix(prefix)
        taken = 0
        for kv in kvs:
            try:
                state = decode_record(kv.value)
                message = decode_to_message(base64.b64decode(state["data"]))
                at_ms = int(state["at"])
            except UNREADABLE as exc:  # (RecordFormatError is a ValueError)
                self.set_aside("a delayed message", kv, exc)
                continue
            if not self._orphaned(kv, state):
                continue
            lease = self.node.lease_id
            name = kv.key.rsplit("/", 1)[1]
            key = f"{self.own_prefix()}{name}"
            moved = await self.node.state_store.write(
                [(key, record(message, at_ms, self.node.node_id, lease))],
                deletes=[kv.key] if key != kv.key else [], if_at=(kv.key, kv.mod_revision))
            if moved is None:
                continue  # released, or taken by another node meanwhile
            holder = kv.key[len(self.prefix):].split("/", 1)[0]
            log.info("cluster: took over a delayed message for %r held by %s (due in %.1f s)",
                     message.topic, holder, max(0, at_ms - now_ms()) / 1000)
            self._schedule(key, message, at_ms, lease, inherited=True)
            taken += 1
        self.taken_over += taken
        return taken

    # ------------------------------------------------------------ stopping
    async def finish(self, timeout_s: float = 5.0) -> None:
        """Stop holding and releasing (what is held stays in etcd for the takeover), let the
        releases under way end, and delete what was released (bounded by `timeout_s`)."""
        self._closed = True
        for held in self._held.values():
            if held.timer is not None:
                held.timer.cancel()
                held.timer = None
        for _key, _message, _at, done in self._puts:
            if not done.done():
                done.set_exception(ShardUnavailable("this node is stopping: publish the delayed message again"))
        self._puts.clear()
        if self._scanner is not None:
            self._scanner.cancel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        releases = [task for task in self._tasks if not task.done()]
        if releases:
            await asyncio.wait(releases, timeout=max(0.1, deadline - loop.time()))
        if self._writer is not None and not self._writer.done():
            await asyncio.wait([self._writer], timeout=max(0.1, deadline - loop.time()))
        while self._deletes and loop.time() < deadline:
            await self._delete_batch()

    def close(self) -> None:
        """Stop at once (after `finish`, or when the node stops without it)."""
        self._closed = True
        for held in self._held.values():
            if held.timer is not None:
                held.timer.cancel()
        self._held.clear()
        for _key, _message, _at, done in self._puts:
            if not done.done():
                done.set_exception(ShardUnavailable("this node stopped before the delayed message was stored"))
        self._puts.clear()
        for task in (self._scanner, self._writer, *self._tasks):
            if task is not None:
                task.cancel()


def released_copy(message: Message, release_id: str) -> Message:
    """The message as released: a fresh copy, stamped now, carrying its release id."""
    copy = decode_to_message(encode_message(message))
    return replace(copy, publish_time_ms=now_ms(),
                   native_properties={**(copy.native_properties or {}), RELEASE_FORMAT: release_id.encode()})


def _retrieved(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()
