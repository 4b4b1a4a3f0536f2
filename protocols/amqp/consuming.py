"""Consuming (class basic, the consumer side): qos, consume (with the direct reply-to
consumer), cancel, get, and settling deliveries with ack, nack, reject and recover."""

from __future__ import annotations

import secrets
from typing import Any

from pamqp import commands

from .base import ConnectionBase
from .channel import REPLY_TO, AmqpChannel, Delivery, route_names, route_of
from .errors import ChannelException, ConnectionException, ReplyCode
from .frames import method_ids
from .queues import Queue, QueueConsumer, QueueEntry


class ConsumingMixin(ConnectionBase):
    """basic.qos/consume/cancel/get/ack/nack/reject/recover."""

    def _basic_qos(self, channel: AmqpChannel, frame: commands.Basic.Qos) -> None:
        if frame.prefetch_size:
            # rabbit_channel: a byte window is not implemented, and says so with 540.
            raise ConnectionException(
                ReplyCode.NOT_IMPLEMENTED, f"prefetch_size!=0 ({frame.prefetch_size})", *method_ids(frame)
            )
        if frame.global_:
            channel.prefetch = frame.prefetch_count
        else:
            channel.consumer_prefetch = frame.prefetch_count
            # rabbit_channel handle_method basic.qos global=false also lifts the channel's
            # limit (rabbit_limiter:unlimit_prefetch/1).
            channel.prefetch = 0
        self.send_method(channel.number, commands.Basic.QosOk())
        self.wake_channel(channel)

    def _basic_consume(self, channel: AmqpChannel, frame: commands.Basic.Consume) -> None:
        assert self.vhost is not None
        method = commands.Basic.Consume
        if frame.queue == REPLY_TO:
            self._reply_consume(channel, frame)
            return
        name = self._queue_name(channel, frame.queue, method)
        queue = self.vhost.queue(name, self, method)
        tag = frame.consumer_tag or f"amq.ctag-{self._ctag_prefix}-{next(self._ctag)}"
        if tag in channel.consumers:
            raise ConnectionException(
                ReplyCode.NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'", *method_ids(method)
            )
        if queue.consumers and (frame.exclusive or any(c.exclusive for c in queue.consumers)):
            raise ChannelException(
                ReplyCode.ACCESS_REFUSED,
                f"queue '{name}' in vhost '{self.vhost.name}' in exclusive use", *method_ids(method),
            )
        priority = (frame.arguments or {}).get("x-priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            priority = 0
        consumer = QueueConsumer(
            channel, tag, queue, bool(frame.no_ack), bool(frame.exclusive),
            channel.consumer_prefetch, priority,
        )
        channel.consumers[tag] = consumer
        queue.add_consumer(consumer)
        if not frame.nowait:
            self.send_method(channel.number, commands.Basic.ConsumeOk(tag))
        self._wake_queues.add(queue)

    def _reply_consume(self, channel: AmqpChannel, frame: commands.Basic.Consume) -> None:
        method = commands.Basic.Consume
        if not frame.no_ack:
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED, "reply consumer cannot acknowledge", *method_ids(method)
            )
        if channel.reply_consumer:
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED, "reply consumer already set", *method_ids(method)
            )
        tag = frame.consumer_tag or f"amq.ctag-{self._ctag_prefix}-{next(self._ctag)}"
        if tag in channel.consumers:
            raise ConnectionException(
                ReplyCode.NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'", *method_ids(method)
            )
        channel.reply_consumer = tag
        channel.reply_token = secrets.token_urlsafe(24)
        self.service.reply_channels[channel.reply_token] = channel
        if not frame.nowait:
            self.send_method(channel.number, commands.Basic.ConsumeOk(tag))

    def _basic_cancel(self, channel: AmqpChannel, frame: commands.Basic.Cancel) -> None:
        if channel.reply_consumer and frame.consumer_tag == channel.reply_consumer:
            self.service.reply_channels.pop(channel.reply_token, None)
            channel.reply_consumer = channel.reply_token = ""
            if not frame.nowait:
                self.send_method(channel.number, commands.Basic.CancelOk(frame.consumer_tag))
            return
        consumer = channel.consumers.pop(frame.consumer_tag or "", None)
        if not frame.nowait:
            self.send_method(channel.number, commands.Basic.CancelOk(frame.consumer_tag))
        if consumer is not None:
            consumer.queue.remove_consumer(consumer)
            self.service.queues_released(self, [consumer.queue])
            self._wake_queues.add(consumer.queue)


    def _basic_get(self, channel: AmqpChannel, frame: commands.Basic.Get) -> None:
        assert self.vhost is not None
        method = commands.Basic.Get
        name = self._queue_name(channel, frame.queue, method)
        queue = self.vhost.queue(name, self, method)
        entry = queue.take()
        if entry is None:
            self.send_method(channel.number, commands.Basic.GetEmpty())
            return
        tag = channel.next_tag
        channel.next_tag = tag + 1
        if frame.no_ack:
            queue.settle(entry)
        else:
            channel.unacked[tag] = Delivery(queue, entry, None)
        exchange, routing_key = route_names(route_of(entry.message))
        self.send_content(channel.number, commands.Basic.GetOk(
            tag, entry.redelivered, exchange, routing_key, len(queue.messages)
        ), entry.message)
        self.sent(entry.message)

    def _basic_ack(self, channel: AmqpChannel, frame: commands.Basic.Ack) -> None:
        if channel.tx is not None:
            channel.tx.settlements.append(
                (None, channel.settle_tagged(frame.delivery_tag, frame.multiple, commands.Basic.Ack))
            )
            return
        for delivery in channel.settle(frame.delivery_tag, frame.multiple, commands.Basic.Ack):
            delivery.queue.settle(delivery.entry)

    def _settle_negative(self, channel: AmqpChannel, deliveries: list[Delivery], requeue: bool) -> None:
        if requeue:
            by_queue: dict[Queue, list[QueueEntry]] = {}
            for delivery in deliveries:
                by_queue.setdefault(delivery.queue, []).append(delivery.entry)
            for queue, entries in by_queue.items():
                queue.requeue(entries)
        else:
            for delivery in deliveries:
                delivery.queue.reject(delivery.entry)

    def _basic_nack(self, channel: AmqpChannel, frame: commands.Basic.Nack) -> None:
        tagged = channel.settle_tagged(frame.delivery_tag, frame.multiple, commands.Basic.Nack)
        if channel.tx is not None:
            channel.tx.settlements.append((bool(frame.requeue), tagged))
            return
        self._settle_negative(channel, [d for _, d in tagged], frame.requeue)

    def _basic_reject(self, channel: AmqpChannel, frame: commands.Basic.Reject) -> None:
        tagged = channel.settle_tagged(frame.delivery_tag or 0, False, commands.Basic.Reject)
        if channel.tx is not None:
            channel.tx.settlements.append((bool(frame.requeue), tagged))
            return
        self._settle_negative(channel, [d for _, d in tagged], frame.requeue)

    def _basic_recover(self, channel: AmqpChannel, frame: Any) -> None:
        if not frame.requeue:
            # rabbit_channel handles only requeue=true (connection.close 540).
            raise ConnectionException(ReplyCode.NOT_IMPLEMENTED, "requeue=false", *method_ids(frame))
        channel.requeue_all()
        if isinstance(frame, commands.Basic.Recover):
            self.send_method(channel.number, commands.Basic.RecoverOk())
