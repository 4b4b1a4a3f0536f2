"""A virtual host: its exchanges and queues, and the AMQP rules for declaring and deleting them.

Operations raise `ChannelException`/`ConnectionException` with the reply code the spec (and
RabbitMQ) gives: 404 for a missing entity, 406 for an inequivalent redeclaration or a failed
if-unused/if-empty, 403 for the reserved `amq.` names, 405 for another connection's exclusive
queue, 503 for an unknown exchange type. Queues are core subscriptions named
`amqp:<vhost>:<queue>`; bindings are core filters (see `routing`).
"""

from __future__ import annotations

import base64
import datetime
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pamqp import commands, header

from ...core.errors import PublishRejected, SubscriptionBusy
from ...core.message import Message
from ...core.subscriptions import SubscriptionType
from .errors import ChannelException, ConnectionException, ReplyCode
from .properties import PROPERTIES_KEY, content_header_payload
from .queues import Queue, QueueEntry
from .routing import AMQ_TOPIC, binding_for, exchange_and_key, publish_topic, queue_topic

if TYPE_CHECKING:
    from ...core.broker import Broker

EXCHANGE_TYPES = ("direct", "fanout", "topic", "headers")
PREDECLARED = {
    "": "direct",
    "amq.direct": "direct",
    "amq.fanout": "fanout",
    "amq.topic": "topic",
    "amq.headers": "headers",
    "amq.match": "headers",
}
_QUEUE_INT_ARGS = ("x-message-ttl", "x-expires", "x-max-length")


@dataclass(slots=True)
class Exchange:
    name: str
    type: str
    durable: bool = True
    auto_delete: bool = False
    internal: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)
    # Queues bound to this exchange (name -> number of bindings), for auto-delete and delete.
    bound: dict[str, int] = field(default_factory=dict)


def _err(code: ReplyCode, text: str, method: type[commands.base.Frame] | None) -> ChannelException:
    class_id, method_id = _ids(method)
    return ChannelException(code, text, class_id, method_id)


def _ids(method: type[commands.base.Frame] | None) -> tuple[int, int]:
    if method is None:
        return 0, 0
    return method.index >> 16, method.index & 0xFFFF


