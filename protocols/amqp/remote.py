"""AMQP queues that live on another node of a cluster, used as RabbitMQ's nodes use a classic
queue on its home node.

A shared queue (neither exclusive nor auto-delete) lives on one node, its *home*: the
node where it was declared (the cluster records it; see `shardgate/cluster/amqp_queues.py`).
A client of any other node uses it through its home node:

- queue.declare (passive or not), queue.bind, queue.unbind, queue.purge, queue.delete and
  basic.get become one call to the home node (`QueueDirectory.call`). The home node runs them on
  the real queue (`QueueHost.handle`) and answers with the reply's fields, or with the channel
  exception to raise.
- basic.consume opens a consumer link to the home node (`QueueDirectory.consume`). There the
  consumer is registered on the queue like a local one, with the same prefetch
  (`HostedConsumer`). Each delivery goes over the link, and the acks, nacks, rejects and
  requeues come back over it. When the link ends (cancel, channel or connection closed, a node
  gone) the home node requeues what was not settled, as for a local consumer.
- On the client's node a `RemoteQueue` stands for the queue in the channel's consumers and
  unacknowledged deliveries, so that an ack or a requeue goes to where the message came from.

When the home node is down, these operations fail as in RabbitMQ (rabbit_amqqueue:absent/2):
404 "home node 'n1' of durable queue 'q' in vhost '/' is down or inaccessible".

Sans-IO: the transport (gRPC on the cluster port) belongs to the cluster; the frames of a
consumer link are defined here.

    to the home node:   request (JSON), then  A|R|J + ids (ack, requeue, reject),  X (cancel)
                        and, for a no-ack consumer,  W + count (handed to a writable client)
    from the home node: O + JSON (consuming) | E + JSON (refused), then  D + delivery  and
                        C (the queue was deleted: the consumer is cancelled)

Several frames travel in one transport message (`pack_frames`).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

from pamqp import commands, decode, encode

from ...core.edge import Action, Principal
from ...core.message import Message
from ...core.subscriptions import Subscription
from .errors import ChannelException, ConnectionException, ReplyCode
from .frames import method_ids
from .properties import NATIVE_FORMAT, encoded_properties
from .queues import Queue, QueueConsumer, QueueEntry

if TYPE_CHECKING:
    from .service import AmqpService
    from .vhost import VirtualHost

log = logging.getLogger(__name__)

ACK, REQUEUE, REJECT, CANCEL, HANDED = b"A", b"R", b"J", b"X", b"W"
CONSUMING, REFUSED, DELIVERY, DELETED = b"O", b"E", b"D", b"C"
_DELIVERY = struct.Struct(">QBHI")
# Deliveries a home node has handed to a link and the transport has not written yet.
MAX_IN_FLIGHT = 512


class ConsumerLink(Protocol):
    """One consumer's link to a queue's home node (the cluster's transport)."""

    def send(self, frame: bytes) -> None: ...

    def close(self) -> None: ...


class QueueDirectory(Protocol):
    """What the cluster tells a virtual host about queues on other nodes."""

    def home(self, vhost: str, queue: str) -> str | None:
        """The node a shared queue lives on when it is not this one, else None."""

    def live(self, node: str) -> bool: ...

    def lookup(self, vhost: str, queue: str) -> asyncio.Future[str | None]:
        """`home`, asked of the cluster's store itself (this node's view may lag behind)."""

    def claim(self, vhost: str, queue: str, durable: bool) -> asyncio.Future[str | None]:
        """Record this node as the home of a queue just declared here; the answer is the
        node that recorded it first when that is another one (this declare then gives way)."""

    def call(self, node: str, request: dict[str, Any]) -> asyncio.Future[dict[str, Any]]:
        """Run `request` (a `QueueHost.handle` request) on `node`."""

    def consume(self, node: str, request: dict[str, Any],
                receive: Callable[[bytes], None]) -> ConsumerLink:
        """Open a consumer link; `receive` gets each frame from the home node, and b"" when
        the link is gone."""


class ExchangeDirectory(Protocol):
    """What the cluster does for a virtual host's exchanges, which every node shares."""

    def create(self, vhost: VirtualHost, name: str, definition: dict[str, Any]) -> asyncio.Future[None]:
        """Record the exchange `name` in the cluster unless it is there already; when done,
        the virtual host has the cluster's exchange of that name (this one or an earlier)."""

    def lookup(self, vhost: VirtualHost, names: list[str]) -> asyncio.Future[None]:
        """Bring those of `names` the cluster knows (and this node's view does not yet) into
        the virtual host."""

    def in_use_elsewhere(self, vhost: VirtualHost, name: str) -> asyncio.Future[bool]:
        """Whether a queue of another node is bound to the exchange `name`."""

    def auto_delete(self, vhost: VirtualHost, name: str) -> None:
        """The auto-delete exchange `name` is unused here: delete it (`vhost.auto_delete`)
        once no other node's queue is bound to it."""

    def deleted(self, vhost: VirtualHost, name: str) -> asyncio.Future[None]:
        """Done once the deletion of the exchange `name`, just made here, is committed in the
        cluster and every other live node has applied it (bounded), so that a client told
        delete-ok finds it gone on any node."""


def is_shared(queue: Queue) -> bool:
    """A queue every node of a cluster may use: neither exclusive nor auto-delete (those
    belong to one connection, and stay on its node)."""
    return queue.exclusive_owner is None and not queue.auto_delete and not isinstance(queue, RemoteQueue)


def home_down(node: str, vhost: str, queue: str, method: type[commands.base.Frame]) -> ChannelException:
    return ChannelException(
        ReplyCode.NOT_FOUND,
        f"home node '{node}' of durable queue '{queue}' in vhost '{vhost}' is down or inaccessible",
        *method_ids(method),
    )


def refusal(reply: dict[str, Any], method: type[commands.base.Frame]) -> AmqpFailure | None:
    """The exception a home node's answer carries, if any."""
    error = reply.get("error")
    if error is None:
        return None
    code, text, hard = int(error[0]), str(error[1]), bool(error[2]) if len(error) > 2 else False
    kind = ConnectionException if hard else ChannelException
    return kind(ReplyCode(code), text, *method_ids(method))


AmqpFailure = ChannelException | ConnectionException


def encode_table(table: dict[str, Any] | None) -> str:
    """An AMQP field table for a JSON request (its values keep their AMQP types; a byte array,
    which pamqp cannot encode, travels as a long string)."""
    if not table:
        return ""
    try:
        raw = encode.field_table(table)
    except (TypeError, ValueError):
        raw = encode.field_table(_encodable(table))
    return base64.b64encode(raw).decode()


def _encodable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("latin-1")
    if isinstance(value, dict):
        return {key: _encodable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_encodable(item) for item in value]
    return value


def decode_table(text: str) -> dict[str, Any]:
    if not text:
        return {}
    return cast(dict[str, Any], decode.field_table(base64.b64decode(text))[1])


def encode_delivery(delivery_id: int, entry: QueueEntry) -> bytes:
    message = entry.message
    topic = message.topic.encode()
    properties = encoded_properties(message)
    return b"".join((
        DELIVERY, _DELIVERY.pack(delivery_id, entry.redelivered, len(topic), len(properties)),
        topic, properties, message.payload,
    ))


def decode_delivery(frame: bytes | memoryview) -> tuple[int, bool, Message]:
    view = memoryview(frame)
    delivery_id, redelivered, topic_size, properties_size = _DELIVERY.unpack_from(view, 1)
    position = 1 + _DELIVERY.size
    topic = bytes(view[position:position + topic_size]).decode()
    position += topic_size
    properties = bytes(view[position:position + properties_size])
    position += properties_size
    message = Message(topic, bytes(view[position:]), producer_protocol="amqp",
                      native_properties={NATIVE_FORMAT: properties})
    return delivery_id, bool(redelivered), message


_SIZE = struct.Struct(">I")


def pack_frames(frames: list[bytes]) -> bytes:
    """Frames of a consumer link in one transport message, each after its length."""
    return b"".join(_SIZE.pack(len(frame)) + frame for frame in frames)


def unpack_frames(data: bytes) -> list[bytes]:
    frames = []
    position = 0
    while position < len(data):
        (size,) = _SIZE.unpack_from(data, position)
        position += _SIZE.size
        frames.append(data[position:position + size])
        position += size
    return frames


def _ids(frame: bytes) -> list[int]:
    return list(struct.unpack(f">{(len(frame) - 1) // 8}Q", frame[1:]))


def _pack_ids(kind: bytes, ids: list[int]) -> bytes:
    return kind + struct.pack(f">{len(ids)}Q", *ids)


# ====================================================================== the client's node
class RemoteOrigin(Protocol):
    """Where a delivery of a remote queue came from: settles it there."""

    def settle(self, action: bytes, ids: list[int]) -> None: ...


class RemoteEntry(QueueEntry):
    """A message of a queue on another node, as this node hands it to a client."""

    __slots__ = ("origin", "remote_id")

    def __init__(self, message: Message, redelivered: bool, origin: RemoteOrigin | None,
                 remote_id: int) -> None:
        super().__init__(message, None, redelivered)
        self.origin = origin  # None: nothing to settle (no-ack)
        self.remote_id = remote_id


class RemoteQueue(Queue):
    """A queue of another node as this connection's channels see it: consumers and deliveries
    refer to it; settling a delivery goes to the home node (module docstring)."""

    def __init__(self, name: str, node: str) -> None:
        super().__init__(
            name, cast(Subscription, None), durable=True, exclusive_owner=None,
            auto_delete=False, arguments={}, dead_letter=lambda queue, entry, reason: None,
        )
        self.node = node
        self.proxies: dict[QueueConsumer, ConsumerProxy] = {}

    def __repr__(self) -> str:
        return f"RemoteQueue({self.name!r} on {self.node})"

    @property
    def available(self) -> bool:
        return False

    def settle(self, entry: QueueEntry) -> None:
        if isinstance(entry, RemoteEntry) and entry.origin is not None:
            entry.origin.settle(ACK, [entry.remote_id])

    def requeue(self, entries: Any) -> None:
        self._send_back(REQUEUE, entries)

    def reject(self, entry: QueueEntry) -> None:
        self._send_back(REJECT, [entry])

    def _send_back(self, action: bytes, entries: Any) -> None:
        by_origin: dict[int, tuple[RemoteOrigin, list[int]]] = {}
        for entry in entries:
            if isinstance(entry, RemoteEntry) and entry.origin is not None:
                by_origin.setdefault(id(entry.origin), (entry.origin, []))[1].append(entry.remote_id)
        for origin, ids in by_origin.values():
            origin.settle(action, ids)

    def add_remote_consumer(self, consumer: QueueConsumer, proxy: ConsumerProxy) -> None:
        self.consumers.append(consumer)
        self.proxies[consumer] = proxy

    def remove_consumer(self, consumer: QueueConsumer) -> None:
        super().remove_consumer(consumer)
        proxy = self.proxies.pop(consumer, None)
        if proxy is not None:
            proxy.cancel()

    def dispatch(self) -> None:
        """Deliveries come from the home node as its consumers have room; a client that can
        take more lets its no-ack consumers' home nodes know."""
        for proxy in list(self.proxies.values()):
            if proxy.handed:
                proxy.report()

    def expire(self, at_ms: int | None = None) -> None:
        """The home node expires messages."""


class ConsumerProxy:
    """This node's end of one consumer link: hands the home node's deliveries to the client's
    channel and sends its settlements back."""

    def __init__(self, queue: RemoteQueue, consumer: QueueConsumer,
                 on_answer: Callable[[dict[str, Any]], None],
                 on_gone: Callable[[RemoteQueue], None]) -> None:
        self.queue = queue
        self.consumer = consumer
        self.link: ConsumerLink | None = None
        self.on_answer: Callable[[dict[str, Any]], None] | None = on_answer
        self.on_gone = on_gone
        self.outstanding = 0  # delivered here, not settled yet
        # no-ack deliveries handed to the client since the home node was last told (its window
        # for a no-ack consumer moves only while the client's connection takes them)
        self.handed = 0
        self._reporting = False
        self.cancelled = False
        self.closed = False

    def receive(self, frame: bytes) -> None:
        kind = frame[:1]
        if kind == DELIVERY:
            delivery_id, redelivered, message = decode_delivery(frame)
            consumer = self.consumer
            if self.cancelled or self.closed:
                if not consumer.no_ack and self.link is not None and not self.closed:
                    self.link.send(_pack_ids(REQUEUE, [delivery_id]))
                return
            origin = None if consumer.no_ack else self
            if origin is not None:
                self.outstanding += 1
            channel: Any = consumer.channel
            channel.deliver(consumer, self.queue, RemoteEntry(message, redelivered, origin, delivery_id))
            if consumer.no_ack:
                self.handed += 1
                if not self._reporting:
                    self._reporting = True
                    channel.connection.service.scheduler.call_soon(self.report)
            return
        if kind in (CONSUMING, REFUSED):
            answer, self.on_answer = self.on_answer, None
            reply = json.loads(frame[1:]) if kind == CONSUMING else {"error": json.loads(frame[1:])}
            if answer is not None:
                answer(reply)
            return
        # the queue was deleted there, or the link broke (b""): the consumer is gone
        if self.closed and self.on_answer is None:
            return
        self.closed = True
        answer, self.on_answer = self.on_answer, None
        if answer is not None:
            answer({"gone": True})
        else:
            self.on_gone(self.queue)

    def report(self) -> None:
        """Tell the home node how many no-ack deliveries the client's connection took, once
        it can take more (else `RemoteQueue.dispatch` reports when it drains)."""
        self._reporting = False
        if not self.handed or self.closed or self.link is None:
            return
        channel: Any = self.consumer.channel
        if not channel.connection.writable:
            channel.connection.stalled = True  # woken (dispatch) when the client reads again
            return
        self.link.send(HANDED + struct.pack(">Q", self.handed))
        self.handed = 0

    def settle(self, action: bytes, ids: list[int]) -> None:
        if self.closed or self.link is None:
            return
        self.outstanding -= len(ids)
        self.link.send(_pack_ids(action, ids))
        self._close_when_done()

    def cancel(self) -> None:
        """basic.cancel, or the channel closed: no more deliveries; the link stays until the
        client has settled (or given back) what it holds."""
        if self.cancelled or self.closed:
            return
        self.cancelled = True
        if self.link is not None:
            self.link.send(CANCEL)
        self._close_when_done()

    def close(self) -> None:
        self.closed = True
        if self.link is not None:
            self.link.close()

    def _close_when_done(self) -> None:
        if self.cancelled and self.outstanding <= 0 and not self.closed:
            self.close()


class GetOrigin:
    """Messages taken with basic.get from a queue on another node: settled by a call."""

    def __init__(self, directory: QueueDirectory, node: str, vhost: str, queue: str) -> None:
        self.directory = directory
        self.node = node
        self.vhost = vhost
        self.queue = queue

    def settle(self, action: bytes, ids: list[int]) -> None:
        future = self.directory.call(self.node, {
            "op": "settle", "vhost": self.vhost, "queue": self.queue, "action": action.decode(),
            "ids": ids,
        })
        future.add_done_callback(_log_failure)


def _log_failure(future: asyncio.Future[dict[str, Any]]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("AMQP: settling a basic.get on another node failed: %s", future.exception())


# ====================================================================== the home node
class HostedConsumer:
    """A consumer on another node as its queue's home node sees it: a `ConsumerChannel` whose
    deliveries go over the link (`send`), settled by what comes back (`receive`)."""

    def __init__(self, host: QueueHost, vhost: VirtualHost, queue: Queue, request: dict[str, Any],
                 send: Callable[[bytes], None]) -> None:
        self.host = host
        self.vhost = vhost
        self.queue = queue
        self.send = send
        self.user = request.get("user")  # whose consumer it is (its read access is checked)
        prefetch = int(request.get("prefetch") or 0)
        self.consumer = QueueConsumer(
            self, str(request.get("tag", "")), queue, bool(request.get("no_ack")),
            bool(request.get("exclusive")), prefetch, int(request.get("priority") or 0),
        )
        self.held: dict[int, QueueEntry] = {}
        self.in_flight = 0
        self.closed = False
        self._ids = itertools.count(1)

    # ------------------------------------------------------------ ConsumerChannel
    def can_deliver(self, consumer: QueueConsumer) -> bool:
        # in flight: not yet written by the transport (ack mode, where the prefetch bounds the
        # rest), or not yet taken by the client's connection (no-ack, told by W frames)
        if self.closed or self.in_flight >= MAX_IN_FLIGHT:
            return False
        return consumer.no_ack or not consumer.prefetch or consumer.unacked < consumer.prefetch

    def deliver(self, consumer: QueueConsumer, queue: Queue, entry: QueueEntry) -> None:
        delivery_id = next(self._ids)
        if consumer.no_ack:
            queue.settle(entry)
        else:
            self.held[delivery_id] = entry
            consumer.unacked += 1
        self.in_flight += 1
        self.send(encode_delivery(delivery_id, entry))

    def written(self, count: int) -> None:
        """The transport wrote `count` deliveries: there may be room for more."""
        if not self.consumer.no_ack:
            self._room(count)

    def _room(self, count: int) -> None:
        was = self.in_flight
        self.in_flight = was - count
        if was >= MAX_IN_FLIGHT and not self.closed:
            self.queue.dispatch()

    # ------------------------------------------------------------ from the consumer's node
    def receive(self, frame: bytes) -> None:
        if self.closed or not frame:
            return
        kind = frame[:1]
        queue, consumer = self.queue, self.consumer
        if kind == CANCEL:
            queue.remove_consumer(consumer)
            return
        if kind == HANDED:
            self._room(struct.unpack_from(">Q", frame, 1)[0])
            return
        held = self.held
        entries = [entry for entry in (held.pop(i, None) for i in _ids(frame)) if entry is not None]
        consumer.unacked -= len(entries)
        if kind == ACK:
            for entry in entries:
                queue.settle(entry)
            queue.dispatch()
        elif kind == REQUEUE:
            queue.requeue(entries)
        elif kind == REJECT:
            for entry in entries:
                queue.reject(entry)
            queue.dispatch()

    def close(self) -> None:
        """The link ended: what the consumer held goes back to the queue."""
        if self.closed:
            return
        self.closed = True
        self.host.consumers.discard(self)
        queue = self.queue
        queue.remove_consumer(self.consumer)
        entries = list(self.held.values())
        self.held.clear()
        self.consumer.unacked = 0
        if entries:
            queue.requeue(entries)
        else:
            queue.dispatch()


class QueueHost:
    """The home node's side: runs on its queues what clients of other nodes ask."""

    def __init__(self, service: AmqpService) -> None:
        self.service = service
        # The owner other nodes' callers act as: not any local connection, so exclusive
        # queues stay their connection's.
        self.peer = object()
        self.consumers: set[HostedConsumer] = set()
        self._gets: dict[int, tuple[str, Queue, QueueEntry]] = {}
        self._get_ids = itertools.count(1)
        for vhost in service.vhosts.values():
            vhost.on_queue_deleted.append(self._queue_deleted)
        service.on_reauthorize.append(self.reauthorize)

    def _vhost(self, request: dict[str, Any], method: type[commands.base.Frame]) -> VirtualHost:
        vhost = self.service.vhosts.get(str(request.get("vhost")))
        if vhost is None:
            raise ChannelException(ReplyCode.NOT_FOUND, f"no vhost '{request.get('vhost')}'",
                                   *method_ids(method))
        return vhost

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run one request; the answer holds the reply's fields, or `error`."""
        try:
            return self._handle(request)
        except ChannelException as exc:
            return {"error": [int(exc.code), exc.text, False]}
        except ConnectionException as exc:
            return {"error": [int(exc.code), exc.text, True]}

    def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        name = str(request.get("queue", ""))
        if op == "declare":
            frame = commands.Queue.Declare(
                queue=name, passive=bool(request.get("passive")), durable=bool(request.get("durable")),
                exclusive=bool(request.get("exclusive")), auto_delete=bool(request.get("auto_delete")),
                arguments=decode_table(str(request.get("arguments", ""))),
            )
            vhost = self._vhost(request, commands.Queue.Declare)
            if name not in vhost.queues and (frame.exclusive or frame.auto_delete) and not frame.passive:
                return {"absent": True}  # a connection's own queue is made on its node
            user = request.get("user")
            queue, new = vhost.declare_queue(frame, self.peer, None if user is None else str(user))
            queue.expire()
            return {"queue": queue.name, "messages": len(queue.messages),
                    "consumers": len(queue.consumers), "new": new}
        if op == "bind" or op == "unbind":
            method = commands.Queue.Bind if op == "bind" else commands.Queue.Unbind
            vhost = self._vhost(request, method)
            arguments = decode_table(str(request.get("arguments", "")))
            exchange, routing_key = str(request.get("exchange", "")), str(request.get("routing_key", ""))
            if op == "unbind" and name not in vhost.queues:
                return {}
            queue = vhost.queue(name, self.peer, method)
            if op == "bind":
                vhost.bind(queue, exchange, routing_key, arguments, method)
            else:
                vhost.unbind(queue, exchange, routing_key, arguments, method)
            return {}
        if op == "purge":
            vhost = self._vhost(request, commands.Queue.Purge)
            return {"messages": vhost.queue(name, self.peer, commands.Queue.Purge).purge()}
        if op == "delete":
            vhost = self._vhost(request, commands.Queue.Delete)
            return {"messages": vhost.delete_checked(
                name, self.peer, bool(request.get("if_unused")), bool(request.get("if_empty")))}
        if op == "exchange_in_use":
            vhost = self._vhost(request, commands.Exchange.Delete)
            known = vhost.exchanges.get(str(request.get("exchange", "")))
            return {"in_use": bool(known is not None and known.bound)}
        if op == "get":
            return self._get(request)
        if op == "settle":
            self._settle(str(request.get("action", "")).encode(), [int(i) for i in request.get("ids", [])])
            return {}
        raise ChannelException(ReplyCode.COMMAND_INVALID, f"unknown queue operation {op!r}")

    def _unreadable(self, queue: Queue, user: Any) -> str | None:
        """The filter of a binding of `queue` the user of a request (a consumer's on another
        node) may not subscribe to, as `Queue.unreadable`; None when it may read the queue."""
        edge = self.service.edge
        if edge.authorizer is None:
            return None
        principal = Principal("amqp", None if user is None else str(user), "", "cluster")
        return queue.unreadable(
            lambda topic_filter: edge.authorize(principal, Action.SUBSCRIBE, topic_filter))

    def _check_read(self, queue: Queue, vhost: VirtualHost, request: dict[str, Any],
                    method: type[commands.base.Frame]) -> None:
        """basic.consume / basic.get from another node: 403 ACCESS_REFUSED, as on this node,
        when the requesting user may not read what `queue`'s bindings bring."""
        denied = self._unreadable(queue, request.get("user"))
        if denied is not None:
            raise ChannelException(
                ReplyCode.ACCESS_REFUSED,
                f"read access to queue '{queue.name}' in vhost '{vhost.name}' refused for user "
                f"'{request.get('user') or ''}' (a binding brings {denied!r})", *method_ids(method))

    def reauthorize(self) -> int:
        """The users or the ACL rules changed: a consumer of another node whose user may no
        longer read its queue here ends, as for a deleted queue (its node sends basic.cancel);
        what it held goes back to the queue. Returns how many ended."""
        ended = 0
        for hosted in list(self.consumers):
            denied = self._unreadable(hosted.queue, hosted.user)
            if denied is None:
                continue
            log.info("consumer of queue %r for user %r on another node ended: it may no longer "
                     "read %r", hosted.queue.name, hosted.user, denied)
            hosted.send(DELETED)
            hosted.close()
            ended += 1
        return ended

    def _get(self, request: dict[str, Any]) -> dict[str, Any]:
        vhost = self._vhost(request, commands.Basic.Get)
        queue = vhost.queue(str(request.get("queue", "")), self.peer, commands.Basic.Get)
        self._check_read(queue, vhost, request, commands.Basic.Get)
        entry = queue.take()
        if entry is None:
            return {"empty": True}
        get_id = next(self._get_ids)
        if request.get("no_ack"):
            queue.settle(entry)
        else:
            self._gets[get_id] = (str(request.get("node", "")), queue, entry)
        return {"count": len(queue.messages),
                "delivery": base64.b64encode(encode_delivery(get_id, entry)).decode()}

    def _settle(self, action: bytes, ids: list[int]) -> None:
        for get_id in ids:
            held = self._gets.pop(get_id, None)
            if held is None:
                continue
            _, queue, entry = held
            if action == ACK:
                queue.settle(entry)
            elif action == REQUEUE:
                queue.requeue([entry])
            elif action == REJECT:
                queue.reject(entry)

    def node_gone(self, node: str) -> None:
        """A node left the cluster: what its clients took with basic.get goes back."""
        for get_id in [i for i, (owner, _, _) in self._gets.items() if owner == node]:
            self._settle(REQUEUE, [get_id])

    def consume(self, request: dict[str, Any], send: Callable[[bytes], None]) -> HostedConsumer | bytes:
        """Register a consumer for another node; returns it, or the refusal frame to send."""
        method = commands.Basic.Consume
        try:
            vhost = self._vhost(request, method)
            name = str(request.get("queue", ""))
            queue = vhost.queue(name, self.peer, method)
            self._check_read(queue, vhost, request, method)
            if queue.consumers and (request.get("exclusive") or any(c.exclusive for c in queue.consumers)):
                raise ChannelException(
                    ReplyCode.ACCESS_REFUSED, f"queue '{name}' in vhost '{vhost.name}' in exclusive use",
                    *method_ids(method),
                )
        except ChannelException as exc:
            return REFUSED + json.dumps([int(exc.code), exc.text, False]).encode()
        hosted = HostedConsumer(self, vhost, queue, request, send)
        self.consumers.add(hosted)
        send(CONSUMING + b"{}")
        queue.add_consumer(hosted.consumer)
        queue.dispatch()
        return hosted

    def _queue_deleted(self, queue: Queue) -> None:
        for hosted in [h for h in self.consumers if h.queue is queue]:
            hosted.closed = True
            hosted.held.clear()
            self.consumers.discard(hosted)
            hosted.send(DELETED)
