"""A virtual host: its exchanges and queues, and the AMQP rules for declaring and deleting them.

Operations raise `ChannelException`/`ConnectionException` with the reply code the spec (and
RabbitMQ) gives: 404 for a missing entity, 406 for an inequivalent redeclaration or a failed
if-unused/if-empty, 403 for the reserved `amq.` names, 405 for another connection's exclusive
queue, 503 for an unknown exchange type. Queues are core subscriptions named
`amqp:<vhost>:<queue>`; bindings are core filters (see `routing`); an exchange-to-exchange
binding adds, to each queue bound downstream, the filter of the source exchange plus a check of
every hop (`rederive`), so a message reaches a queue once whatever the paths. A durable queue (when the broker
has a journal) is a core *durable* subscription, so its messages and acknowledgements survive a
restart; the durable exchanges, queue arguments and bindings are recorded as a retained message
under `$internal/amqp/topology/<vhost>` (internal broker state, persisted by the composition
root like retained messages, never seen by clients) and
`restore()` rebuilds them at start.
"""

from __future__ import annotations

import base64
import datetime
import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pamqp import commands, encode, header
from pamqp.common import FieldArray, FieldTable

from ...core.broker import INTERNAL_PREFIX
from ...core.durable import DurableOptions, DurableSubscription
from ...core.edge import Action, Principal
from ...core.errors import PublishRejected, SubscriptionBusy
from ...core.message import Message, now_ms
from ...core.restoring import set_aside
from ...core.subscriptions import Subscription, SubscriptionType
from .errors import ChannelException, ConnectionException, ReplyCode
from .frames import method_ids
from .properties import (
    NATIVE_FORMAT,
    content_header_payload,
    native_properties,
    properties_from_message,
)
from .queues import Queue, QueueEntry
from .routing import (
    AMQ_TOPIC,
    PREFIX,
    Binding,
    HeaderCheck,
    all_of,
    binding_for,
    escape,
    exchange_and_key,
    header_value,
    hop_check,
    publish_topic,
    queue_topic,
)

if TYPE_CHECKING:
    from ...core.edge import Edge
    from .remote import ExchangeDirectory, QueueDirectory

log = logging.getLogger(__name__)

EXCHANGE_TYPES = ("direct", "fanout", "topic", "headers")
# Retained record of a vhost's durable exchanges, queues and bindings (`$` keeps it clear of
# exchange names, which cannot contain one).
TOPOLOGY_PREFIX = INTERNAL_PREFIX + "amqp/topology/"
# Where earlier versions kept it: as a retained message any `$amqp/#` subscriber could see.
LEGACY_TOPOLOGY_PREFIX = PREFIX + "$topology/"
# A durable queue settles every message itself (ack, reject, expiry, purge): no ack timeout,
# no core dead-lettering; its buffer is handed back when the queue object goes away.
DURABLE_QUEUE_OPTIONS = DurableOptions(ack_timeout_s=None, max_deliveries=0, redeliver_on_leave=True)
PREDECLARED = {
    "": "direct",
    "amq.direct": "direct",
    "amq.fanout": "fanout",
    "amq.topic": "topic",
    "amq.headers": "headers",
    "amq.match": "headers",
}
_QUEUE_INT_ARGS = (
    "x-message-ttl", "x-expires", "x-max-length", "x-max-length-bytes", "x-max-priority",
)


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


@dataclass(slots=True)
class ExchangeBinding:
    """An exchange-to-exchange binding (RabbitMQ's exchange.bind extension): messages that
    `source` routes with `routing_key`/`arguments` go on through `destination`."""

    source: str
    destination: str
    routing_key: str
    arguments: dict[str, Any]

    @property
    def key(self) -> tuple[str, str, str, tuple[tuple[str, str], ...]]:
        args = tuple(sorted((str(k), header_value(v)) for k, v in self.arguments.items()))
        return (self.source, self.destination, self.routing_key, args)


# At most this many routes through exchange bindings per queue binding (a guard against
# pathological graphs; RabbitMQ visits every exchange once per message).
MAX_DERIVED_BINDINGS = 1000

DEFAULT_EXCHANGE_REFUSED = "operation not permitted on the default exchange"


# The queue arguments RabbitMQ compares on redeclaration (rabbit_amqqueue declare_args/0);
# other arguments are not compared.
_REFUSED_KEY = "amqp-refused"  # in Message.encoded: an x-overflow reject-publish queue refused it
QUEUE_TYPES = ("classic", "quorum", "stream")
OVERFLOW_MODES = ("drop-head", "reject-publish", "reject-publish-dlx")
EQUIVALENT_QUEUE_ARGS = (
    "x-expires", "x-message-ttl", "x-dead-letter-exchange", "x-dead-letter-routing-key",
    "x-max-length", "x-max-length-bytes", "x-max-in-memory-length", "x-max-in-memory-bytes",
    "x-max-priority", "x-overflow", "x-queue-mode", "x-queue-version",
    "x-single-active-consumer", "x-queue-type", "x-quorum-initial-group-size", "x-max-age",
    "x-stream-max-segment-size-bytes", "x-initial-cluster-size", "x-queue-leader-locator",
)
# AMQP field-table type names as RabbitMQ prints them, by pamqp's type octet.
_FIELD_TYPES = {
    "b": "byte", "B": "unsignedbyte", "s": "short", "u": "unsignedshort", "I": "signedint",
    "i": "unsignedint", "l": "long", "f": "float", "d": "double", "D": "decimal",
    "S": "longstr", "t": "bool", "T": "timestamp", "F": "table", "A": "array", "V": "void",
    "x": "binary",
}


