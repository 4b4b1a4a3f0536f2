"""An AMQP channel's state: consumers, unacknowledged deliveries, prefetch limits, publisher
confirms, the content being assembled, and the route (exchange, routing key) its deliveries
report. The connection's handlers (`consuming`, `publishing`, `transactions`) act on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pamqp import commands

from ...core.message import Message
from .errors import ChannelException, ReplyCode
from .frames import method_ids
from .hotpath import encode_deliver, encode_deliver_route, shortstr
from .queues import Queue, QueueConsumer, QueueEntry
from .routing import exchange_and_key

if TYPE_CHECKING:
    from .connection import AmqpConnection
    from .transactions import Transaction

# Direct reply-to (https://www.rabbitmq.com/docs/direct-reply-to): a pseudo-queue consumed in
# no-ack mode; a publish whose reply-to is this name gets it rewritten to REPLY_TO + "." + a
# token, and a publish to the default exchange with that routing key goes straight to the
# consumer.
REPLY_TO = "amq.rabbitmq.reply-to"
REPLY_PREFIX = REPLY_TO + "."

ROUTE_KEY = "amqp-route"


def route_of(message: Message) -> bytes:
    """The exchange and routing key a delivery of `message` reports, as two shortstrs; worked
    out from its topic once and kept with the message's other encodings."""
    encoded = message.encoded
    if encoded is None:
        encoded = message.encoded = {}
    else:
        route = encoded.get(ROUTE_KEY)
        if route is not None:
            return route
    exchange, routing_key = exchange_and_key(message.topic)
    route = encoded[ROUTE_KEY] = shortstr(exchange) + shortstr(routing_key)
    return route


def route_names(route: bytes) -> tuple[str, str]:
    """(exchange, routing key) back from `route_of`'s two shortstrs."""
    n = route[0]
    m = route[1 + n]
    return route[1:1 + n].decode(), route[2 + n:2 + n + m].decode()


class Delivery:
    """An unacknowledged delivery on a channel."""

    __slots__ = ("queue", "entry", "consumer")

    def __init__(self, queue: Queue, entry: QueueEntry, consumer: QueueConsumer | None) -> None:
        self.queue = queue
        self.entry = entry
        self.consumer = consumer



