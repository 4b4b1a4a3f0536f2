"""Consuming (class basic, the consumer side): qos, consume (with the direct reply-to
consumer), cancel, get, and settling deliveries with ack, nack, reject and recover."""

from __future__ import annotations

import base64
import logging
import secrets
from typing import Any

from pamqp import commands

from ...core.edge import Action
from .base import ConnectionBase
from .channel import REPLY_TO, AmqpChannel, Delivery, route_names, route_of
from .errors import ChannelException, ConnectionException, ReplyCode
from .frames import State, method_ids, unchecked
from .queues import Queue, QueueConsumer, QueueEntry
from .remote import (
    ConsumerProxy,
    GetOrigin,
    RemoteEntry,
    RemoteQueue,
    decode_delivery,
    home_down,
    refusal,
)

log = logging.getLogger(__name__)


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
        # In a cluster, first wait (bounded) until the other nodes know this node's routes as
        # they are now (a bind sent with nowait just before, say), as a SUBACK waits.
        ready = self.service.edge.routes_ready()
        if ready is None:
            self._consume(channel, frame)
        else:
            self.hold_until(channel, ready, lambda _: self._consume(channel, frame))

    def _consume(self, channel: AmqpChannel, frame: commands.Basic.Consume) -> None:
        assert self.vhost is not None
        method = commands.Basic.Consume
        if frame.queue == REPLY_TO:
            self._reply_consume(channel, frame)
            return
        name = self._queue_name(channel, frame.queue, method)
        self._at_home(channel, name, lambda: self._consume_here(channel, frame, name),
                      lambda node: self._remote_consume(channel, frame, name, node, self._consumer_tag(channel, frame)))

    def _consumer_tag(self, channel: AmqpChannel, frame: commands.Basic.Consume) -> str:
        tag = frame.consumer_tag or f"amq.ctag-{self._ctag_prefix}-{next(self._ctag)}"
        if tag in channel.consumers:
            raise ConnectionException(
                ReplyCode.NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'", *method_ids(commands.Basic.Consume)
            )
        return tag

    def _consume_here(self, channel: AmqpChannel, frame: commands.Basic.Consume, name: str) -> None:
        assert self.vhost is not None
        method = commands.Basic.Consume
        queue = self.vhost.queue(name, self, method)
        self._check_read(queue, method)
        tag = self._consumer_tag(channel, frame)
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

    def _remote_consume(self, channel: AmqpChannel, frame: commands.Basic.Consume, name: str,
                        home: str, tag: str) -> None:
        """basic.consume on a queue of another node: a consumer link to it (`remote`)."""
        vhost = self.vhost
        assert vhost is not None and vhost.directory is not None
        method = commands.Basic.Consume
        directory = vhost.directory
        if not directory.live(home):
            raise home_down(home, vhost.name, name, method)
        priority = (frame.arguments or {}).get("x-priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            priority = 0
        remote = self._remote_queue(name, home)
        consumer = QueueConsumer(
            channel, tag, remote, bool(frame.no_ack), bool(frame.exclusive),
            channel.consumer_prefetch, priority,
        )

        def answered(reply: dict[str, Any]) -> None:
            def then() -> None:
                if reply.get("gone"):
                    raise home_down(home, vhost.name, name, method)
                failure = refusal(reply, method)
                if failure is not None:
                    proxy.close()
                    raise failure
                channel.consumers[tag] = consumer
                remote.add_remote_consumer(consumer, proxy)
                if not frame.nowait:
                    self.send_method(channel.number, commands.Basic.ConsumeOk(tag))

            self.release_hold(channel, then, orphaned=proxy.close)

        proxy = ConsumerProxy(remote, consumer, answered, self._remote_queue_gone)
        self.hold()
        proxy.link = directory.consume(home, {
            "op": "consume", "vhost": vhost.name, "queue": name, "tag": tag,
            "no_ack": bool(frame.no_ack), "exclusive": bool(frame.exclusive),
            # a channel-wide limit (global qos) counts as this consumer's on the home node
            "prefetch": channel.consumer_prefetch or channel.prefetch, "priority": priority,
            "user": self.principal.username,  # the home node checks what the queue brings
        }, proxy.receive)

    def _remote_queue_gone(self, remote: RemoteQueue) -> None:
        """A queue of another node was deleted there, or its node went away: its consumers
        here are cancelled (basic.cancel when the client takes it), as for a local queue."""
        remote.consumers.clear()
        remote.proxies.clear()
        if self.state is State.OPEN:
            self.queue_deleted(remote)
            self._request_flush()

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


    def _unreadable(self, queue: object) -> str | None:
        """The filter of a binding of `queue` this connection's user may not subscribe to
        (reading the queue reads what that binding brings), or None: it may read the queue
        (`Queue.unreadable`)."""
        edge = self.service.edge
        if not edge.secured or not isinstance(queue, Queue):
            return None  # a remote queue's are checked at its node
        principal = self.principal
        return queue.unreadable(
            lambda topic_filter: edge.authorize(principal, Action.SUBSCRIBE, topic_filter))

    def _check_read(self, queue: Queue, method: type[commands.base.Frame]) -> None:
        """basic.consume / basic.get: 403 ACCESS_REFUSED when the user may not read `queue`."""
        denied = self._unreadable(queue)
        if denied is not None:
            assert self.vhost is not None
            raise ChannelException(
                ReplyCode.ACCESS_REFUSED,
                f"read access to queue '{queue.name}' in vhost '{self.vhost.name}' refused for user "
                f"'{self.username}' (a binding brings {denied!r})", *method_ids(method))

    def reauthorize_consumers(self) -> int:
        """The users or the ACL rules changed: a consumer on a queue with a binding whose
        filter this connection's user may no longer subscribe to (the check `queue.bind`
        makes) is cancelled with basic.cancel, as for a deleted queue, or, for a client
        without the consumer_cancel_notify capability, its channel is closed with 403
        ACCESS_REFUSED. Its unacknowledged deliveries stay on the channel. Returns how many
        consumers ended."""
        notify = bool(self.capabilities.get("consumer_cancel_notify"))
        ended = 0
        for channel in list(self.channels.values()):
            for tag, consumer in list(channel.consumers.items()):
                queue = consumer.queue
                denied = self._unreadable(queue)
                if denied is None:
                    continue
                ended += 1
                log.info("%s: consumer %r on queue %r ended: user %r may no longer read %r",
                         self.remote, tag, queue.name, self.username, denied)
                if not notify:
                    self._close_channel(channel, ChannelException(
                        ReplyCode.ACCESS_REFUSED,
                        f"read access to queue '{queue.name}' refused for user '{self.username}'",
                        *method_ids(commands.Basic.Consume)))
                    break
                del channel.consumers[tag]
                queue.remove_consumer(consumer)
                self.send_method(channel.number, commands.Basic.Cancel(tag, nowait=True))
                self.service.queues_released(self, [queue])
                self._wake_queues.add(queue)
        return ended

    def _basic_get(self, channel: AmqpChannel, frame: commands.Basic.Get) -> None:
        assert self.vhost is not None
        method = commands.Basic.Get
        name = self._queue_name(channel, frame.queue, method)
        self._at_home(channel, name, lambda: self._get_here(channel, frame, name),
                      lambda node: self._remote_get(channel, frame, name, node))

    def _get_here(self, channel: AmqpChannel, frame: commands.Basic.Get, name: str) -> None:
        assert self.vhost is not None
        queue = self.vhost.queue(name, self, commands.Basic.Get)
        self._check_read(queue, commands.Basic.Get)
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
        self.send_content(channel.number, unchecked(commands.Basic.GetOk,
            tag, entry.redelivered, exchange, routing_key, len(queue.messages)
        ), entry.message)
        self.sent(entry.message)

    def _remote_get(self, channel: AmqpChannel, frame: commands.Basic.Get, name: str, home: str) -> None:
        vhost = self.vhost
        assert vhost is not None and vhost.directory is not None
        origin = GetOrigin(vhost.directory, home, vhost.name, name)

        def got(reply: dict[str, Any]) -> None:
            if reply.get("empty"):
                self.send_method(channel.number, commands.Basic.GetEmpty())
                return
            remote_id, redelivered, message = decode_delivery(base64.b64decode(reply["delivery"]))
            remote = self._remote_queue(name, home)
            entry = RemoteEntry(message, redelivered, None if frame.no_ack else origin, remote_id)
            tag = channel.next_tag
            channel.next_tag = tag + 1
            if not frame.no_ack:
                channel.unacked[tag] = Delivery(remote, entry, None)
            exchange, routing_key = route_names(route_of(message))
            self.send_content(channel.number, unchecked(commands.Basic.GetOk,
                tag, redelivered, exchange, routing_key, int(reply["count"])
            ), message)
            self.sent(message)

        self._ask_home(channel, home, name, commands.Basic.Get,
                       {"op": "get", "no_ack": bool(frame.no_ack), "user": self.principal.username},
                       None, got)

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
