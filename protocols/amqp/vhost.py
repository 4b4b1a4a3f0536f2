"""A virtual host: its exchanges and queues, and the AMQP rules for declaring and deleting them.

Operations raise `ChannelException`/`ConnectionException` with the reply code the spec (and
RabbitMQ) gives: 404 for a missing entity, 406 for an inequivalent redeclaration or a failed
if-unused/if-empty, 403 for the reserved `amq.` names, 405 for another connection's exclusive
queue, 503 for an unknown exchange type. Queues are core subscriptions named
`amqp:<vhost>:<queue>`; bindings are core filters (see `routing`). A durable queue (when the
broker has a journal) is a core *durable* subscription, so its messages and acknowledgements
survive a restart.

`VirtualHost` holds the state and is assembled from parts, one concern each: `exchanges.py`
(exchanges and exchange-to-exchange bindings), `topology_record.py` (the durable topology
saved and restored), `dead_letters.py` (dead-lettering); this module has the queues, their
bindings and routing; `refusals.py` the reply texts.
"""

from __future__ import annotations

import base64
import logging
import os
from typing import TYPE_CHECKING, Any

from pamqp import commands

from ...core.durable import DurableOptions, DurableSubscription
from ...core.errors import SubscriptionBusy
from ...core.message import Message, now_ms
from ...core.subscriptions import Subscription, SubscriptionType
from .dead_letters import DeadLettering
from .errors import ChannelException, ReplyCode
from .exchanges import (  # noqa: F401  (re-exported: cluster code and tests import them here)
    EXCHANGE_TYPES,
    PREDECLARED,
    Exchange,
    ExchangeBinding,
    ExchangeGraph,
)
from .queues import Queue
from .refusals import _arg_difference, _erl, _err, _field_type
from .routing import AMQ_TOPIC, binding_for, queue_topic
from .topology_record import TopologyRecord

if TYPE_CHECKING:
    from ...core.edge import Edge
    from .remote import ExchangeDirectory, QueueDirectory

log = logging.getLogger(__name__)

# A durable queue settles every message itself (ack, reject, expiry, purge): no ack timeout,
# no core dead-lettering; its buffer is handed back when the queue object goes away.
DURABLE_QUEUE_OPTIONS = DurableOptions(ack_timeout_s=None, max_deliveries=0, redeliver_on_leave=True)
_QUEUE_INT_ARGS = (
    "x-message-ttl", "x-expires", "x-max-length", "x-max-length-bytes", "x-max-priority",
)


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


class VirtualHost(ExchangeGraph, TopologyRecord, DeadLettering):
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
        sub.belongs_to(queue)
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



__all__ = ["AMQ_TOPIC", "EXCHANGE_TYPES", "Exchange", "ExchangeBinding", "VirtualHost", "PREDECLARED"]
