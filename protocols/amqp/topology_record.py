"""A virtual host's durable topology, saved and restored: the durable exchanges, queue
arguments and bindings are recorded as a retained message under
`$internal/amqp/topology/<vhost>` (internal broker state, persisted by the composition root
like retained messages, never seen by clients), and `restore()` rebuilds them at start; the
queues' messages come back from their durable subscriptions' cursors.

A part of `VirtualHost` (`vhost.py`), which holds the state.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from ...core.broker import INTERNAL_PREFIX
from ...core.durable import DurableSubscription
from ...core.message import Message
from ...core.restoring import set_aside
from ...core.subscriptions import Subscription
from .exchanges import EXCHANGE_TYPES, PREDECLARED, Exchange, ExchangeBinding
from .queues import Queue
from .routing import PREFIX, binding_for, escape

if TYPE_CHECKING:
    from ...core.edge import Edge

log = logging.getLogger("shardgate.protocols.amqp.vhost")

# Retained record of a vhost's durable exchanges, queues and bindings (`$` keeps it clear of
# exchange names, which cannot contain one).
TOPOLOGY_PREFIX = INTERNAL_PREFIX + "amqp/topology/"
# Where earlier versions kept it: as a retained message any `$amqp/#` subscriber could see.
LEGACY_TOPOLOGY_PREFIX = PREFIX + "$topology/"


class TopologyRecord:
    """The saved-topology part of `VirtualHost` (no state of its own)."""

    name: str
    edge: Edge
    exchanges: dict[str, Exchange]
    queues: dict[str, Queue]
    exchange_bindings: dict[tuple[str, str, str, tuple[tuple[str, str], ...]], ExchangeBinding]

    if TYPE_CHECKING:  # provided by the other parts of VirtualHost (`vhost.py`)
        def _durable_binding(self, binding: ExchangeBinding) -> bool: ...

        def _subscription_name(self, queue: str) -> str: ...

        def _make_queue(
            self, name: str, sub: Subscription, *, durable: bool, exclusive_owner: object | None,
            auto_delete: bool, arguments: dict[str, Any],
        ) -> Queue: ...

        def rederive(self, queue: Queue) -> None: ...

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
        queues = [self.queue_entry(q) for q in self.queues.values()
                  if q.durable and q.exclusive_owner is None]
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

    @staticmethod
    def queue_entry(queue: Queue) -> dict[str, Any]:
        """A durable queue's definition as saved (its name, arguments, bindings, declaring
        user): what `restore` and `adopt_queue` rebuild it from."""
        return {"name": queue.name, "auto_delete": queue.auto_delete, "arguments": queue.arguments,
                "writer": queue.writer,
                "bindings": [[b.exchange, b.routing_key, list(b.arguments)]
                             for b in queue.bindings.values() if b.exchange]}

    def adopt_queue(self, entry: dict[str, Any], sub: DurableSubscription) -> Queue:
        """Make the durable queue `entry` (a `queue_entry`, JSON-decoded) here over `sub`, its
        durable subscription with its cursors already placed: a queue another node of a
        cluster served, taken over. Saved with the topology."""
        name = str(entry["name"])
        queue = self._restore_queue(name, sub, entry)
        self.save_topology()
        return queue

    def _restore_queue(self, name: str, sub: DurableSubscription, entry: dict[str, Any]) -> Queue:
        queue = self._make_queue(
            name, sub, durable=True, exclusive_owner=None,
            auto_delete=bool(entry.get("auto_delete")),
            arguments=dict(entry.get("arguments") or {}),
        )
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
        return queue

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
                self._restore_queue(name, sub, entry)
            except Exception as exc:
                set_aside(log, f"queue {name!r} of vhost {self.name!r}", entry, exc)
                continue
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


def _entries(saved: dict[str, Any], part: str) -> list[Any]:
    """The list `part` of a saved topology (a part that is not a list is set aside)."""
    entries = saved.get(part, [])
    if isinstance(entries, list):
        return entries
    set_aside(log, f"{part} of an AMQP topology", entries, ValueError("not a list"))
    return []