class AmqpChannel:
    """One open channel: its consumers, unacked deliveries, prefetch, confirms, pending publish."""

    def __init__(self, connection: AmqpConnection, number: int) -> None:
        self.connection = connection
        self.number = number
        self.closing = False
        self.flow = True
        self.prefetch = 0  # channel-wide limit (basic.qos global=true)
        self.consumer_prefetch = 0  # for consumers created next (global=false)
        self.consumers: dict[str, QueueConsumer] = {}
        self.unacked: dict[int, Delivery] = {}
        self.next_tag = 1
        self.confirm = False
        self.publish_seq = 0
        self.unconfirmed: dict[int, bool] = {}
        self.last_queue = ""
        self.consumer_tags: dict[str, bytes] = {}
        # Highest publish sequence number covered by confirms waiting to be sent (multiple ack).
        self.confirm_ready = 0
        # Transaction (tx.select): publishes and settlements held until tx.commit, or None.
        self.tx: Transaction | None = None
        # Publishes of a tx.commit still being journaled; commit-ok waits for them.
        self.tx_landing = 0
        self.tx_failed = False
        # Direct reply-to consumer on this channel: its consumer tag and reply token.
        self.reply_consumer = ""
        self.reply_token = ""
        # Content being received: the publish method, its header, body parts.
        self.publish: commands.Basic.Publish | None = None
        self.content_props: commands.Basic.Properties | None = None
        self.content_raw: bytes = b""
        self.body_size = 0
        self.body: list[bytes] = []
        self.body_received = 0

    # ------------------------------------------------------------------ ConsumerChannel
    def can_deliver(self, consumer: QueueConsumer) -> bool:
        if self.closing or not self.flow:
            return False
        if not self.connection.writable:
            self.connection.stalled = True
            return False
        if consumer.no_ack:
            return True
        if consumer.prefetch and consumer.unacked >= consumer.prefetch:
            return False
        return not (self.prefetch and len(self.unacked) >= self.prefetch)

    def deliver(self, consumer: QueueConsumer, queue: Queue, entry: QueueEntry) -> None:
        tag = self.next_tag
        self.next_tag = tag + 1
        if consumer.no_ack:
            queue.settle(entry)
        else:
            self.unacked[tag] = Delivery(queue, entry, consumer)
            consumer.unacked += 1
        message = entry.message
        tag_bytes = self.consumer_tags.get(consumer.tag)
        if tag_bytes is None:
            tag_bytes = self.consumer_tags[consumer.tag] = shortstr(consumer.tag)
        self.connection.send_content(
            self.number,
            encode_deliver_route(self.number, tag_bytes, tag, entry.redelivered, route_of(message)),
            message,
        )
        self.connection.sent(message)

    # ------------------------------------------------------------------ acks
    def settle(self, tag: int, multiple: bool, method: type[commands.base.Frame]) -> list[Delivery]:
        """Remove and return the deliveries an ack/nack/reject covers."""
        return [delivery for _, delivery in self.settle_tagged(tag, multiple, method)]

    def settle_tagged(
        self, tag: int, multiple: bool, method: type[commands.base.Frame]
    ) -> list[tuple[int, Delivery]]:
        """Remove the deliveries an ack/nack/reject covers; returns them with their tags."""
        unacked = self.unacked
        settled: list[tuple[int, Delivery]]
        if multiple:
            if tag == 0:
                settled = list(unacked.items())
                unacked.clear()
            else:
                keys = [k for k in unacked if k <= tag]
                if not keys and tag >= self.next_tag:
                    raise ChannelException(
                        ReplyCode.PRECONDITION_FAILED, f"unknown delivery tag {tag}", *method_ids(method)
                    )
                settled = [(k, unacked.pop(k)) for k in keys]
        else:
            delivery = unacked.pop(tag, None)
            if delivery is None:
                raise ChannelException(
                    ReplyCode.PRECONDITION_FAILED, f"unknown delivery tag {tag}", *method_ids(method)
                )
            settled = [(tag, delivery)]
        for _, delivery in settled:
            consumer = delivery.consumer
            if consumer is not None:
                consumer.unacked -= 1
                self.connection.wake(consumer.queue)
            elif self.prefetch:
                self.connection.wake_channel(self)
        return settled

    def restore_unacked(self, tagged: list[tuple[int, Delivery]]) -> None:
        """tx.rollback: deliveries acknowledged inside the transaction are unacked again."""
        for tag, delivery in tagged:
            self.unacked[tag] = delivery
            if delivery.consumer is not None:
                delivery.consumer.unacked += 1
        self.unacked = dict(sorted(self.unacked.items()))

    def requeue_all(self) -> None:
        """Give every unacked delivery back to its queue (channel closed or basic.recover)."""
        deliveries = list(self.unacked.values())
        self.unacked.clear()
        by_queue: dict[Queue, list[QueueEntry]] = {}
        for delivery in deliveries:
            if delivery.consumer is not None:
                delivery.consumer.unacked -= 1
            by_queue.setdefault(delivery.queue, []).append(delivery.entry)
        for queue, entries in by_queue.items():
            queue.requeue(entries)

    def deliver_reply(self, routing_key: str, message: Message) -> None:
        """A direct reply-to response for this channel's reply consumer (no-ack)."""
        tag = self.next_tag
        self.next_tag = tag + 1
        self.connection.send_content(
            self.number,
            encode_deliver(self.number, shortstr(self.reply_consumer), tag, False, "", routing_key),
            message,
        )

    def release(self) -> list[Queue]:
        """Channel is going away: cancel consumers, requeue unacked; returns touched queues."""
        self.closing = True
        if self.reply_token:
            self.connection.service.reply_channels.pop(self.reply_token, None)
            self.reply_token = self.reply_consumer = ""
        queues = []
        for consumer in self.consumers.values():
            consumer.queue.remove_consumer(consumer)
            queues.append(consumer.queue)
        self.consumers.clear()
        self.requeue_all()
        return queues