def _field_type(value: Any) -> str:
    """The field type RabbitMQ names for `value` as a pamqp-based client (aio-pika, aiormq)
    encodes it."""
    try:
        return _FIELD_TYPES.get(chr(encode.encode_table_value(value)[0]), "unknown")
    except (TypeError, ValueError):
        return "unknown"


def _erl(value: Any) -> str:
    """A value as RabbitMQ's ~s prints it in its reply texts."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def _arg_difference(received: Any, current: Any) -> str:
    """How a redeclared argument differs, in rabbit_misc:assert_args_equivalence's words."""
    if received is None:
        return (f"received none but current is the value '{_erl(current)}' of type "
                f"'{_field_type(current)}'")
    if current is None:
        return (f"received the value '{_erl(received)}' of type '{_field_type(received)}' "
                f"but current is none")
    return f"received '{_erl(received)}' but current is '{_erl(current)}'"


def _err(code: ReplyCode, text: str, method: type[commands.base.Frame] | None) -> ChannelException:
    class_id, method_id = method_ids(method)
    return ChannelException(code, text, class_id, method_id)


class VirtualHost:
    def __init__(self, name: str, edge: Edge, *, queue_directory: QueueDirectory | None = None,
                 exchange_directory: ExchangeDirectory | None = None) -> None:
        self.name = name
        self.edge = edge
        self.exchanges: dict[str, Exchange] = {
            n: Exchange(n, t) for n, t in PREDECLARED.items()
        }
        self.queues: dict[str, Queue] = {}
        # Messages a queue refused (x-overflow reject-publish), by id, until their publisher's
        # confirm is decided: a reliable stream routes them once their commit is durable.
        self.exchange_bindings: dict[tuple[str, str, str, tuple[tuple[str, str], ...]], ExchangeBinding] = {}
        # Queues with a TTL or an x-expires, swept by the service's timer.
        self.timed_queues: set[Queue] = set()
        # Called with each deleted queue so that channels can cancel its consumers.
        self.on_queue_deleted: list[Any] = []
        # In a cluster (the ports the virtual host is built with, each in use once the node
        # has joined: `use_queue_directory`, `use_exchange_directory`; None until then and on
        # a single node): where the shared queues of other nodes live
        # (`remote.QueueDirectory`), and the exchanges every node shares
        # (`remote.ExchangeDirectory`), told of each change of this node's exchanges and
        # exchange bindings through `on_exchanges_changed` (not while it applies another
        # node's change).
        self._queue_directory = queue_directory
        self._exchange_directory = exchange_directory
        self.directory: QueueDirectory | None = None
        self.exchange_directory: ExchangeDirectory | None = None
        self.on_exchanges_changed: list[Any] = []
        # Told after an exchange binding is added (here or on another node of the cluster).
        self.on_exchange_bound: list[Any] = []

    def use_queue_directory(self) -> None:
        """The node has joined its cluster: queues of other nodes are found through the
        directory this virtual host was built with from now on."""
        self.directory = self._queue_directory

    def use_exchange_directory(self) -> None:
        """The node has joined its cluster: exchanges are shared through the directory this
        virtual host was built with from now on."""
        self.exchange_directory = self._exchange_directory

    def _exchanges_changed(self) -> None:
        for callback in self.on_exchanges_changed:
            callback(self)

    # ------------------------------------------------------------------ exchanges
    def exchange(self, name: str, method: type[commands.base.Frame] | None) -> Exchange:
        exchange = self.exchanges.get(name)
        if exchange is None:
            raise _err(ReplyCode.NOT_FOUND, f"no exchange '{name}' in vhost '{self.name}'", method)
        return exchange

    def declare_exchange(self, frame: commands.Exchange.Declare) -> Exchange:
        method = commands.Exchange.Declare
        name = frame.exchange
        if name == "":
            # rabbit_channel check_not_default_exchange/1, passive or not (403).
            raise _err(ReplyCode.ACCESS_REFUSED, DEFAULT_EXCHANGE_REFUSED, method)
        existing = self.exchanges.get(name)
        if frame.passive:
            if existing is None:
                raise _err(ReplyCode.NOT_FOUND, f"no exchange '{name}' in vhost '{self.name}'", method)
            return existing
        if frame.exchange_type not in EXCHANGE_TYPES:
            class_id, method_id = method_ids(method)
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
            # rabbit_exchange:assert_equivalence/6: type, durable, auto_delete, internal, then
            # of the arguments only alternate-exchange.
            for flag, have, want in (
                ("durable", existing.durable, bool(frame.durable)),
                ("auto_delete", existing.auto_delete, bool(frame.auto_delete)),
                ("internal", existing.internal, bool(frame.internal)),
            ):
                if name not in PREDECLARED and have != want:
                    raise _err(
                        ReplyCode.PRECONDITION_FAILED,
                        f"inequivalent arg '{flag}' for exchange '{name}' in vhost "
                        f"'{self.name}': received '{_erl(want)}' but current is '{_erl(have)}'",
                        method,
                    )
            received = (frame.arguments or {}).get("alternate-exchange")
            current = existing.arguments.get("alternate-exchange")
            if received != current:
                raise _err(
                    ReplyCode.PRECONDITION_FAILED,
                    f"inequivalent arg 'alternate-exchange' for exchange '{name}' in vhost "
                    f"'{self.name}': {_arg_difference(received, current)}",
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
        if exchange.durable:
            self.save_topology()
        self._exchanges_changed()
        return exchange

    def delete_exchange(self, name: str, if_unused: bool) -> None:
        method = commands.Exchange.Delete
        exchange = self.exchanges.get(name)
        if name == "":
            raise _err(ReplyCode.ACCESS_REFUSED, DEFAULT_EXCHANGE_REFUSED, method)
        if exchange is None:
            return  # RabbitMQ: deleting a missing exchange succeeds
        if name in PREDECLARED:
            raise _err(
                ReplyCode.ACCESS_REFUSED,
                f"deletion of system exchange '{name}' in vhost '{self.name}' not allowed", method,
            )
        if if_unused and (exchange.bound or self._is_source(name)):
            raise _err(
                ReplyCode.PRECONDITION_FAILED,
                f"exchange '{name}' in vhost '{self.name}' in use", method,
            )
        linked = [k for k, b in self.exchange_bindings.items() if name in (b.source, b.destination)]
        for key in linked:
            del self.exchange_bindings[key]
        for queue_name in list(exchange.bound):
            queue = self.queues.get(queue_name)
            if queue is not None:
                for binding_key in [k for k in queue.bindings if k[0] == name]:
                    self._remove_binding(queue, binding_key)
        self.exchanges.pop(name, None)
        if linked:
            self.rederive_all()
        if exchange.durable:
            self.save_topology()
        self._exchanges_changed()

    # ------------------------------------------------------------------ exchange bindings
    def _is_source(self, name: str) -> bool:
        return any(b.source == name for b in self.exchange_bindings.values())

    def bind_exchange(
        self, destination: str, source: str, routing_key: str, arguments: dict[str, Any] | None,
        method: type[commands.base.Frame], allowed: Any = None,
    ) -> None:
        """exchange.bind: route what `source` matches on through `destination`. Loops are
        allowed; a message still reaches each queue at most once, as in RabbitMQ."""
        if destination == "" or source == "":
            raise _err(ReplyCode.ACCESS_REFUSED, DEFAULT_EXCHANGE_REFUSED, method)
        self.exchange(destination, method)
        src = self.exchange(source, method)
        binding = ExchangeBinding(source, destination, routing_key, dict(arguments or {}))
        if allowed is not None:
            topic_filter = binding_for(src.name, src.type, routing_key, arguments).topic_filter
            if not allowed(topic_filter):
                raise _err(
                    ReplyCode.ACCESS_REFUSED,
                    f"access to exchange '{source}' with binding key '{routing_key}' refused",
                    method,
                )
        if self.add_exchange_binding(binding):
            self._exchanges_changed()

    def unbind_exchange(
        self, destination: str, source: str, routing_key: str, arguments: dict[str, Any] | None,
        method: type[commands.base.Frame],
    ) -> None:
        if destination == "" or source == "":
            raise _err(ReplyCode.ACCESS_REFUSED, DEFAULT_EXCHANGE_REFUSED, method)
        key = ExchangeBinding(source, destination, routing_key, dict(arguments or {})).key
        if self.remove_exchange_binding(key) is None:
            return  # RabbitMQ answers unbind-ok for a binding that does not exist
        self._exchanges_changed()
        self._maybe_auto_delete(source)

    def add_exchange_binding(self, binding: ExchangeBinding) -> bool:
        """Keep `binding`: queues' routes rederived, the topology saved when both its exchanges
        are durable. False (and nothing done) when it is there already."""
        if binding.key in self.exchange_bindings:
            return False
        self.exchange_bindings[binding.key] = binding
        self.rederive_all()
        for callback in self.on_exchange_bound:  # queues may bring more: their readers checked
            callback()
        if self._durable_binding(binding):
            self.save_topology()
        return True

    def remove_exchange_binding(self, key: tuple[Any, ...]) -> ExchangeBinding | None:
        """Drop the exchange binding `key` (routes rederived, the topology saved when it was
        durable); the binding dropped, None when there was none."""
        binding = self.exchange_bindings.pop(key, None)
        if binding is not None:
            self.rederive_all()
            if self._durable_binding(binding):
                self.save_topology()
        return binding

    def _durable_binding(self, binding: ExchangeBinding) -> bool:
        source = self.exchanges.get(binding.source)
        destination = self.exchanges.get(binding.destination)
        return bool(source and destination and source.durable and destination.durable)

    def unused_auto_delete(self, name: str) -> bool:
        """Whether `name` is an auto-delete exchange no binding here has it as its source."""
        exchange = self.exchanges.get(name)
        return not (exchange is None or not exchange.auto_delete or exchange.bound
                    or self._is_source(name))

    def _maybe_auto_delete(self, name: str) -> None:
        """An auto-delete exchange goes once it is no longer the source of any binding. In a
        cluster, queues of other nodes may still be bound to it: the directory asks them first
        and calls `auto_delete` when none is."""
        if not self.unused_auto_delete(name):
            return
        if self.exchange_directory is not None:
            self.exchange_directory.auto_delete(self, name)
            return
        self.auto_delete(name)

    def auto_delete(self, name: str) -> None:
        """Delete the auto-delete exchange `name` if it is still unused here."""
        if not self.unused_auto_delete(name):
            return
        exchange = self.exchanges[name]
        del self.exchanges[name]
        linked = [k for k, b in self.exchange_bindings.items() if b.destination == name]
        for key in linked:
            del self.exchange_bindings[key]
        if linked:
            self.rederive_all()
        if exchange.durable:
            self.save_topology()
        self._exchanges_changed()

    def rederive_all(self) -> None:
        for queue in list(self.queues.values()):
            self.rederive(queue)

    def rederive(self, queue: Queue) -> None:
        """Bring `queue`'s derived bindings (one per route from a source exchange through
        exchange bindings to one of its own bindings) and their core filters up to date."""
        wanted = self._derived_for(queue)
        current = queue.derived
        subscription = queue.subscription
        for key in [k for k in current if k not in wanted]:
            unused = queue.remove_derived(key)
            if unused is not None:
                self.edge.remove_filter(subscription, unused)
        for key, binding in wanted.items():
            if key not in current and queue.add_derived(key, binding):
                self.edge.add_filter(subscription, binding.topic_filter)

    def _derived_for(self, queue: Queue) -> dict[tuple[Any, ...], Binding]:
        derived: dict[tuple[Any, ...], Binding] = {}
        if not self.exchange_bindings:
            return derived
        incoming: dict[str, list[ExchangeBinding]] = {}
        for binding in self.exchange_bindings.values():
            incoming.setdefault(binding.destination, []).append(binding)

        def walk(
            name: str, checks: list[HeaderCheck], path: tuple[Any, ...], seen: frozenset[str]
        ) -> None:
            for link in incoming.get(name, ()):
                if link.source in seen or len(derived) >= MAX_DERIVED_BINDINGS:
                    continue
                source = self.exchanges.get(link.source)
                if source is None:
                    continue
                first = binding_for(source.name, source.type, link.routing_key, link.arguments)
                route = (*path, link.key)
                derived[route] = Binding(
                    source.name, link.routing_key, first.arguments, first.topic_filter,
                    all_of([c for c in (first.check, *checks) if c is not None]),
                )
                hop = hop_check(source.type, link.routing_key, link.arguments)
                walk(source.name, [hop, *checks] if hop else checks, route, seen | {source.name})

        for key, own in queue.bindings.items():
            if not own.exchange or own.exchange not in incoming:
                continue
            exchange = self.exchanges.get(own.exchange)
            if exchange is None:
                continue
            last = hop_check(exchange.type, own.routing_key, dict(own.arguments))
            walk(exchange.name, [last] if last else [], (key,), frozenset((exchange.name,)))
        return derived

    # ------------------------------------------------------------------ queues
    def queue(self, name: str, owner: object, method: type[commands.base.Frame] | None) -> Queue:
        queue = self.queues.get(name)
        if queue is None:
            raise _err(ReplyCode.NOT_FOUND, f"no queue '{name}' in vhost '{self.name}'", method)
        self.check_access(queue, owner, method)
        return queue

    def check_access(self, queue: Queue, owner: object, method: type[commands.base.Frame] | None) -> None:
        if queue.exclusive_owner is not None and queue.exclusive_owner is not owner:
            raise self._locked(queue, method)

    def _locked(self, queue: Queue, method: type[commands.base.Frame] | None) -> ChannelException:
        return _err(
            ReplyCode.RESOURCE_LOCKED,
            f"cannot obtain exclusive access to locked queue '{queue.name}' in vhost "
            f"'{self.name}'. It could be originally declared on another connection or "
            "the exclusive property value does not match that of the original declaration.",
            method,
        )

    def declare_queue(self, frame: commands.Queue.Declare, owner: object,
                      writer: str | None = None) -> tuple[Queue, bool]:
        """Declare (or find, when passive) a queue; returns it and whether it is new. `writer`
        is the declaring user, whose right to publish each dead-lettered message's topic is
        checked when it is dead-lettered."""
        method = commands.Queue.Declare
        name = frame.queue
        if frame.passive:
            if not name:
                raise _err(ReplyCode.NOT_FOUND, "no queue name given", method)
            queue = self.queue(name, owner, method)
            # rabbit_amqqueue_process handle_call(stat): a passive declare renews x-expires.
            queue.last_used_ms = now_ms()
            return queue, False
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
            if value is None:
                continue
            problem = None
            if isinstance(value, bool) or not isinstance(value, int):
                problem = f'"expected integer, got {_field_type(value)}"'
            elif value < 0:
                problem = f"{{value_negative,{value}}}"
            elif arg == "x-expires" and value == 0:
                problem = "{value_zero,0}"
            elif arg == "x-max-priority" and value > 255:
                problem = f"{{max_value_exceeded,{value}}}"
            if problem is not None:
                raise _err(
                    ReplyCode.PRECONDITION_FAILED,
                    f"invalid arg '{arg}' for queue '{name}' in vhost '{self.name}': {problem}",
                    method,
                )
        # rabbit_amqqueue's other argument checks, with their Erlang reasons.
        overflow = arguments.get("x-overflow")
        if overflow is not None and _erl(overflow) not in OVERFLOW_MODES:
            raise _err(
                ReplyCode.PRECONDITION_FAILED,
                f"invalid arg 'x-overflow' for queue '{name}' in vhost '{self.name}': "
                f"invalid_overflow", method,
            )
        if "x-dead-letter-routing-key" in arguments and "x-dead-letter-exchange" not in arguments:
            raise _err(
                ReplyCode.PRECONDITION_FAILED,
                f"invalid arg 'x-dead-letter-routing-key' for queue '{name}' in vhost "
                f"'{self.name}': routing_key_but_no_dlx_defined", method,
            )
        # rabbit_channel: "Durable = DurableDeclare andalso not ExclusiveDeclare", an exclusive
        # queue is never durable, whatever the declare says.
        is_durable = bool(frame.durable) and not frame.exclusive
        existing = self.queues.get(name)
        if existing is not None:
            # rabbit_amqqueue:assert_equivalence/5: durable, auto_delete, exclusive (405), then
            # the declare arguments RabbitMQ knows, each with its own text.
            for flag, have, want in (
                ("durable", existing.durable, is_durable),
                ("auto_delete", existing.auto_delete, bool(frame.auto_delete)),
            ):
                if have != want:
                    raise _err(
                        ReplyCode.PRECONDITION_FAILED,
                        f"inequivalent arg '{flag}' for queue '{name}' in vhost '{self.name}': "
                        f"received '{_erl(want)}' but current is '{_erl(have)}'",
                        method,
                    )
            self.check_access(existing, owner, method)
            if (existing.exclusive_owner is not None) != bool(frame.exclusive):
                raise self._locked(existing, method)
            for arg in EQUIVALENT_QUEUE_ARGS:
                received, current = arguments.get(arg), existing.arguments.get(arg)
                if received == current:
                    continue
                raise _err(
                    ReplyCode.PRECONDITION_FAILED,
                    f"inequivalent arg '{arg}' for queue '{name}' in vhost '{self.name}': "
                    f"{_arg_difference(received, current)}",
                    method,
                )
            existing.last_used_ms = now_ms()  # a redeclare renews x-expires
            return existing, False
        # x-queue-type (rabbit_queue_type): quorum and stream queues are accepted and kept as
        # classic ones are, with their own declare checks (rabbit_queue_type_util run_checks).
        queue_type = _erl(arguments.get("x-queue-type", "classic"))
        if queue_type not in QUEUE_TYPES:
            raise _err(
                ReplyCode.PRECONDITION_FAILED,
                f"invalid arg 'x-queue-type' for queue '{name}' in vhost '{self.name}': "
                f"\"unsupported queue type '{queue_type}'\"", method,
            )
        if queue_type != "classic":
            for problem, present in (
                ("auto-delete", frame.auto_delete), ("exclusive-owner", frame.exclusive),
                ("non-durable", not is_durable),
            ):
                if present:
                    raise _err(
                        ReplyCode.PRECONDITION_FAILED,
                        f"invalid property '{problem}' for queue '{name}' in vhost '{self.name}'",
                        method,
                    )
        edge = self.edge
        sub_name = self._subscription_name(name)
        keeps_messages = frame.durable and not frame.exclusive and edge.stores_messages
        old = edge.subscriptions.get(sub_name)
        if old is not None and not (keeps_messages and isinstance(old, DurableSubscription)):
            edge.remove_subscription(sub_name)
        if keeps_messages:
            # Messages wait in the journal; the core's durable subscription keeps this queue's
            # cursor, so they survive a restart (acks are `subscription.ack`).
            durable = edge.durable_subscription(
                sub_name, SubscriptionType.EXCLUSIVE, options=DURABLE_QUEUE_OPTIONS
            )
            # Cursors on every reliable shard from now on, saved with the next cursor flush.
            durable.open_cursors()
            sub: Subscription = durable
        else:
            sub = edge.subscription(sub_name, SubscriptionType.EXCLUSIVE, durable=False)
        try:
            queue = self._make_queue(
                name, sub, durable=is_durable,
                exclusive_owner=owner if frame.exclusive else None,
                auto_delete=frame.auto_delete, arguments=arguments,
            )
        except SubscriptionBusy:  # pragma: no cover - the subscription is new
            raise _err(ReplyCode.RESOURCE_LOCKED, f"queue '{name}' is busy", method) from None
        queue.writer = writer
        if frame.durable and not frame.exclusive:
            self.save_topology()
        return queue, True

    def _subscription_name(self, queue: str) -> str:
        return f"amqp:{self.name}:{queue}"

    def _make_queue(
        self, name: str, sub: Subscription, *, durable: bool, exclusive_owner: object | None,
        auto_delete: bool, arguments: dict[str, Any],
    ) -> Queue:
        queue = Queue(
            name, sub, durable=durable, exclusive_owner=exclusive_owner, auto_delete=auto_delete,
            arguments=arguments, dead_letter=self.dead_letter,
        )
        sub.owner = queue
        self.edge.attach(sub, queue)
        self.queues[name] = queue
        default = binding_for("", "direct", name, None)
        default.topic_filter = queue_topic(name)
        queue.add_binding(default)
        self.edge.add_filter(sub, default.topic_filter)
        if queue.message_ttl is not None or queue.expires is not None:
            self.timed_queues.add(queue)
        queue.on_timed_message = self.timed_queues.add
        queue.on_publish_refused = self._publish_refused
        return queue

    def _publish_refused(self, message: Message) -> None:
        # Marked on the message itself: a refusal nobody asks about (a publish from another
        # protocol) goes with the message instead of lingering under an id that a later
        # message could reuse.
        if message.encoded is None:
            message.encoded = {}
        message.encoded[_REFUSED_KEY] = b"1"

    def take_refusal(self, message: Message) -> bool:
        """Whether a queue refused `message` (forgotten once asked)."""
        encoded = message.encoded
        return encoded is not None and encoded.pop(_REFUSED_KEY, None) is not None

    # ------------------------------------------------------------------ durable topology
    @property
    def topology_topic(self) -> str:
        return TOPOLOGY_PREFIX + escape(self.name)

    def save_topology(self) -> None:
        """Record durable exchanges, durable queues and their bindings as a retained message,
        which the composition root persists with the other retained messages."""
        if not self.edge.stores_messages:
            return  # nothing survives a restart anyway
        exchanges = [
            {"name": e.name, "type": e.type, "auto_delete": e.auto_delete, "internal": e.internal,
             "arguments": e.arguments}
            for e in self.exchanges.values() if e.durable and e.name not in PREDECLARED
        ]
        queues = [
            {"name": q.name, "auto_delete": q.auto_delete, "arguments": q.arguments,
             "writer": q.writer,
             "bindings": [[b.exchange, b.routing_key, list(b.arguments)]
                          for b in q.bindings.values() if b.exchange]}
            for q in self.queues.values() if q.durable and q.exclusive_owner is None
        ]
        exchange_bindings = [
            [b.source, b.destination, b.routing_key, b.arguments]
            for b in self.exchange_bindings.values() if self._durable_binding(b)
        ]
        payload = json.dumps(
            {"exchanges": exchanges, "queues": queues, "exchange_bindings": exchange_bindings},
            default=str,
        ).encode()
        self.edge.keep_internal(Message(
            self.topology_topic, payload, qos=1, content_type="application/json",
            producer_protocol="amqp",
        ))

    def restore(self) -> int:
        """Bring back durable exchanges and queues (with their bindings) after a restart; the
        queues' messages come back from their durable subscriptions' cursors."""
        saved: dict[str, Any] = {"exchanges": [], "queues": []}
        record = self.edge.internal_state(self.topology_topic)
        legacy_topic = LEGACY_TOPOLOGY_PREFIX + escape(self.name)
        legacy = self.edge.retained_message(legacy_topic)
        if legacy is not None:
            # Move it out of the retained messages clients can see.
            if record is None:
                record = legacy
            self.edge.forget_retained(legacy_topic)
        if record is not None and record.payload:
            try:
                saved = json.loads(record.payload)
                if not isinstance(saved, dict):
                    raise ValueError(f"a JSON object expected, got {type(saved).__name__}")
            except ValueError as exc:
                set_aside(log, f"AMQP topology of vhost {self.name!r}", record.payload, exc)
                saved = {}
        for entry in _entries(saved, "exchanges"):
            try:
                if entry.get("type") in EXCHANGE_TYPES and entry["name"] not in self.exchanges:
                    self.exchanges[str(entry["name"])] = Exchange(
                        str(entry["name"]), entry["type"], True, bool(entry.get("auto_delete")),
                        bool(entry.get("internal")), dict(entry.get("arguments") or {}),
                    )
            except Exception as exc:
                set_aside(log, f"exchange of vhost {self.name!r}", entry, exc)
        for entry in _entries(saved, "exchange_bindings"):
            try:
                source, destination, key, args = entry
                if source in self.exchanges and destination in self.exchanges:
                    exchange_binding = ExchangeBinding(source, destination, key, dict(args or {}))
                    self.exchange_bindings[exchange_binding.key] = exchange_binding
            except Exception as exc:
                set_aside(log, f"exchange binding of vhost {self.name!r}", entry, exc)
        queues: dict[str, Any] = {}
        for entry in _entries(saved, "queues"):
            try:
                queues[str(entry["name"])] = entry
            except Exception as exc:
                set_aside(log, f"queue of vhost {self.name!r}", entry, exc)
        prefix = self._subscription_name("")
        count = 0
        for sub in list(self.edge.subscriptions.values()):
            if not sub.name.startswith(prefix) or not isinstance(sub, DurableSubscription):
                continue
            name = sub.name[len(prefix):]
            if name in self.queues:
                continue
            entry = queues.get(name, {})
            try:
                queue = self._make_queue(
                    name, sub, durable=True, exclusive_owner=None,
                    auto_delete=bool(entry.get("auto_delete")),
                    arguments=dict(entry.get("arguments") or {}),
                )
            except Exception as exc:
                set_aside(log, f"queue {name!r} of vhost {self.name!r}", entry, exc)
                continue
            writer = entry.get("writer")
            queue.writer = None if writer is None else str(writer)
            for binding_entry in entry.get("bindings", []):
                try:
                    self._restore_binding(queue, binding_entry)
                except Exception as exc:
                    set_aside(log, f"binding of queue {name!r} of vhost {self.name!r}",
                              binding_entry, exc)
            # filters saved by an earlier version (or refused now) that no binding asks for
            for stale in [f for f in sub.filters if f not in queue.by_filter]:
                self.edge.remove_filter(sub, stale)
            if self.exchange_bindings:
                self.rederive(queue)
            sub.wake()
            count += 1
        return count

    def _restore_binding(self, queue: Queue, entry: Any) -> None:
        exchange_name, key, args = entry
        exchange = self.exchanges.get(exchange_name)
        if exchange is None:
            return
        binding = binding_for(exchange.name, exchange.type, key, dict(args))
        self.edge.add_filter(queue.subscription, binding.topic_filter)
        queue.add_binding(binding)
        exchange.bound[queue.name] = exchange.bound.get(queue.name, 0) + 1

    def delete_checked(self, name: str, owner: object, if_unused: bool, if_empty: bool) -> int:
        """queue.delete with RabbitMQ's checks; a missing queue is deleted already (0)."""
        method = commands.Queue.Delete
        queue = self.queues.get(name)
        if queue is None:
            return 0
        self.check_access(queue, owner, method)
        if if_unused and queue.consumers:
            raise _err(ReplyCode.PRECONDITION_FAILED, f"queue '{name}' in vhost '{self.name}' in use", method)
        if if_empty and queue.messages:
            raise _err(ReplyCode.PRECONDITION_FAILED, f"queue '{name}' in vhost '{self.name}' not empty", method)
        return self.delete_queue(queue)

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
        for key in list(queue.derived):
            unused = queue.remove_derived(key)
            if unused is not None:
                self.edge.remove_filter(queue.subscription, unused)
        self.edge.detach(queue.subscription, queue)
        self.edge.remove_subscription(queue.subscription.name)
        queue.messages.clear()
        queue.ready_bytes = 0
        for callback in self.on_queue_deleted:
            callback(queue)
        if queue.durable and queue.exclusive_owner is None:
            self.save_topology()
        return count

    # ------------------------------------------------------------------ bindings
    def bind(self, queue: Queue, exchange_name: str, routing_key: str, arguments: dict[str, Any] | None,
             method: type[commands.base.Frame], allowed: Any = None) -> None:
        """Bind `queue`; `allowed(topic_filter)` (the authorizer) may refuse it with 403."""
        exchange = self.exchange(exchange_name, method)
        if exchange_name == "":
            raise _err(ReplyCode.ACCESS_REFUSED, "operation not permitted on the default exchange", method)
        binding = binding_for(exchange.name, exchange.type, routing_key, arguments)
        if allowed is not None and not allowed(binding.topic_filter):
            raise _err(
                ReplyCode.ACCESS_REFUSED,
                f"access to exchange '{exchange_name}' with binding key '{routing_key}' refused",
                method,
            )
        if queue.add_binding(binding):
            self.edge.add_filter(queue.subscription, binding.topic_filter)
        exchange.bound[queue.name] = sum(1 for k in queue.bindings if k[0] == exchange.name)
        if self.exchange_bindings:
            self.rederive(queue)
        if queue.durable and queue.exclusive_owner is None:
            self.save_topology()

    def unbind(self, queue: Queue, exchange_name: str, routing_key: str, arguments: dict[str, Any] | None,
               method: type[commands.base.Frame]) -> None:
        if exchange_name and exchange_name not in self.exchanges:
            return  # RabbitMQ 3.x: unbinding from a missing exchange succeeds
        exchange = self.exchange(exchange_name, method)
        if exchange_name == "":
            raise _err(ReplyCode.ACCESS_REFUSED, "operation not permitted on the default exchange", method)
        binding = binding_for(exchange.name, exchange.type, routing_key, arguments)
        self._remove_binding(queue, (binding.exchange, binding.routing_key, binding.arguments))
        if self.exchange_bindings:
            self.rederive(queue)
        if queue.durable and queue.exclusive_owner is None:
            self.save_topology()

    def _remove_binding(self, queue: Queue, key: tuple[str, str, tuple[tuple[str, str], ...]]) -> None:
        if key not in queue.bindings:
            return
        unused_filter = queue.remove_binding(key)
        if unused_filter is not None:
            self.edge.remove_filter(queue.subscription, unused_filter)
        exchange = self.exchanges.get(key[0])
        if exchange is None or not exchange.name:
            return
        left = sum(1 for k in queue.bindings if k[0] == exchange.name)
        if left:
            exchange.bound[queue.name] = left
        else:
            exchange.bound.pop(queue.name, None)
            self._maybe_auto_delete(exchange.name)

    # ------------------------------------------------------------------ routing
    def routed(self, message: Message) -> bool:
        """True if some subscription (an AMQP queue's bindings or any other) takes `message`."""
        for sub, filters in self.edge.match(message.topic):
            owner = sub.owner
            if isinstance(owner, Queue):
                if not owner.checked_filters or owner.accepts(message, filters):
                    return True
            else:
                return True
        # In a cluster, a queue or subscription on another node may take it.
        return self.edge.wanted_elsewhere(message.topic)

    def _dead_letter_cycle(self, message: Message, raw: bytes, queue: str) -> bool:
        """True if every queue `message` would reach has dead-lettered it before, with no
        rejection on the way: RabbitMQ drops such a message ("Messages in such cycles (i.e.
        messages that reach the same queue twice) will be dropped if there was no rejections
        in the entire cycle", https://www.rabbitmq.com/docs/dlx#routing)."""
        targets = [
            sub.owner.name for sub, filters in self.edge.match(message.topic)
            if isinstance(sub.owner, Queue)
            and (not sub.owner.checked_filters or sub.owner.accepts(message, filters))
        ]
        if not targets:
            return False
        died_in, rejected = _deaths(raw)
        died_in.add(queue)
        return not rejected and all(name in died_in for name in targets)

    def dead_letter(self, queue: Queue, entry: QueueEntry, reason: str) -> None:
        """Republish a dropped message to the queue's dead-letter exchange, if it has one."""
        queue.settle(entry)
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
            transient=original.transient,
        )
        raw = native_properties(original)
        if raw is None:
            raw = properties_from_message(original).marshal()
        if reason != "rejected" and self._dead_letter_cycle(message, raw, queue.name):
            return
        message.native_properties = {NATIVE_FORMAT: dead_lettered_properties(
            raw, reason, queue.name, old_exchange, old_key, first
        )}
        writer = Principal("amqp", queue.writer, "", "dead-lettering")
        if original.topic != queue_topic(queue.name) and not self.edge.authorize(
                writer, Action.SUBSCRIBE, original.topic):
            # Dead-lettering reads the message out of the queue as its declaring user: what
            # that user may not (or no longer) read does not leave through it.
            log.info("queue %r in vhost %r: dead-lettering refused, user %r may not read %r; "
                     "message dropped", queue.name, self.name, queue.writer, original.topic)
            return
        if not self.edge.authorize(writer, Action.PUBLISH, message.topic):
            # As if the dead-letter exchange routed it nowhere: dropped, and said so.
            log.info("queue %r in vhost %r: dead-lettering to exchange %r refused, user %r may "
                     "not publish to %r; message dropped", queue.name, self.name, exchange.name,
                     queue.writer, message.topic)
            return
        try:
            self.edge.publish(message)
        except PublishRejected:
            pass


