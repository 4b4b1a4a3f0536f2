"""Exchanges and queues (classes exchange and queue): declare, bind, unbind, purge, delete,
with RabbitMQ's checks (exclusive access, if-unused, if-empty), exchange-to-exchange bindings,
the direct reply-to pseudo-queue, and consumers cancelled when their queue is deleted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pamqp import commands

from ...core.edge import Action
from .base import ConnectionBase
from .channel import REPLY_TO, AmqpChannel
from .errors import ChannelException, ReplyCode
from .frames import method_ids, unchecked
from .queues import Queue
from .remote import RemoteQueue, encode_table, home_down, is_shared, refusal
from .routing import AMQ_TOPIC, binding_for, header_value, publish_topic
from .vhost import EXCHANGE_TYPES, PREDECLARED


class TopologyMixin(ConnectionBase):
    """exchange.* and queue.* methods."""

    def _may_bind(self) -> Callable[[str], bool]:
        """The front door's check of a binding's core filter (a subscribe): made even on an
        open broker, which still refuses the broker's own `$internal/` topics."""
        edge = self.service.edge
        principal = self.principal

        def allowed(topic_filter: str) -> bool:
            return edge.authorize(principal, Action.SUBSCRIBE, topic_filter)

        return allowed

    def _check_write(self, target: Any, routing_key: Any,
                     method: type[commands.base.Frame]) -> None:
        """The declaring user's right to write to `target`, a dead-letter or alternate
        exchange, as RabbitMQ checks it at declare (403 ACCESS_REFUSED): the publish ACL on
        the topic a message sent there with `routing_key` goes to (with no key: the exchange's
        topic of the empty key; `amq.topic` without a key is checked per message instead)."""
        edge = self.service.edge
        vhost = self.vhost
        if not edge.secured or target is None or vhost is None:
            return
        name = header_value(target)
        exchange = vhost.exchanges.get(name)
        kind = exchange.type if exchange is not None else PREDECLARED.get(name, "direct")
        if routing_key is None and name == AMQ_TOPIC:
            return
        topic = publish_topic(name, kind, "" if routing_key is None else header_value(routing_key))
        if not edge.authorize(self.principal, Action.PUBLISH, topic):
            raise ChannelException(
                ReplyCode.ACCESS_REFUSED,
                f"write access to exchange '{name}' in vhost '{vhost.name}' refused for user "
                f"'{self.username}'", *method_ids(method),
            )

    def _reply_when_routed(self, channel: AmqpChannel, reply: commands.base.Frame) -> None:
        """Send `reply` once the cluster's other nodes know this node's routes as they are
        now (bounded, as a SUBACK waits), so a publish on another node right after it reaches
        the queue; at once on a single node or when nothing changed."""
        ready = self.service.edge.routes_ready()
        if ready is None:
            self.send_method(channel.number, reply)
        else:
            self.hold_until(channel, ready, lambda _: self.send_method(channel.number, reply))

    def _when_replicated(self, channel: AmqpChannel, queue: Queue, then: Callable[[], None]) -> None:
        """Run `then()` (which sends a reply) once the cluster holds `queue`'s state as it is
        now, when it is a durable queue of a cluster (its state replicated: a node that takes
        it over after this reply starts from there, with every acknowledgement read before);
        at once otherwise."""
        vhost = self.vhost
        directory = vhost.directory if vhost is not None else None
        replicated = None
        if directory is not None and vhost is not None and queue.durable and is_shared(queue):
            replicated = directory.replicated(vhost.name, queue.name)
        if replicated is None:
            then()
        else:
            self.hold_until(channel, replicated, lambda _: then())

    # ------------------------------------------------------------ exchanges (cluster-wide)
    def _knowing(self, channel: AmqpChannel, names: list[str], then: Callable[[], None]) -> None:
        """Run `then()` once this node knows every exchange of `names` the cluster has: at
        once on a single node or when it knows them all, else after asking the cluster's store
        for the others (declared on another node an instant ago)."""
        vhost = self.vhost
        assert vhost is not None
        directory = vhost.exchange_directory
        missing = [name for name in names if name and name not in vhost.exchanges]
        if directory is None or not missing:
            then()
            return
        self.hold_until(channel, directory.lookup(vhost, missing), lambda _: then())

    def _exchange_declare(self, channel: AmqpChannel, frame: commands.Exchange.Declare) -> None:
        vhost = self.vhost
        assert vhost is not None
        directory = vhost.exchange_directory

        def declare() -> None:
            vhost.declare_exchange(frame)
            if not frame.nowait:
                self.send_method(channel.number, commands.Exchange.DeclareOk())

        name = frame.exchange
        if not frame.passive and frame.arguments:
            self._check_write(frame.arguments.get("alternate-exchange"), None,
                              commands.Exchange.Declare)
        if directory is None or not name or name in vhost.exchanges or name.startswith("amq."):
            declare()
        elif frame.passive:
            self._knowing(channel, [name], declare)
        elif frame.exchange_type not in EXCHANGE_TYPES:
            declare()  # refused as on a single node
        else:
            # Recorded in the cluster first (create-if-absent): a twin declared on another
            # node meanwhile is found there, and this declare is checked against it (406).
            definition = {
                "type": frame.exchange_type, "durable": bool(frame.durable),
                "auto_delete": bool(frame.auto_delete), "internal": bool(frame.internal),
                "arguments": dict(frame.arguments or {}),
            }
            self.hold_until(channel, directory.create(vhost, name, definition), lambda _: declare())

    def _exchange_bind(self, channel: AmqpChannel, frame: commands.Exchange.Bind) -> None:
        assert self.vhost is not None
        vhost = self.vhost

        def bind() -> None:
            vhost.bind_exchange(
                frame.destination, frame.source, frame.routing_key, frame.arguments,
                commands.Exchange.Bind, self._may_bind(),
            )
            if not frame.nowait:
                self._reply_when_routed(channel, commands.Exchange.BindOk())

        self._knowing(channel, [frame.destination, frame.source], bind)

    def _exchange_unbind(self, channel: AmqpChannel, frame: commands.Exchange.Unbind) -> None:
        assert self.vhost is not None
        self.vhost.unbind_exchange(
            frame.destination, frame.source, frame.routing_key, frame.arguments,
            commands.Exchange.Unbind,
        )
        if not frame.nowait:
            self.send_method(channel.number, commands.Exchange.UnbindOk())

    def _exchange_delete(self, channel: AmqpChannel, frame: commands.Exchange.Delete) -> None:
        vhost = self.vhost
        assert vhost is not None
        directory = vhost.exchange_directory

        def delete() -> None:
            known = frame.exchange in vhost.exchanges
            vhost.delete_exchange(frame.exchange, frame.if_unused)
            if frame.nowait:
                return
            if directory is None or not known:
                self.send_method(channel.number, commands.Exchange.DeleteOk())
                return
            # delete-ok once every node has it gone, as RabbitMQ's cluster-wide delete: a
            # declare or publish on another node right after it sees no old exchange
            self.hold_until(channel, directory.deleted(vhost, frame.exchange),
                            lambda _: self.send_method(channel.number, commands.Exchange.DeleteOk()))

        exchange = vhost.exchanges.get(frame.exchange)
        if (directory is None or not frame.if_unused or exchange is None
                or frame.exchange in PREDECLARED or exchange.bound):
            self._knowing(channel, [frame.exchange], delete)
            return

        # if-unused: the queues bound to it may be other nodes' (RabbitMQ's 406 "in use")
        def asked(done: asyncio.Future[bool]) -> None:
            if not done.cancelled() and done.exception() is None and done.result():
                raise ChannelException(
                    ReplyCode.PRECONDITION_FAILED,
                    f"exchange '{frame.exchange}' in vhost '{vhost.name}' in use",
                    *method_ids(commands.Exchange.Delete))
            delete()

        self.hold_until(channel, directory.in_use_elsewhere(vhost, frame.exchange), asked)

    # ------------------------------------------------------------ queues of other nodes
    def _at_home(
        self, channel: AmqpChannel, name: str, here: Callable[[], None],
        there: Callable[[str], None],
    ) -> None:
        """Run `here()` when the queue `name` is on this node (or on none), else `there(node)`
        with the node it lives on. In a cluster, a name this node's view of etcd does not know
        is looked up in etcd first (a queue declared elsewhere an instant ago)."""
        vhost = self.vhost
        assert vhost is not None
        directory = vhost.directory
        if directory is None or not name or name in vhost.queues or name == REPLY_TO:
            here()
            return
        node = directory.home(vhost.name, name)
        if node is not None:
            there(node)
            return

        def found(done: asyncio.Future[str | None]) -> None:
            home = None if done.cancelled() or done.exception() is not None else done.result()
            if home is None or name in vhost.queues:
                here()
            else:
                there(home)

        self.hold_until(channel, directory.lookup(vhost.name, name), found)

    def _ask_home(
        self, channel: AmqpChannel, node: str, name: str, method: type[commands.base.Frame],
        request: dict[str, Any], reply_for: Callable[[dict[str, Any]], commands.base.Frame] | None,
        after: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """Run a queue operation on the queue's home node; the reply (`reply_for` its answer)
        goes out when it answers, and no later frame of this connection is read before."""
        vhost = self.vhost
        assert vhost is not None and vhost.directory is not None
        directory = vhost.directory
        if not directory.live(node):
            raise home_down(node, vhost.name, name, method)
        future = directory.call(node, {"vhost": vhost.name, "queue": name, **request})

        def answered(done: asyncio.Future[dict[str, Any]]) -> None:
            if done.cancelled() or done.exception() is not None:
                raise home_down(node, vhost.name, name, method)
            reply = done.result()
            failure = refusal(reply, method)
            if failure is not None:
                raise failure
            if after is not None:
                after(reply)
            if reply_for is not None:
                self.send_method(channel.number, reply_for(reply))

        self.hold_until(channel, future, answered)

    def _remote_queue(self, name: str, node: str) -> RemoteQueue:
        remote = self._remote_queues.get(name)
        if remote is None or remote.node != node:
            remote = self._remote_queues[name] = RemoteQueue(name, node)
        return remote

    def _queue_name(self, channel: AmqpChannel, name: str, method: type[commands.base.Frame]) -> str:
        if name:
            return name
        if not channel.last_queue:
            raise ChannelException(ReplyCode.NOT_FOUND, "no previously declared queue", *method_ids(method))
        return channel.last_queue

    def _queue_declare(self, channel: AmqpChannel, frame: commands.Queue.Declare) -> None:
        assert self.vhost is not None
        if frame.queue == REPLY_TO:
            # The pseudo-queue always "exists" (rabbit_channel declare_fast_reply_to).
            if not frame.nowait:
                self.send_method(channel.number, unchecked(commands.Queue.DeclareOk, REPLY_TO, 0, 1))
            return
        if not frame.passive and frame.arguments:
            self._check_write(frame.arguments.get("x-dead-letter-exchange"),
                              frame.arguments.get("x-dead-letter-routing-key"),
                              commands.Queue.Declare)
        self._at_home(channel, frame.queue, lambda: self._declare_here(channel, frame),
                      lambda node: self._declare_there(channel, frame, node))

    def _declare_there(self, channel: AmqpChannel, frame: commands.Queue.Declare, node: str) -> None:
        def declared(reply: dict[str, Any]) -> None:
            if reply.get("absent"):
                # the home no longer has it and this declare is for a connection's own
                # (exclusive or auto-delete) queue: it is made here (the record naming the
                # other node is on its way out)
                self._declare_here(channel, frame, claim=False)
                return
            channel.last_queue = str(reply["queue"])
            if not frame.nowait:
                self.send_method(channel.number, unchecked(commands.Queue.DeclareOk,
                    str(reply["queue"]), int(reply["messages"]), int(reply["consumers"])))

        self._ask_home(channel, node, frame.queue, commands.Queue.Declare, {
            "op": "declare", "passive": bool(frame.passive), "durable": bool(frame.durable),
            "exclusive": bool(frame.exclusive), "auto_delete": bool(frame.auto_delete),
            "arguments": encode_table(frame.arguments), "user": self.principal.username,
        }, None, declared)

    def _declare_here(self, channel: AmqpChannel, frame: commands.Queue.Declare, *,
                      claim: bool = True) -> None:
        vhost = self.vhost
        assert vhost is not None
        queue, new = vhost.declare_queue(frame, self, self.principal.username)
        channel.last_queue = queue.name
        reply = None
        if not frame.nowait:
            queue.expire()
            reply = unchecked(commands.Queue.DeclareOk, queue.name, len(queue.messages), len(queue.consumers))
        directory = vhost.directory
        if new and directory is not None and queue.exclusive_owner is not None and claim and not frame.queue:
            # A server-named exclusive queue: its name is new to the cluster, so it is
            # recorded (for 405 from other nodes) without holding the declare-ok.
            directory.claim(vhost.name, queue.name, False).add_done_callback(
                lambda done: done.cancelled() or done.exception())
            if reply is not None:
                self._reply_when_routed(channel, reply)
        elif new and directory is not None and claim and (is_shared(queue) or queue.exclusive_owner is not None):
            # Recorded in the cluster: an exclusive queue so that other nodes' connections
            # get RabbitMQ's 405 RESOURCE_LOCKED from it.
            # The queue's home is the node that records it in etcd first: a twin declared on
            # another node at the same instant gives way to it.
            def claimed(done: asyncio.Future[str | None]) -> None:
                home = None if done.cancelled() or done.exception() is not None else done.result()
                if home is not None and not queue.deleted:
                    vhost.delete_queue(queue)
                    self._declare_there(channel, frame, home)
                elif reply is not None:
                    self._when_replicated(channel, queue, lambda: self._reply_when_routed(channel, reply))
                else:
                    self._when_replicated(channel, queue, lambda: None)

            self.hold_until(channel, directory.claim(vhost.name, queue.name, queue.durable), claimed)
        elif reply is not None:
            if new:  # its default-exchange binding is a new route
                self._reply_when_routed(channel, reply)
            else:
                self._when_replicated(channel, queue, lambda: self.send_method(channel.number, reply))

    def _queue_bind(self, channel: AmqpChannel, frame: commands.Queue.Bind) -> None:
        name = self._queue_name(channel, frame.queue, commands.Queue.Bind)
        self._knowing(channel, [frame.exchange], lambda: self._at_home(
            channel, name, lambda: self._bind_here(channel, frame, name),
            lambda node: self._bind_there(channel, frame, name, node)))

    def _bind_here(self, channel: AmqpChannel, frame: commands.Queue.Bind, name: str) -> None:
        assert self.vhost is not None
        queue = self.vhost.queue(name, self, commands.Queue.Bind)
        self.vhost.bind(
            queue, frame.exchange, frame.routing_key, frame.arguments, commands.Queue.Bind,
            self._may_bind(),
        )
        if not frame.nowait:
            self._when_replicated(channel, queue,
                                  lambda: self._reply_when_routed(channel, commands.Queue.BindOk()))

    def _bind_there(self, channel: AmqpChannel, frame: commands.Queue.Bind, name: str, node: str) -> None:
        # The exchange and the authorizer's verdict are this node's; the binding is made on
        # the queue's node, which answers once its peers know the new route.
        assert self.vhost is not None
        method = commands.Queue.Bind
        exchange = self.vhost.exchange(frame.exchange, method)
        allowed = self._may_bind()
        if exchange.name:
            binding = binding_for(exchange.name, exchange.type, frame.routing_key, frame.arguments)
            if not allowed(binding.topic_filter):
                raise ChannelException(
                    ReplyCode.ACCESS_REFUSED,
                    f"access to exchange '{frame.exchange}' with binding key '{frame.routing_key}' "
                    "refused", *method_ids(method))
        self._ask_home(channel, node, name, method, {
            "op": "bind", "exchange": frame.exchange, "routing_key": frame.routing_key,
            "arguments": encode_table(frame.arguments),
        }, None if frame.nowait else lambda reply: commands.Queue.BindOk())

    def _queue_unbind(self, channel: AmqpChannel, frame: commands.Queue.Unbind) -> None:
        name = self._queue_name(channel, frame.queue, commands.Queue.Unbind)
        self._at_home(channel, name, lambda: self._unbind_here(channel, frame, name),
                      lambda node: self._ask_home(channel, node, name, commands.Queue.Unbind, {
                          "op": "unbind", "exchange": frame.exchange, "routing_key": frame.routing_key,
                          "arguments": encode_table(frame.arguments),
                      }, lambda reply: commands.Queue.UnbindOk()))

    def _unbind_here(self, channel: AmqpChannel, frame: commands.Queue.Unbind, name: str) -> None:
        assert self.vhost is not None
        if name not in self.vhost.queues:
            # RabbitMQ 3.x: unbinding a missing queue succeeds (as a missing exchange does).
            self.send_method(channel.number, commands.Queue.UnbindOk())
            return
        queue = self.vhost.queue(name, self, commands.Queue.Unbind)
        self.vhost.unbind(queue, frame.exchange, frame.routing_key, frame.arguments, commands.Queue.Unbind)
        self._when_replicated(channel, queue,
                              lambda: self.send_method(channel.number, commands.Queue.UnbindOk()))

    def _queue_purge(self, channel: AmqpChannel, frame: commands.Queue.Purge) -> None:
        name = self._queue_name(channel, frame.queue, commands.Queue.Purge)
        self._at_home(channel, name, lambda: self._purge_here(channel, frame, name),
                      lambda node: self._ask_home(
                          channel, node, name, commands.Queue.Purge, {"op": "purge"},
                          None if frame.nowait else lambda reply: commands.Queue.PurgeOk(int(reply["messages"]))))

    def _purge_here(self, channel: AmqpChannel, frame: commands.Queue.Purge, name: str) -> None:
        assert self.vhost is not None
        queue = self.vhost.queue(name, self, commands.Queue.Purge)
        count = queue.purge()
        if not frame.nowait:
            self._when_replicated(channel, queue,
                                  lambda: self.send_method(channel.number, commands.Queue.PurgeOk(count)))

    def _queue_delete(self, channel: AmqpChannel, frame: commands.Queue.Delete) -> None:
        name = self._queue_name(channel, frame.queue, commands.Queue.Delete)
        self._at_home(channel, name, lambda: self._delete_here(channel, frame, name),
                      lambda node: self._ask_home(channel, node, name, commands.Queue.Delete, {
                          "op": "delete", "if_unused": bool(frame.if_unused),
                          "if_empty": bool(frame.if_empty),
                      }, None if frame.nowait else lambda reply: commands.Queue.DeleteOk(int(reply["messages"]))))

    def _delete_here(self, channel: AmqpChannel, frame: commands.Queue.Delete, name: str) -> None:
        assert self.vhost is not None
        count = self.vhost.delete_checked(name, self, bool(frame.if_unused), bool(frame.if_empty))
        if not frame.nowait:
            self.send_method(channel.number, commands.Queue.DeleteOk(count))

    def queue_deleted(self, queue: Queue) -> None:
        """`queue` was deleted: drop our consumers on it (basic.cancel if the client wants it)."""
        notify = bool(self.capabilities.get("consumer_cancel_notify"))
        for channel in self.channels.values():
            for tag, consumer in list(channel.consumers.items()):
                if consumer.queue is queue:
                    del channel.consumers[tag]
                    if notify:
                        self.send_method(channel.number, commands.Basic.Cancel(tag, nowait=True))
            for delivery in list(channel.unacked.values()):
                if delivery.queue is queue and delivery.consumer is not None:
                    delivery.consumer.unacked -= 1
                    delivery.consumer = None