class VirtualHost:
    def __init__(self, name: str, broker: Broker) -> None:
        self.name = name
        self.broker = broker
        self.exchanges: dict[str, Exchange] = {
            n: Exchange(n, t) for n, t in PREDECLARED.items()
        }
        self.queues: dict[str, Queue] = {}
        # Queues with a TTL or an x-expires, swept by the service's timer.
        self.timed_queues: set[Queue] = set()
        # Called with each deleted queue so that channels can cancel its consumers.
        self.on_queue_deleted: list[Any] = []

    # ------------------------------------------------------------------ exchanges
    def exchange(self, name: str, method: type[commands.base.Frame] | None) -> Exchange:
        exchange = self.exchanges.get(name)
        if exchange is None:
            raise _err(ReplyCode.NOT_FOUND, f"no exchange '{name}' in vhost '{self.name}'", method)
        return exchange

    def declare_exchange(self, frame: commands.Exchange.Declare) -> Exchange:
        method = commands.Exchange.Declare
        name = frame.exchange
        existing = self.exchanges.get(name)
        if frame.passive:
            if existing is None:
                raise _err(ReplyCode.NOT_FOUND, f"no exchange '{name}' in vhost '{self.name}'", method)
            return existing
        if frame.exchange_type not in EXCHANGE_TYPES:
            class_id, method_id = _ids(method)
            raise ConnectionException(
                ReplyCode.COMMAND_INVALID, f"unknown exchange type '{frame.exchange_type}'",
                class_id, method_id,
            )
        if existing is not None:
            if existing.type != frame.exchange_type:
                raise _err(
                    ReplyCode.PRECONDITION_FAILED,
                    f"inequivalent arg 'type' for exchange '{name}' in vhost '{self.name}': "
                    f"received '{frame.exchange_type}' but current is '{existing.type}'",
                    method,
                )
            if name not in PREDECLARED and (
                existing.durable != frame.durable or existing.auto_delete != frame.auto_delete
            ):
                raise _err(
                    ReplyCode.PRECONDITION_FAILED,
                    f"inequivalent arg 'durable' or 'auto_delete' for exchange '{name}' "
                    f"in vhost '{self.name}'",
                    method,
                )
            return existing
        if name.startswith("amq."):
            raise _err(
                ReplyCode.ACCESS_REFUSED,
                f"exchange name '{name}' contains reserved prefix 'amq.*'", method,
            )
        exchange = Exchange(
            name, frame.exchange_type, frame.durable, frame.auto_delete, frame.internal,
            dict(frame.arguments or {}),
        )
        self.exchanges[name] = exchange
        return exchange

    def delete_exchange(self, name: str, if_unused: bool) -> None:
        method = commands.Exchange.Delete
        exchange = self.exchanges.get(name)
        if exchange is None:
            return  # RabbitMQ: deleting a missing exchange succeeds
        if name in PREDECLARED:
            raise _err(ReplyCode.ACCESS_REFUSED, f"cannot delete predeclared exchange '{name}'", method)
        if if_unused and exchange.bound:
            raise _err(ReplyCode.PRECONDITION_FAILED, f"exchange '{name}' in use", method)
        for queue_name in list(exchange.bound):
            queue = self.queues.get(queue_name)
            if queue is not None:
                for key in [k for k in queue.bindings if k[0] == name]:
                    self._remove_binding(queue, key)
        del self.exchanges[name]

    # ------------------------------------------------------------------ queues
    def queue(self, name: str, owner: object, method: type[commands.base.Frame] | None) -> Queue:
        queue = self.queues.get(name)
        if queue is None:
            raise _err(ReplyCode.NOT_FOUND, f"no queue '{name}' in vhost '{self.name}'", method)
        self.check_access(queue, owner, method)
        return queue

    def check_access(self, queue: Queue, owner: object, method: type[commands.base.Frame] | None) -> None:
        if queue.exclusive_owner is not None and queue.exclusive_owner is not owner:
            raise _err(
                ReplyCode.RESOURCE_LOCKED,
                f"cannot obtain exclusive access to locked queue '{queue.name}' in vhost "
                f"'{self.name}'. It could be originally declared on another connection or "
                "the exclusive property value does not match that of the original declaration.",
                method,
            )

    def declare_queue(self, frame: commands.Queue.Declare, owner: object) -> tuple[Queue, bool]:
        """Declare (or find, when passive) a queue; returns it and whether it is new."""
        method = commands.Queue.Declare
        name = frame.queue
        if frame.passive:
            if not name:
                raise _err(ReplyCode.NOT_FOUND, "no queue name given", method)
            return self.queue(name, owner, method), False
        if not name:
            name = "amq.gen-" + base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        elif name.startswith("amq."):
            raise _err(
                ReplyCode.ACCESS_REFUSED, f"queue name '{name}' contains reserved prefix 'amq.*'",
                method,
            )
        arguments = dict(frame.arguments or {})
        for arg in _QUEUE_INT_ARGS:
            value = arguments.get(arg)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
                or (arg == "x-expires" and value == 0)
            ):
                raise _err(
                    ReplyCode.PRECONDITION_FAILED,
                    f"invalid arg '{arg}' for queue '{name}' in vhost '{self.name}': {value!r}",
                    method,
                )
        existing = self.queues.get(name)
        if existing is not None:
            self.check_access(existing, owner, method)
            if (
                existing.durable != frame.durable
                or existing.auto_delete != frame.auto_delete
                or (existing.exclusive_owner is not None) != frame.exclusive
            ):
                raise _err(
                    ReplyCode.PRECONDITION_FAILED,
                    f"inequivalent arg 'durable', 'exclusive' or 'auto_delete' for queue "
                    f"'{name}' in vhost '{self.name}'",
                    method,
                )
            for arg in set(arguments) | set(existing.arguments):
                if arg.startswith("x-") and arguments.get(arg) != existing.arguments.get(arg):
                    raise _err(
                        ReplyCode.PRECONDITION_FAILED,
                        f"inequivalent arg '{arg}' for queue '{name}' in vhost '{self.name}': "
                        f"received {arguments.get(arg)!r} but current is "
                        f"{existing.arguments.get(arg)!r}",
                        method,
                    )
            existing.last_used_ms = existing.last_used_ms
            return existing, False
        broker = self.broker
        sub_name = f"amqp:{self.name}:{name}"
        old = broker.subscriptions.get(sub_name)
        if old is not None:
            broker.remove_subscription(sub_name)
        sub = broker.subscription(
            sub_name, SubscriptionType.EXCLUSIVE, durable=False, owner=None
        )
        queue = Queue(
            name, sub, durable=frame.durable, exclusive_owner=owner if frame.exclusive else None,
            auto_delete=frame.auto_delete, arguments=arguments, dead_letter=self.dead_letter,
        )
        sub.owner = queue
        try:
            broker.attach(sub, queue)
        except SubscriptionBusy:  # pragma: no cover - the subscription is new
            raise _err(ReplyCode.RESOURCE_LOCKED, f"queue '{name}' is busy", method) from None
        self.queues[name] = queue
        default = binding_for("", "direct", name, None)
        default.topic_filter = queue_topic(name)
        queue.add_binding(default)
        broker.add_filter(sub, default.topic_filter)
        if queue.message_ttl is not None or queue.expires is not None:
            self.timed_queues.add(queue)
        return queue, True

    def delete_queue(self, queue: Queue) -> int:
        """Remove `queue` and everything bound to it; returns how many messages it held."""
        if queue.deleted:
            return 0
        queue.deleted = True
        count = len(queue.messages)
        self.queues.pop(queue.name, None)
        self.timed_queues.discard(queue)
        for key in list(queue.bindings):
            self._remove_binding(queue, key)
        self.broker.detach(queue.subscription, queue)
        self.broker.remove_subscription(queue.subscription.name)
        queue.messages.clear()
        for callback in self.on_queue_deleted:
            callback(queue)
        return count

    # ------------------------------------------------------------------ bindings
    def bind(self, queue: Queue, exchange_name: str, routing_key: str, arguments: dict[str, Any] | None,
             method: type[commands.base.Frame]) -> None:
        exchange = self.exchange(exchange_name, method)
        if exchange_name == "":
            raise _err(ReplyCode.ACCESS_REFUSED, "operation not permitted on the default exchange", method)
        binding = binding_for(exchange.name, exchange.type, routing_key, arguments)
        if queue.add_binding(binding):
            self.broker.add_filter(queue.subscription, binding.topic_filter)
        if (binding.exchange, binding.routing_key, binding.arguments) in queue.bindings:
            exchange.bound[queue.name] = sum(1 for k in queue.bindings if k[0] == exchange.name)

    def unbind(self, queue: Queue, exchange_name: str, routing_key: str, arguments: dict[str, Any] | None,
               method: type[commands.base.Frame]) -> None:
        exchange = self.exchange(exchange_name, method)
        if exchange_name == "":
            raise _err(ReplyCode.ACCESS_REFUSED, "operation not permitted on the default exchange", method)
        binding = binding_for(exchange.name, exchange.type, routing_key, arguments)
        self._remove_binding(queue, (binding.exchange, binding.routing_key, binding.arguments))

    def _remove_binding(self, queue: Queue, key: tuple[str, str, tuple[tuple[str, str], ...]]) -> None:
        if key not in queue.bindings:
            return
        unused_filter = queue.remove_binding(key)
        if unused_filter is not None:
            self.broker.remove_filter(queue.subscription, unused_filter)
        exchange = self.exchanges.get(key[0])
        if exchange is None or not exchange.name:
            return
        left = sum(1 for k in queue.bindings if k[0] == exchange.name)
        if left:
            exchange.bound[queue.name] = left
        else:
            exchange.bound.pop(queue.name, None)
            if exchange.auto_delete and not exchange.bound:
                del self.exchanges[exchange.name]

    # ------------------------------------------------------------------ routing
    def routed(self, message: Message) -> bool:
        """True if some subscription (an AMQP queue's bindings or any other) takes `message`."""
        for sub, filters in self.broker.match(message.topic):
            owner = sub.owner
            if isinstance(owner, Queue):
                if not owner.checked_filters or owner.accepts(message, filters):
                    return True
            else:
                return True
        return False

    def dead_letter(self, queue: Queue, entry: QueueEntry, reason: str) -> None:
        """Republish a dropped message to the queue's dead-letter exchange, if it has one."""
        dlx = queue.dead_letter_exchange
        if dlx is None:
            return
        exchange = self.exchanges.get(dlx)
        if exchange is None:
            return
        original = entry.message
        old_exchange, old_key = exchange_and_key(original.topic)
        key = queue.dead_letter_routing_key
        if key is None:
            key = old_key
        headers = [(k, v) for k, v in original.headers or () if not k.startswith("x-first-death-")]
        first = {k: v for k, v in original.headers or () if k.startswith("x-first-death-")}
        if not first:
            first = {
                "x-first-death-reason": reason, "x-first-death-queue": queue.name,
                "x-first-death-exchange": old_exchange,
            }
        headers.extend(first.items())
        message = Message(
            publish_topic(exchange.name, exchange.type, key),
            original.payload,
            qos=original.qos,
            key=original.key,
            headers=headers,
            content_type=original.content_type,
            correlation_data=original.correlation_data,
            reply_to=original.reply_to,
            payload_format=original.payload_format,
            expires_at_ms=None,
            producer_protocol=original.producer_protocol,
            producer_id=original.producer_id,
        )
        raw = original.encoded.get(PROPERTIES_KEY) if original.encoded else None
        if raw is not None:
            message.encoded = {PROPERTIES_KEY: _dead_lettered_properties(
                raw, reason, queue.name, old_exchange, old_key, first
            )}
        try:
            self.broker.publish(message)
        except PublishRejected:
            pass


def _dead_lettered_properties(
    raw: bytes, reason: str, queue: str, exchange: str, routing_key: str, first: dict[str, str]
) -> bytes:
    """The original typed properties plus RabbitMQ's x-death headers, expiration removed."""
    content = header.ContentHeader()
    content.unmarshal(content_header_payload(raw, 0))
    props = content.properties
    headers = dict(props.headers or {})
    deaths = list(headers.get("x-death") or [])
    deaths.insert(0, {
        "count": 1, "reason": reason, "queue": queue, "exchange": exchange,
        "routing-keys": [routing_key],
        "time": datetime.datetime.now(datetime.UTC).replace(microsecond=0, tzinfo=None),
    })
    headers["x-death"] = deaths
    for name, value in first.items():
        headers.setdefault(name, value)
    props.headers = headers
    props.expiration = None
    return props.marshal()


__all__ = ["AMQ_TOPIC", "Exchange", "VirtualHost", "PREDECLARED"]