def _entries(saved: dict[str, Any], part: str) -> list[Any]:
    """The list `part` of a saved topology (a part that is not a list is set aside)."""
    entries = saved.get(part, [])
    if isinstance(entries, list):
        return entries
    set_aside(log, f"{part} of an AMQP topology", entries, ValueError("not a list"))
    return []


def _deaths(raw: bytes) -> tuple[set[str], bool]:
    """Queues named in the x-death header of properties `raw`, and whether any death there
    was a rejection."""
    content = header.ContentHeader()
    content.unmarshal(content_header_payload(raw, 0))
    tables = _death_tables(content.properties.headers or {})
    return {str(d.get("queue")) for d in tables}, any(d.get("reason") == "rejected" for d in tables)


def _death_tables(headers: FieldTable) -> list[FieldTable]:
    """The tables of the x-death array in `headers`; anything else there counts as none."""
    deaths = headers.get("x-death")
    return [d for d in deaths if isinstance(d, dict)] if isinstance(deaths, list) else []


def dead_lettered_properties(
    raw: bytes, reason: str, queue: str, exchange: str, routing_key: str, first: dict[str, str],
    now: datetime.datetime | None = None,
) -> bytes:
    """The original typed properties with RabbitMQ's dead-lettering headers, expiration removed.

    As rabbit_dead_letter:update_x_death_header/2 (RabbitMQ 3.x): `x-death` is an array of
    tables, most recent first, one per (queue, reason); dying again in the same queue for the
    same reason increments that table's `count` (a long) and moves it to the front, keeping its
    other fields. A new table holds count, reason, queue, time, exchange, routing-keys (the
    routing key and any CC keys) and `original-expiration` (when the message had a per-message
    TTL). `x-first-death-reason/queue/exchange` are set on the first death
    only. A first table comes in RabbitMQ's field order (count, reason, queue, time, exchange,
    routing-keys, original-expiration); tables written while an x-death exists are sorted by
    field name. See https://www.rabbitmq.com/docs/dlx#effects."""
    content = header.ContentHeader()
    content.unmarshal(content_header_payload(raw, 0))
    props = content.properties
    headers = dict(props.headers or {})
    deaths = _death_tables(headers)
    same = [d for d in deaths if d.get("queue") == queue and d.get("reason") == reason]
    if same:
        death = dict(sorted(same[0].items()))
        count = death.get("count", 0)
        death["count"] = (count if isinstance(count, int) else 0) + 1
        deaths = [death, *(d for d in deaths if d is not same[0])]
    else:
        routing_keys: FieldArray = [routing_key]
        cc = headers.get("CC")
        if isinstance(cc, list):
            routing_keys.extend(str(k) for k in cc)
        stamp = (now or datetime.datetime.now(datetime.UTC)).replace(microsecond=0, tzinfo=None)
        death = {
            "count": 1, "reason": reason, "queue": queue, "time": stamp, "exchange": exchange,
            "routing-keys": routing_keys,
        }
        expiration = props.expiration
        if expiration:
            death["original-expiration"] = (
                expiration.decode() if isinstance(expiration, bytes) else str(expiration)
            )
        if deaths:
            death = dict(sorted(death.items()))
        deaths.insert(0, death)
    headers["x-death"] = [*deaths]  # a FieldArray (a list of tables is not one to mypy)
    for name, value in first.items():
        headers.setdefault(name, value)
    props.headers = None
    props.expiration = None
    return _with_headers(props.marshal(), headers)


