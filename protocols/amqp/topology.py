"""Exchanges and queues (classes exchange and queue): declare, bind, unbind, purge, delete,
with RabbitMQ's checks (exclusive access, if-unused, if-empty), exchange-to-exchange bindings,
the direct reply-to pseudo-queue, and consumers cancelled when their queue is deleted."""

from __future__ import annotations

from collections.abc import Callable

from pamqp import commands

from ...core.edge import Action
from .base import ConnectionBase
from .channel import REPLY_TO, AmqpChannel
from .errors import ChannelException, ReplyCode
from .frames import method_ids
from .queues import Queue


class TopologyMixin(ConnectionBase):
    """exchange.* and queue.* methods."""

    def _may_bind(self) -> Callable[[str], bool] | None:
        """The front door's check of a binding's core filter (a subscribe), or None when
        nothing is checked."""
        edge = self.service.edge
        if edge.authorizer is None:
            return None
        principal = self.principal

        def allowed(topic_filter: str) -> bool:
            return edge.authorize(principal, Action.SUBSCRIBE, topic_filter)

        return allowed

    def _exchange_declare(self, channel: AmqpChannel, frame: commands.Exchange.Declare) -> None:
        assert self.vhost is not None
        self.vhost.declare_exchange(frame)
        if not frame.nowait:
            self.send_method(channel.number, commands.Exchange.DeclareOk())

    def _exchange_bind(self, channel: AmqpChannel, frame: commands.Exchange.Bind) -> None:
        assert self.vhost is not None
        self.vhost.bind_exchange(
            frame.destination, frame.source, frame.routing_key, frame.arguments,
            commands.Exchange.Bind, self._may_bind(),
        )
        if not frame.nowait:
            self.send_method(channel.number, commands.Exchange.BindOk())

    def _exchange_unbind(self, channel: AmqpChannel, frame: commands.Exchange.Unbind) -> None:
        assert self.vhost is not None
        self.vhost.unbind_exchange(
            frame.destination, frame.source, frame.routing_key, frame.arguments,
            commands.Exchange.Unbind,
        )
        if not frame.nowait:
            self.send_method(channel.number, commands.Exchange.UnbindOk())

    def _exchange_delete(self, channel: AmqpChannel, frame: commands.Exchange.Delete) -> None:
        assert self.vhost is not None
        self.vhost.delete_exchange(frame.exchange, frame.if_unused)
        if not frame.nowait:
            self.send_method(channel.number, commands.Exchange.DeleteOk())

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
                self.send_method(channel.number, commands.Queue.DeclareOk(REPLY_TO, 0, 1))
            return
        queue, _ = self.vhost.declare_queue(frame, self)
        channel.last_queue = queue.name
        if not frame.nowait:
            queue.expire()
            self.send_method(channel.number, commands.Queue.DeclareOk(
                queue.name, len(queue.messages), len(queue.consumers)
            ))

    def _queue_bind(self, channel: AmqpChannel, frame: commands.Queue.Bind) -> None:
        assert self.vhost is not None
        name = self._queue_name(channel, frame.queue, commands.Queue.Bind)
        queue = self.vhost.queue(name, self, commands.Queue.Bind)
        allowed = self._may_bind()
        self.vhost.bind(
            queue, frame.exchange, frame.routing_key, frame.arguments, commands.Queue.Bind, allowed
        )
        if not frame.nowait:
            self.send_method(channel.number, commands.Queue.BindOk())

    def _queue_unbind(self, channel: AmqpChannel, frame: commands.Queue.Unbind) -> None:
        assert self.vhost is not None
        name = self._queue_name(channel, frame.queue, commands.Queue.Unbind)
        if name not in self.vhost.queues:
            # RabbitMQ 3.x: unbinding a missing queue succeeds (as a missing exchange does).
            self.send_method(channel.number, commands.Queue.UnbindOk())
            return
        queue = self.vhost.queue(name, self, commands.Queue.Unbind)
        self.vhost.unbind(queue, frame.exchange, frame.routing_key, frame.arguments, commands.Queue.Unbind)
        self.send_method(channel.number, commands.Queue.UnbindOk())

    def _queue_purge(self, channel: AmqpChannel, frame: commands.Queue.Purge) -> None:
        assert self.vhost is not None
        name = self._queue_name(channel, frame.queue, commands.Queue.Purge)
        queue = self.vhost.queue(name, self, commands.Queue.Purge)
        count = queue.purge()
        if not frame.nowait:
            self.send_method(channel.number, commands.Queue.PurgeOk(count))

    def _queue_delete(self, channel: AmqpChannel, frame: commands.Queue.Delete) -> None:
        assert self.vhost is not None
        method = commands.Queue.Delete
        name = self._queue_name(channel, frame.queue, method)
        queue = self.vhost.queues.get(name)
        count = 0
        if queue is not None:
            self.vhost.check_access(queue, self, method)
            if frame.if_unused and queue.consumers:
                raise ChannelException(
                    ReplyCode.PRECONDITION_FAILED, f"queue '{name}' in vhost '{self.vhost.name}' in use",
                    *method_ids(method),
                )
            if frame.if_empty and queue.messages:
                raise ChannelException(
                    ReplyCode.PRECONDITION_FAILED,
                    f"queue '{name}' in vhost '{self.vhost.name}' not empty", *method_ids(method),
                )
            count = self.vhost.delete_queue(queue)
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
