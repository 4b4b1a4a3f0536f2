"""The home node's side of its queues used from other nodes: `QueueHost` runs what a client
of another node asks (declare, bind, unbind, purge, delete, basic.get, settlements) on the real
queue and answers with the reply's fields or the channel exception to raise; a
`HostedConsumer` is a consumer of another node registered on the queue like a local one, its
deliveries sent over the link and settled by what comes back.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pamqp import commands

from ...core.edge import Action, Principal
from .errors import ChannelException, ConnectionException, ReplyCode
from .frames import method_ids
from .queues import Queue, QueueConsumer, QueueEntry
from .remote_frames import (
    ACK,
    CANCEL,
    CONSUMING,
    DELETED,
    HANDED,
    MAX_IN_FLIGHT,
    REFUSED,
    REJECT,
    REQUEUE,
    decode_table,
    encode_delivery,
    frame_ids,
)

if TYPE_CHECKING:
    from .service import AmqpService
    from .vhost import VirtualHost

# The remote queues' logger, as before this part had a module of its own.
log = logging.getLogger("shardgate.protocols.amqp.remote")


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
        entries = [entry for entry in (held.pop(i, None) for i in frame_ids(frame)) if entry is not None]
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
        if not edge.secured:
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
