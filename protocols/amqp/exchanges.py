"""A virtual host's exchanges and exchange-to-exchange bindings: declare and delete with
RabbitMQ's equivalence checks, auto-delete, and the routes a queue gets through exchange
bindings (`rederive`: to each queue bound downstream, the filter of the source exchange plus a
check of every hop, so a message reaches a queue once whatever the paths).

A part of `VirtualHost` (`vhost.py`), which holds the state; queues, their bindings and the
saved topology are in the other parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from pamqp import commands

from .errors import ConnectionException, ReplyCode
from .frames import method_ids
from .queues import Queue
from .refusals import _arg_difference, _erl, _err
from .routing import Binding, HeaderCheck, all_of, binding_for, header_value, hop_check

if TYPE_CHECKING:
    from ...core.edge import Edge
    from .remote import ExchangeDirectory
    from .vhost import VirtualHost

EXCHANGE_TYPES = ("direct", "fanout", "topic", "headers")
PREDECLARED = {
    "": "direct",
    "amq.direct": "direct",
    "amq.fanout": "fanout",
    "amq.topic": "topic",
    "amq.headers": "headers",
    "amq.match": "headers",
}


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


class ExchangeGraph:
    """The exchanges part of `VirtualHost` (no state of its own)."""

    name: str
    edge: Edge
    exchanges: dict[str, Exchange]
    queues: dict[str, Queue]
    exchange_bindings: dict[tuple[str, str, str, tuple[tuple[str, str], ...]], ExchangeBinding]
    exchange_directory: ExchangeDirectory | None
    on_exchanges_changed: list[Any]
    on_exchange_bound: list[Any]

    if TYPE_CHECKING:  # provided by the other parts of VirtualHost (`vhost.py`)
        def save_topology(self) -> None: ...

        def _remove_binding(self, queue: Queue, key: tuple[str, str, tuple[tuple[str, str], ...]]) -> None: ...

    def _exchanges_changed(self) -> None:
        for callback in self.on_exchanges_changed:
            callback(self)

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

    def add_declared_elsewhere(self, exchange: Exchange) -> None:
        """An exchange another node of the cluster declared: kept here as one declared here
        is (saved when durable), without telling `on_exchanges_changed` (it came from there)."""
        self.exchanges[exchange.name] = exchange
        if exchange.durable:
            self.save_topology()

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
            self.exchange_directory.auto_delete(cast("VirtualHost", self), name)
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
