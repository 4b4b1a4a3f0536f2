"""AMQP queues shared by every node of a cluster: where a queue lives, and the calls that let a
client of any node use it (the transport of `protocols/amqp/remote.py`).

**Where a queue lives.** A shared queue (neither exclusive nor auto-delete) lives on the node
where it was first declared, its *home*, as a classic queue in a RabbitMQ cluster does. etcd
names the home: `amqp/<vhost>/queues/<name>` holds `{"node": id, "durable": bool}`. The
declaring node writes it with a create-if-absent transaction before its declare-ok, so of two
nodes declaring the name at once one is the home and the other forwards its declare there.
A node writes it again when it starts with the queue, and deletes it with the queue. A
non-durable queue ends with its node, so its record then no longer counts.
Every node's watch keeps these records, so finding a queue's home costs no etcd read.

The home is not taken from the shard placement, because a queue has no shard of its own. Its
bindings take messages from any number of streams and shards, and its state sits on its home
node: the cursors of its durable subscription, the unacknowledged deliveries, the consumers'
order and the prefetch. Moving that state with every placement change would redeliver what
its consumers hold, and a queue's home changes only when an operator deletes it.
Exclusive and auto-delete queues belong to one connection and stay on its node
(RabbitMQ's exclusive queues are node-local too). An exclusive queue is recorded as well
(`{"node": id, "durable": false}`), so that another node forwards what its clients ask of it
to its node, which answers 405 RESOURCE_LOCKED as RabbitMQ does.

**Using it from another node.** That node asks the home node over the cluster port
(`shardgate.cluster.v1.AmqpQueues`): `Call` runs one queue operation there
(`QueueHost.handle`: declare, bind, unbind, purge, delete, get, settle), and `Consume` is one
consumer's link, a stream each way of packed frames (`remote.pack_frames`). A bind answers
only once the home node's peers know the new route (`Broker.routes_ready`, as a SUBACK
waits), so a publish on any node right after bind-ok reaches the queue.

**While the home node is down** (SIGKILL, or a graceful leave: a reliable shard and the
queue's cursors do not move without replication), the record stays. Every other node then
answers as RabbitMQ answers for a durable classic queue whose node is down: 404 "home node
'n1' of durable queue 'q' in vhost '/' is down or inaccessible" (rabbit_amqqueue:absent/2),
for a passive declare too. A redeclare on another node does not create an empty twin. The
consumers of the queue on other nodes get basic.cancel, as RabbitMQ cancels them. When the
node returns, the queue is back with its messages. That includes the persistent messages
published meanwhile on shards other nodes own: they are in those owners' journals. A restored
queue's cursors on such shards read them from the owners once the node has joined, from the
floors saved in its store, as every restored durable subscription's
(`sessions.CursorPlacer.replay_restored`): what the queue held before comes again marked
`redelivered`, and once. Until then the restored cursors wait unplaced: pushes that arrive
before the join are not handed out (they were, then again by the replay from the floor).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import grpc

from ..protocols.amqp.remote import (
    DELETED,
    DELIVERY,
    HostedConsumer,
    QueueHost,
    is_shared,
    pack_frames,
    unpack_frames,
)
from . import keys
from .amqp_queue_replicas import new_incarnation, queue_name_of
from .link_auth import cluster_channel
from .set_aside import SetAside, decode_record
from .state_rpc import CHANNEL_OPTIONS
from .waits import wait_within

if TYPE_CHECKING:
    from ..core.broker import Broker
    from .amqp_queue_replicas import QueueReplicas
    from .control import ClusterNode
    from .data_plane import DataPlane

log = logging.getLogger(__name__)

SERVICE = "shardgate.cluster.v1.AmqpQueues"
CALL = "Call"
CONSUME = "Consume"
CALL_TIMEOUT_S = 10.0
# `Call` asking a node to answer once its etcd watch has applied a revision, and how long
# that waits at most (a watch is normally milliseconds behind)
CAUGHT_UP = "caught_up"
CAUGHT_UP_S = 3.0
# queue operations whose reply waits until the queue's state is replicated
REPLICATED_OPS = frozenset({"declare", "bind", "unbind", "purge"})


def queue_key(vhost: str, name: str) -> str:
    return f"{keys.AMQP}{quote(vhost, safe='')}/queues/{quote(name, safe='')}"


class SharedQueues:
    """This node's queue records in etcd, its answers to other nodes' calls, and the
    `QueueDirectory` its virtual hosts use to reach other nodes' queues (module docstring)."""

    def __init__(self, node: ClusterNode, broker: Broker, replicas: QueueReplicas | None = None) -> None:
        self.node = node
        self.broker = broker
        # the replicated state of the durable queues homed here, and their takeover when
        # their home dies (`amqp_queue_replicas.py`); None: a queue lives and dies with its home
        self.replicas = replicas
        # the AMQP service, whose virtual hosts are built with this object as their queue
        # directory, and its queues as other nodes reach them: once `install`ed
        self.amqp: Any = None
        self.host: QueueHost | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._live: set[str] = set()
        # the consumer links of this node's clients, open to the queues' homes
        self._consumer_links: set[ConsumerLink] = set()
        # calls waiting until this node's view of etcd reaches a revision
        self._revision_waiters: list[tuple[int, asyncio.Future[None]]] = []
        # records in etcd that cannot be restored: logged once each, left where they are
        self.set_aside = SetAside(log)

    def install(self, plane: DataPlane, amqp: Any) -> None:
        self.amqp = amqp
        self.host = QueueHost(amqp)
        plane.add_service(self.handler())
        for vhost in self.amqp.vhosts.values():
            vhost.use_queue_directory()
            vhost.on_queue_deleted.append(lambda queue, vhost=vhost: self._queue_deleted(vhost, queue))
            self.forget_gone(vhost)
        self._live = set(self.node.view.nodes())
        self.node.view.on_change(self._view_changed)
        self.node.document_listeners.append(self._documents_changed)
        if self.replicas is not None:
            self.replicas.install(amqp)
            self.replicas.consider()  # homes that died while this node was away

    # ------------------------------------------------------------ records in etcd
    async def claim_restored(self) -> None:
        """At start: record this node as the home of the shared queues it restored (a queue
        declared here before the node joined, or kept across a restart)."""
        for vhost in self.amqp.vhosts.values():
            for name, queue in list(vhost.queues.items()):
                if not is_shared(queue):
                    continue
                try:
                    home = await self._claim(vhost.name, name, queue.durable)
                except Exception as exc:  # noqa: BLE001 - the next declare claims it again
                    log.warning("cluster: cannot record AMQP queue %r in etcd: %s", name, exc)
                    continue
                if home is not None and self._taken_over(vhost.name, name):
                    # taken over while this node was away: its copy here is stale
                    log.info("cluster: AMQP queue %r of vhost %r moved to node %s while this node "
                             "was away; its copy here is dropped", name, vhost.name, home)
                    vhost.delete_queue(queue)
                elif home is not None:
                    log.warning("cluster: AMQP queue %r of vhost %r also lives on node %s; clients "
                                "of other nodes use that one", name, vhost.name, home)

    def forget_gone(self, vhost: Any) -> None:
        """Drop the records of queues homed here that `vhost` no longer has (a non-durable
        queue does not outlive its node's restart)."""
        me = self.node.node_id
        prefix = queue_key(vhost.name, "")
        for key, value in list(self.node.view.documents.items()):
            if key.startswith(prefix) and self._node_in(key, value) == me:
                queue = vhost.queues.get(unquote(key[len(prefix):]))
                if queue is None or not is_shared(queue):
                    self._forget(key)

    def _taken_over(self, vhost: str, name: str) -> bool:
        """Whether the queue's record names another node by a takeover (a later epoch)."""
        value = self.node.view.documents.get(queue_key(vhost, name))
        if value is None:
            return False
        try:
            record = decode_record(value)
        except ValueError:
            return False
        return record.get("node") not in (None, self.node.node_id) and int(record.get("epoch", 0) or 0) > 0

    def _moved_away(self, vhost_name: str, name: str) -> None:
        """A queue this node has was taken over by another node (this node was paused or cut
        off past its lease, or came back): drop the stale copy here. Its consumers are
        cancelled; its state is never written again from here."""
        if self.amqp is None or not self._taken_over(vhost_name, name):
            return
        vhost = self.amqp.vhosts.get(vhost_name)
        queue = vhost.queues.get(name) if vhost is not None else None
        if queue is None or not queue.durable or not is_shared(queue):
            return
        log.warning("cluster: AMQP queue %r of vhost %r was taken over by another node; its copy "
                    "here is dropped", name, vhost_name)
        vhost.delete_queue(queue)
        if self.replicas is not None:
            self.replicas.forget(vhost_name, name)

    def _queue_deleted(self, vhost: Any, queue: Any) -> None:
        if self.replicas is not None:
            self.replicas.forget(vhost.name, queue.name)
        key = queue_key(vhost.name, queue.name)
        value = self.node.view.documents.get(key)
        if value is not None and self._node_in(key, value) == self.node.node_id:
            self._forget(key)

    def _node_in(self, key: str, value: bytes) -> Any:
        """The node a queue's record names; None (set aside) when it cannot be read."""
        try:
            return decode_record(value).get("node")
        except ValueError as exc:
            self.set_aside(f"the home of AMQP queue record {key!r}", None, exc, value)
            return None

    def _forget(self, key: str) -> None:
        del self.node.view.documents[key]
        self.node.submit(key, None)

    # ------------------------------------------------------------ QueueDirectory
    def _home_in(self, value: bytes | None) -> str | None:
        """The other node a record names, unless the queue is gone with it: a non-durable
        queue whose node is down no longer exists (as in RabbitMQ)."""
        if value is None:
            return None
        try:
            record = decode_record(value)
        except ValueError as exc:
            # as if no node had it: this node's queue of that name serves its clients
            self.set_aside("the home of an AMQP queue", None, exc, value)
            return None
        node = record.get("node")
        if node is None or node == self.node.node_id:
            return None
        if not record.get("durable", True) and node not in self.node.view.nodes():
            return None
        return str(node)

    def home(self, vhost: str, queue: str) -> str | None:
        return self._home_in(self.node.view.documents.get(queue_key(vhost, queue)))

    def live(self, node: str) -> bool:
        registration = self.node.view.registrations.get(node)
        return node in self.node.view.nodes() and (registration is None or not registration.leaving)

    def lookup(self, vhost: str, queue: str) -> asyncio.Future[str | None]:
        return asyncio.ensure_future(self._lookup(vhost, queue))

    async def _lookup(self, vhost: str, queue: str) -> str | None:
        kv = await self.node.state_store.get(self.node.key(queue_key(vhost, queue)))
        return self._home_in(kv.value if kv is not None else None)

    def claim(self, vhost: str, queue: str, durable: bool) -> asyncio.Future[str | None]:
        return asyncio.ensure_future(self._claim(vhost, queue, durable))

    async def _claim(self, vhost: str, queue: str, durable: bool) -> str | None:
        key = queue_key(vhost, queue)
        full = self.node.key(key)
        # a new queue's incarnation, and the epoch its takeovers count (`amqp_queue_replicas`)
        value = keys.encode({"node": self.node.node_id, "durable": durable,
                             "incarnation": new_incarnation(), "epoch": 0})
        at = 0  # the revision the record must be at: absent first
        for _ in range(3):
            created, current = await self.node.state_store.put_at(full, at, value)
            if created:
                self.node.view.documents[key] = value
                return None
            if current is None:
                at = 0
                continue
            if self._node_in(full, current.value) == self.node.node_id:
                self.node.view.documents[key] = value
                return None
            home = self._home_in(current.value)
            if home is not None:
                return home
            # a non-durable queue of a node that is gone: its record is stale, replace it
            at = current.mod_revision
        raise RuntimeError(f"the record of AMQP queue {queue!r} keeps changing")

    def _channel(self, node: str) -> grpc.aio.Channel:
        info = self.node.view.nodes().get(node)
        if info is None:
            raise ConnectionError(f"node {node} is not live")
        channel = self._channels.get(info.cluster_address)
        if channel is None:
            channel = cluster_channel(info.cluster_address, self.node.credentials, CHANNEL_OPTIONS)
            self._channels[info.cluster_address] = channel
        return channel

    def replicated(self, vhost: str, queue: str) -> asyncio.Future[None] | None:
        return self.replicas.replicated(vhost, queue) if self.replicas is not None else None

    def call(self, node: str, request: dict[str, Any]) -> asyncio.Future[dict[str, Any]]:
        return asyncio.ensure_future(self._call(node, {**request, "node": self.node.node_id}))

    async def _call(self, node: str, request: dict[str, Any]) -> dict[str, Any]:
        method = self._channel(node).unary_unary(f"/{SERVICE}/{CALL}")
        reply = await method(json.dumps(request, separators=(",", ":")).encode(), timeout=CALL_TIMEOUT_S)
        return json.loads(reply)  # type: ignore[no-any-return]

    def consume(self, node: str, request: dict[str, Any], receive: Callable[[bytes], None]) -> ConsumerLink:
        link = ConsumerLink(self, node, {**request, "node": self.node.node_id}, receive)
        self._consumer_links.add(link)
        link.ended.add_done_callback(lambda _ended: self._consumer_links.discard(link))
        return link

    def _view_changed(self) -> None:
        live = set(self.node.view.nodes())
        assert self.host is not None  # watched once installed
        for gone in self._live - live:
            self.host.node_gone(gone)
            # (a home that stopped answering, frozen or cut off, leaves its streams open
            # for good: their consumers would wait on them without a word)
            for link in [link for link in self._consumer_links if link.node == gone]:
                link.home_gone()
        self._live = live
        if self.replicas is not None:
            self.replicas.consider()

    # ------------------------------------------------------------ read your writes
    def caught_up(self, revision: int) -> asyncio.Future[None]:
        """Done once this node's view of etcd (its watch) has applied `revision`."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.node.view.revision >= revision:
            future.set_result(None)
        else:
            self._revision_waiters.append((revision, future))
        return future

    def _documents_changed(self, key: str, value: bytes | None) -> None:
        if self.replicas is not None and queue_name_of(key) is not None:
            vhost_name, name = queue_name_of(key)  # type: ignore[misc]
            if value is not None:
                self._moved_away(vhost_name, name)
            self.replicas.consider()
        if not self._revision_waiters:
            return
        seen = self.node.view.revision
        waiting = []
        for revision, future in self._revision_waiters:
            if future.done():
                continue
            if revision <= seen:
                future.set_result(None)
            else:
                waiting.append((revision, future))
        self._revision_waiters = waiting

    async def peers_caught_up(self, revision: int) -> None:
        """Wait (at most `CAUGHT_UP_S`) until every other live node has applied `revision` of
        etcd: what this node wrote there is then what a client of any node sees."""
        me = self.node.node_id
        others = [node for node in self.node.view.nodes() if node != me and self.live(node)]
        if not others:
            return
        calls = [self.call(node, {"op": CAUGHT_UP, "revision": revision}) for node in others]
        done, pending = await asyncio.wait(calls, timeout=CAUGHT_UP_S)
        for call in pending:
            call.cancel()
        for call in done:
            if call.exception() is not None:
                log.debug("cluster: a node did not confirm etcd revision %d: %s", revision, call.exception())
        if pending:
            log.warning("cluster: %d nodes had not applied etcd revision %d after %.0f s",
                        len(pending), revision, CAUGHT_UP_S)

    # ------------------------------------------------------------ serving other nodes
    def handler(self) -> grpc.GenericRpcHandler:
        host, broker = self.host, self.broker
        assert host is not None, "served once installed"

        async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            asked = json.loads(request)
            if asked.get("op") == CAUGHT_UP:
                waiter = self.caught_up(int(asked.get("revision", 0)))
                try:
                    await wait_within(waiter, CAUGHT_UP_S)
                except TimeoutError:
                    return b'{"behind":true}'
                return b"{}"
            reply = host.handle(asked)
            if asked.get("op") in REPLICATED_OPS and "error" not in reply and self.replicas is not None:
                # answered once the queue's state as it is now is replicated
                replicated = self.replicas.replicated(str(asked.get("vhost", "")), str(asked.get("queue", "")))
                if replicated is not None:
                    await replicated
            if asked.get("op") in ("bind", "declare") and "error" not in reply:
                # answered once the peers know the route (a SUBACK waits the same way)
                ready = broker.routes_ready()
                if ready is not None:
                    await ready
            return json.dumps(reply, separators=(",", ":")).encode()

        async def consume(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            incoming = requests.__aiter__()
            try:
                first = await incoming.__anext__()
            except StopAsyncIteration:
                return
            out: asyncio.Queue[bytes | None] = asyncio.Queue()
            hosted = host.consume(json.loads(first), out.put_nowait)
            if not isinstance(hosted, HostedConsumer):
                yield pack_frames([hosted])
                return

            async def read() -> None:
                try:
                    async for message in incoming:
                        for frame in unpack_frames(message):
                            hosted.receive(frame)
                except Exception as exc:  # noqa: BLE001 - the link ends either way
                    log.debug("cluster: AMQP consumer link from another node ended: %s", exc)
                finally:
                    out.put_nowait(None)

            reader = asyncio.get_running_loop().create_task(read())
            try:
                while True:
                    frames = [await out.get()]
                    while not out.empty():
                        frames.append(out.get_nowait())
                    ended = None in frames or DELETED in frames
                    batch = [frame for frame in frames if frame is not None]
                    if batch:
                        yield pack_frames(batch)
                        delivered = sum(1 for frame in batch if frame[:1] == DELIVERY)
                        if delivered:
                            hosted.written(delivered)
                    if ended:
                        return
            finally:
                reader.cancel()
                hosted.close()

        return grpc.method_handlers_generic_handler(SERVICE, {
            CALL: grpc.unary_unary_rpc_method_handler(call),
            CONSUME: grpc.stream_stream_rpc_method_handler(consume),
        })

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(grace=None)


class ConsumerLink:
    """The consuming node's end of a `Consume` stream (`remote.ConsumerLink`)."""

    def __init__(self, queues: SharedQueues, node: str, request: dict[str, Any],
                 receive: Callable[[bytes], None]) -> None:
        self.receive = receive
        self.node = node
        self.closed = False
        self._out: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._out.put_nowait(json.dumps(request, separators=(",", ":")).encode())
        self._task = asyncio.get_running_loop().create_task(self._run(queues, node))
        # done when the link has ended, however
        self.ended: asyncio.Future[None] = self._task

    def home_gone(self) -> None:
        """The home node left the view: the link ends (the consumer gets b"", as when the
        stream breaks), without waiting for a stream the home may never answer again."""
        self._task.cancel()
        # (a task cancelled before it ran never reaches its `finally`)
        self._task.add_done_callback(lambda _task: self._gone())

    def _gone(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):
                self.receive(b"")

    def send(self, frame: bytes) -> None:
        if not self.closed:
            self._out.put_nowait(frame)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._out.put_nowait(None)

    async def _requests(self) -> AsyncIterator[bytes]:
        first = await self._out.get()
        if first is None:
            return
        yield first
        while True:
            frames = [await self._out.get()]
            while not self._out.empty():
                frames.append(self._out.get_nowait())
            batch = [frame for frame in frames if frame is not None]
            if batch:
                yield pack_frames(batch)
            if None in frames:
                return

    async def _run(self, queues: SharedQueues, node: str) -> None:
        try:
            stream = queues._channel(node).stream_stream(f"/{SERVICE}/{CONSUME}")
            async for message in stream(self._requests()):
                for frame in unpack_frames(message):
                    self.receive(frame)
        except Exception as exc:  # noqa: BLE001 - unreachable or broken: the consumer is gone
            log.info("cluster: AMQP consumer link to node %s ended: %s", node, exc)
        except asyncio.CancelledError:
            pass
        finally:
            self._gone()
