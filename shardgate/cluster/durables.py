"""Durable subscriptions shared by every node of a cluster (gRPC durable subscriptions).

A durable subscription is one thing cluster-wide: its name, type, filters and cursors. Like an
MQTT persistent session (`sessions.py`), it lives on one node at a time, its *holder*, and
moves to where its consumers are:

- Its snapshot (definition, holder, cursors with their unacknowledged messages) is kept in
  etcd under `/shardgate/<cluster>.state/durables/<name>`: written when it is defined, when
  its last consumer leaves, and at least every `CHECKPOINT_S` while its cursors move (the
  debounced cursor writes Danube makes to its metadata store); up to `MAX_BATCH_PUTS` of the
  moving ones (one etcd transaction) every `SOON_CHECKPOINT_S`, those written longest ago
  first. A connected consumer acks at message rate; etcd takes about a thousand fsynced
  writes a second for the whole cluster, so cursors in motion stay in the holder's own
  metadata store (saved every 200 ms, as on a single node) and etcd gets one write per
  subscription per interval.
- A consumer that subscribes on node B to a durable subscription B does not have: B reads the
  snapshot; when the holder is live it asks it over the cluster port (`ReleaseDurable`) for the
  exact state, and the holder gives it up (its cursors stop here, nothing is lost or sent
  twice); when the holder is dead B resumes from the last checkpoint (messages since may come
  again: at least once). The shards another node owns replay from that node's journal
  (`shard_reader.OwnerLog`).
- While consumers of the subscription are attached on its holder, a consumer that comes to
  another node attaches there remotely (`durable_consumers.py`): its node relays its `Subscribe`
  stream to the holder over the cluster port (`DurableConsumers/Consume`, the same `ConsumeRequest` /
  `ConsumeResponse` messages, the client's credit window passing through end to end), where it
  is one more consumer of the subscription. So deliveries, acks, nacks and redeliveries all go
  through the one cursor: Shared spreads round robin over every consumer wherever it is
  connected, Failover has one active consumer and promotes a standby on any node when it
  leaves (its unacknowledged messages redelivered to it), and Exclusive refuses a second
  consumer from anywhere. This is the design of Pulsar and Danube: a subscription's dispatcher
  lives with one broker and its consumers connect to it; here the relay stands in for a client
  redirect, which the SDK does not follow.
- When the holder dies, a relayed stream ends with UNAVAILABLE and the SDK resubscribes on its
  own node, which takes the subscription over from the last checkpoint (above). While it has
  consumers on other nodes, the holder checkpoints every `REMOTE_CHECKPOINT_S`, so a takeover
  after a crash redelivers at most what was acknowledged within that interval.

AMQP queues are durable subscriptions too, but a queue also lives in its virtual host's
topology (exchanges, bindings, arguments): it stays on its home node and clients of every
other node use it there (`amqp_queues.py`, see docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from ..core.durable import DurableSubscription
from ..core.errors import ShardUnavailable
from ..core.message import now_ms
from ..core.subscriptions import Subscription, SubscriptionType
from . import keys

# the relay of consumers on other nodes, once in this module (old import paths keep working)
from .durable_consumers import CONSUME as CONSUME
from .durable_consumers import CONSUMERS_SERVICE as CONSUMERS_SERVICE
from .durable_consumers import DELETE as DELETE
from .durable_consumers import DESCRIBE as DESCRIBE
from .durable_consumers import DESCRIBE_TIMEOUT_S as DESCRIBE_TIMEOUT_S
from .durable_consumers import SUBSCRIPTION_HEADER as SUBSCRIPTION_HEADER
from .durable_consumers import DurableConsumers as DurableConsumers
from .etcd import EtcdError
from .session_cursors import CursorPlacer, cursor_state, placed_from
from .sessions import RELEASE_CALL_TIMEOUT_S, TAKEOVER_TIMEOUT_S
from .set_aside import UNREADABLE, SetAside, decode_record
from .state_rpc import StateCallError, StateRpc
from .state_writer import MAX_BATCH_PUTS, StateWriter
from .waits import wait_within

if TYPE_CHECKING:
    from ..core.broker import Broker
    from ..core.edge import Edge
    from .control import ClusterNode

log = logging.getLogger(__name__)

# How often the cursors of a durable subscription that moved are checkpointed to etcd.
CHECKPOINT_S = 2.0
# ... and sooner for up to `MAX_BATCH_PUTS` of the moving ones (one more etcd transaction).
SOON_CHECKPOINT_S = 0.4
# ... and of one with consumers attached from other nodes (which take it over if this node dies).
REMOTE_CHECKPOINT_S = 0.2
# Owner kinds whose durable subscriptions are shared (their owner can be rebuilt anywhere).
SHARED_KINDS = frozenset({"grpc"})


class DurableHandover:
    """Keeps this node's shareable durable subscriptions in etcd and moves them (module
    docstring)."""

    def __init__(self, node: ClusterNode, broker: Broker, placer: CursorPlacer,
                 rpc: StateRpc, writer: StateWriter) -> None:
        self.node = node
        # the front door, once `install`ed (the Edge is built with this object as its
        # `RemoteDurables`: until the node has joined, every durable subscription is local)
        self.edge: Edge | None = None
        self.broker = broker
        self.placer = placer
        self.rpc = rpc
        self.writer = writer
        self.prefix = node.settings.prefix.rstrip("/") + ".state/durables/"
        # records in etcd that cannot be restored: logged once each, left where they are
        self.set_aside = SetAside(log)
        # the cursor state last written, per subscription (to write only what moved)
        self._written: dict[str, Any] = {}
        # when each subscription's checkpoint was last queued (monotonic seconds)
        self._written_at: dict[str, float] = {}
        self._releasing: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self.taken_over = 0
        # relayed streams from other nodes being served here, per subscription
        # (`durable_consumers.DurableConsumers`)
        self._remote: Counter[str] = Counter()

    def key(self, name: str) -> str:
        return self.prefix + name

    # ------------------------------------------------------------ wiring
    def install(self, edge: Edge) -> None:
        """The node has joined: take part (the core and the gRPC server were built with this
        object as their port for durable subscriptions held elsewhere)."""
        self.edge = edge
        self.rpc.on_release_durable = self.release
        self.broker.watch_durables(self)
        self._task = asyncio.get_running_loop().create_task(self._checkpoints())

    def relay_started(self, sub: DurableSubscription) -> None:
        """A consumer on another node attached here: checkpoint `sub` more often, for that node
        takes it over if this one dies (`REMOTE_CHECKPOINT_S`)."""
        self._remote[sub.name] += 1

    def relay_ended(self, sub: DurableSubscription) -> None:
        self._remote[sub.name] -= 1
        if self._remote[sub.name] <= 0:
            del self._remote[sub.name]
            self._checkpoint(sub)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for sub in self._shared():
            self._checkpoint(sub)  # the writer writes them before it stops

    def shareable(self, sub: Subscription) -> bool:
        if not isinstance(sub, DurableSubscription) or sub.name.startswith("mqtt:"):
            return False
        owner = sub.owner
        if getattr(owner, "transient", False):
            return False
        options = getattr(owner, "saved_options", None)
        return callable(options) and options().get("protocol") in SHARED_KINDS

    def _shared(self) -> list[DurableSubscription]:
        return [sub for sub in list(self.broker.subscriptions.values())
                if isinstance(sub, DurableSubscription) and self.shareable(sub)]

    def snapshot(self, sub: DurableSubscription) -> dict[str, Any]:
        cursors, messages = cursor_state(sub)
        owner_options = sub.owner.saved_options()
        return {
            "node": self.node.node_id, "name": sub.name, "type": sub.type.value,
            "filters": sorted(sub.filters), "owner": owner_options, "cursors": cursors,
            "messages": messages, "taken_ms": now_ms(),
        }

    # ------------------------------------------------------------ writing to etcd
    def durable_defined(self, sub: DurableSubscription) -> None:
        """`core.placement.DurableWatcher`: told after the local store."""
        if self.shareable(sub):
            self._checkpoint(sub, force=True)

    def durable_removed(self, sub: Subscription) -> None:
        name = sub.name
        if name in self._releasing or not self.shareable(sub):
            return
        self._written.pop(name, None)
        self._written_at.pop(name, None)
        self.writer.delete_if_mine(self.key(name), lambda: name not in self.broker.subscriptions)

    def _checkpoint(self, sub: DurableSubscription, *, force: bool = False) -> bool:
        """Queue `sub`'s snapshot if it changed since the last one (or `force`); whether it was."""
        state = [sorted(sub.filters), cursor_state(sub)[0]]
        if not force and self._written.get(sub.name) == state:
            return False
        self._written[sub.name] = state
        self._written_at[sub.name] = time.monotonic()

        def make() -> bytes | None:
            if self.broker.subscriptions.get(sub.name) is not sub:
                return None
            return keys.encode(self.snapshot(sub))
        self.writer.put(self.key(sub.name), make)
        return True

    async def _checkpoints(self) -> None:
        rounds = 0
        every = max(1, round(CHECKPOINT_S / REMOTE_CHECKPOINT_S))
        soon_every = max(1, round(SOON_CHECKPOINT_S / REMOTE_CHECKPOINT_S))
        while True:
            await asyncio.sleep(REMOTE_CHECKPOINT_S)
            rounds += 1
            try:
                shared = self._shared()
                for sub in shared:
                    if rounds % every == 0 or self._remote[sub.name]:
                        self._checkpoint(sub)
                if rounds % every and rounds % soon_every == 0:
                    self._checkpoint_sooner(shared)
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("cluster: checkpointing durable subscriptions failed")

    def _checkpoint_sooner(self, shared: list[DurableSubscription]) -> int:
        """Queue up to `MAX_BATCH_PUTS` of the moving subscriptions' snapshots, those written
        longest ago first (one etcd transaction at most); returns how many."""
        queued = 0
        for sub in sorted(shared, key=lambda sub: self._written_at.get(sub.name, 0.0)):
            if queued >= MAX_BATCH_PUTS:
                break
            queued += self._checkpoint(sub)
        return queued

    async def drop_moved(self) -> int:
        """At start: drop durable subscriptions restored from this node's store that another
        node holds now (etcd names it)."""
        dropped = 0
        for sub in self._shared():
            try:
                kv = await self.node.state_store.get(self.key(sub.name))
            except Exception as exc:  # noqa: BLE001 - kept; checked again at its next move
                log.warning("cluster: cannot check where subscription %r lives: %s", sub.name, exc)
                continue
            try:
                holder = decode_record(kv.value).get("node") if kv is not None else None
            except ValueError as exc:
                # kept here as it is: the record says nothing of where it lives
                self.set_aside(f"durable subscription {sub.name!r}", kv, exc)
                continue
            if holder is not None and holder != self.node.node_id and not sub.consumers:
                self._give_up(sub)
                dropped += 1
        if dropped:
            log.info("cluster: %d durable subscriptions restored here had moved; dropped", dropped)
        return dropped

    def _give_up(self, sub: DurableSubscription) -> None:
        self._releasing.add(sub.name)
        try:
            self.broker.remove_subscription(sub.name)
            self._written.pop(sub.name, None)
            self._written_at.pop(sub.name, None)
        finally:
            self._releasing.discard(sub.name)

    # ------------------------------------------------------------ the consumer's node
    async def find(self, name: str) -> str | None:
        """Bring subscription `name` here (None), or name the node where it is consumed now
        (`core.placement.RemoteDurables`). Before the node has joined, it is local (None)."""
        if self.edge is None:
            return None
        try:
            return await wait_within(self._find(name), TAKEOVER_TIMEOUT_S)
        except TimeoutError:
            raise ShardUnavailable(
                f"durable subscription {name!r} could not be brought to this node in time; retry"
            ) from None
        except EtcdError as exc:
            raise ShardUnavailable(
                f"durable subscription {name!r} cannot be looked up in etcd now ({exc}); retry"
            ) from exc

    async def _find(self, name: str) -> str | None:
        me = self.node.node_id
        client = self.node.state_store
        key = self.key(name)
        for _ in range(5):
            kv = await client.get(key)
            if kv is None:
                # a new subscription: claimed with a create-if-absent transaction, so that of
                # two nodes defining it at once one holds it and the other relays to it
                claim = keys.encode({"node": me, "name": name, "taken_ms": now_ms()})
                if (await client.create(key, claim))[0]:
                    return None
                continue
            try:
                state = decode_record(kv.value)
            except ValueError as exc:
                self.set_aside(f"durable subscription {name!r}", kv, exc)
                raise ShardUnavailable(f"durable subscription {name!r} cannot be restored from "
                                       f"its record in etcd ({exc}); it is set aside") from None
            holder = state.get("node")
            if holder != me and holder in self.node.view.nodes():
                try:
                    reply = await self.rpc.release_durable(str(holder), {"name": name, "to": me},
                                                           RELEASE_CALL_TIMEOUT_S)
                except StateCallError as exc:
                    log.warning("cluster: node %s did not hand subscription %r over (%s); resuming "
                                "from its last checkpoint", holder, name, exc)
                    reply = {}
                    # read again: a holder that stops gracefully writes its last checkpoint
                    # before its cluster port closes, maybe after the read above
                    kv = await client.get(key)
                    try:
                        state = decode_record(kv.value) if kv is not None else {}
                    except ValueError:
                        continue  # set aside at the next turn of the loop
                    if kv is None or state.get("node") != holder:
                        continue
                if reply.get("holder"):
                    return str(reply["holder"])
                if reply.get("state") is not None:
                    state = reply["state"]
            if name in self.broker.subscriptions:
                return None
            if holder != me:
                # take it with a transaction on the revision read: of two nodes taking over a
                # dead holder's subscription, one holds it and the other relays to it
                claim = keys.encode(dict(state, node=me, taken_ms=state.get("taken_ms", now_ms())))
                if not await client.replace_unchanged(key, kv.mod_revision, claim):
                    continue
                if name in self.broker.subscriptions:
                    return None
            if "type" not in state:
                return None  # claimed but never defined (its first consumer was refused)
            try:
                self.adopt(state)
            except UNREADABLE as exc:
                self.set_aside(f"durable subscription {name!r}", kv, exc, state)
                raise ShardUnavailable(f"durable subscription {name!r} cannot be restored from "
                                       f"its record in etcd ({exc}); it is set aside") from None
            self.taken_over += 1
            log.info("cluster: durable subscription %r taken over from %s", name, holder)
            return None
        raise ShardUnavailable(f"the record of durable subscription {name!r} keeps changing; retry")

    def adopt(self, state: dict[str, Any]) -> DurableSubscription:
        broker = self.broker
        options = dict(state.get("owner") or {})
        assert self.edge is not None, "adopted only once installed"
        factory = self.edge.owner_factories.get(str(options.get("protocol", "")))
        owner = factory(options) if factory is not None else None
        sub = broker.durable_subscription(state["name"], SubscriptionType(state["type"]), owner=owner)
        try:
            cursors, messages = placed_from(state.get("cursors", []), state.get("messages", []))
            self.placer.place(sub, cursors, messages, int(state.get("taken_ms", now_ms())))
            for topic_filter in state.get("filters", []):
                broker.add_filter(sub, topic_filter)
        except BaseException:
            self._give_up(sub)  # what was made of it leaves the broker
            raise
        self._checkpoint(sub, force=True)  # etcd names this node now
        return sub

    # ------------------------------------------------------------ the holder
    async def release(self, request: dict[str, Any]) -> dict[str, Any]:
        name = str(request["name"])
        to = str(request.get("to", "another node"))
        sub = self.broker.subscriptions.get(name)
        if sub is None or not self.shareable(sub):
            return {"state": None}
        assert isinstance(sub, DurableSubscription)
        if sub.consumers:
            return {"holder": self.node.node_id}  # consumed here: the new consumer attaches here
        state = self.snapshot(sub)
        self._give_up(sub)
        log.info("cluster: durable subscription %r handed over to %s", name, to)
        return {"state": state}