# Basic property flags (AMQP 0-9-1 §4.2.6.1, class basic): content-type, content-encoding,
# headers are the first three.
_CONTENT_TYPE_FLAG, _CONTENT_ENCODING_FLAG, _HEADERS_FLAG = 0x8000, 0x4000, 0x2000


def _with_headers(raw: bytes, headers: dict[str, Any]) -> bytes:
    """Property bytes `raw` (without headers) with `headers` spliced in. pamqp sorts every
    table's fields; RabbitMQ keeps the order it writes x-death tables in, so the table is
    encoded here: top-level names sorted (as RabbitMQ sends them), nested tables in order."""
    flags = int.from_bytes(raw[:2], "big")
    pos = 2
    for flag in (_CONTENT_TYPE_FLAG, _CONTENT_ENCODING_FLAG):
        if flags & flag:
            pos += 1 + raw[pos]
    table = _ordered_table(dict(sorted(headers.items())))
    return (flags | _HEADERS_FLAG).to_bytes(2, "big") + raw[2:pos] + table + raw[pos:]


def _ordered_table(table: dict[str, Any]) -> bytes:
    parts = []
    for name, value in table.items():
        parts.append(encode.short_string(name))
        parts.append(_ordered_value(name, value))
    body = b"".join(parts)
    return len(body).to_bytes(4, "big") + body


def _ordered_value(name: str, value: Any) -> bytes:
    if isinstance(value, dict):
        return b"F" + _ordered_table(value)
    if isinstance(value, list):
        body = b"".join(_ordered_value("", item) for item in value)
        return b"A" + len(body).to_bytes(4, "big") + body
    if name == "count" and isinstance(value, int) and not isinstance(value, bool):
        return b"l" + encode.long_long_int(value)  # x-death count is a long in RabbitMQ
    return encode.encode_table_value(value)


__all__ = ["AMQ_TOPIC", "Exchange", "VirtualHost", "PREDECLARED"]
