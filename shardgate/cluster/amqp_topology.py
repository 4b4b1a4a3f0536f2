"""AMQP exchanges shared by every node of a cluster, through etcd.

A durable exchange declared (or deleted) through any node is one key in etcd,
`amqp/<vhost>/exchanges/<name>` (its type, flags and arguments), which every node's watch
applies to its own virtual host: a client of another node can declare it passively, bind its
queues to it and publish to it; the message is routed by topic like any other (`$amqp/<exchange>/
<routing key>`), forwarded to its shard's owner and pushed to the nodes whose queues are bound.
Exchanges are few and change at administrator speed, so etcd is the right place for them.

What a node changes is seen where every virtual host saves its durable topology (its internal
state `$internal/amqp/topology/<vhost>`); the exchanges of that document are compared with
etcd's and the difference is written. A queue lives on the node where it was declared and is
used from every node through it (`amqp_queues.py`); non-durable exchanges are the declaring
node's own, as they end with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from . import keys
from .amqp_queues import SharedQueues

if TYPE_CHECKING:
    from ..core.broker import Broker
    from ..core.message import Message
    from .control import ClusterNode
    from .forward import DataPlane

log = logging.getLogger(__name__)



def exchange_key(vhost: str, name: str) -> str:
    return f"{keys.AMQP}{quote(vhost, safe='')}/exchanges/{quote(name, safe='')}"


def parse_key(key: str) -> tuple[str, str] | None:
    parts = key[len(keys.AMQP):].split("/")
    if len(parts) != 3 or parts[1] != "exchanges":
        return None
    return unquote(parts[0]), unquote(parts[2])


class SharedExchanges:
    """Keeps every node's durable AMQP exchanges equal through etcd (module docstring)."""

    def __init__(self, node: ClusterNode, broker: Broker, amqp: Any,
                 plane: DataPlane | None = None) -> None:
        self.node = node
        self.broker = broker
        self.amqp = amqp
        self._keep: Callable[[str, Message | None], None] | None = None
        self._applying = False
        # the queues: where each lives, and the calls that reach it from other nodes
        self.queues = SharedQueues(node, broker, amqp)
        self._plane = plane
        self._claiming: asyncio.Task[None] | None = None

    def install(self) -> None:
        if self._plane is not None:
            self.queues.install(self._plane)
            self._claiming = asyncio.get_running_loop().create_task(self.queues.claim_restored())
        broker = self.broker
        self._keep, broker.on_retained_change = broker.on_retained_change, self._changed_here
        self.node.document_listeners.append(self._changed_in_etcd)
        # etcd's exchanges into this node, then this node's (declared before it joined) into etcd
        for key, value in list(self.node.view.documents.items()):
            if key.startswith(keys.AMQP):
                self._changed_in_etcd(key, value)
        for vhost in self.amqp.vhosts.values():
            self._share(vhost.name, self._local_exchanges(vhost), delete=False)

    # ------------------------------------------------------------ this node -> etcd
    def _changed_here(self, topic: str, message: Message | None) -> None:
        if self._keep is not None:
            self._keep(topic, message)
        from ..protocols.amqp.vhost import TOPOLOGY_PREFIX

        if not topic.startswith(TOPOLOGY_PREFIX) or self._applying:
            return
        vhost = self._vhost_for(topic)
        if vhost is not None:
            self._share(vhost.name, self._local_exchanges(vhost), delete=True)

    def _vhost_for(self, topic: str) -> Any:
        for vhost in self.amqp.vhosts.values():
            if vhost.topology_topic == topic:
                return vhost
        return None

    @staticmethod
    def _local_exchanges(vhost: Any) -> dict[str, dict[str, Any]]:
        from ..protocols.amqp.vhost import PREDECLARED

        return {
            name: {"type": e.type, "auto_delete": e.auto_delete, "internal": e.internal,
                   "arguments": json.loads(json.dumps(e.arguments, default=str))}
            for name, e in vhost.exchanges.items() if e.durable and name not in PREDECLARED
        }

    def _share(self, vhost: str, exchanges: dict[str, dict[str, Any]], *, delete: bool) -> None:
        documents = self.node.view.documents
        prefix = exchange_key(vhost, "")
        for name, definition in exchanges.items():
            key = exchange_key(vhost, name)
            value = keys.encode(definition)
            if documents.get(key) != value:
                documents[key] = value
                self.node.submit(key, value)
        if delete:
            for key in [k for k in documents if k.startswith(prefix)]:
                parsed = parse_key(key)
                if parsed is not None and parsed[1] not in exchanges:
                    del documents[key]
                    self.node.submit(key, None)

    # ------------------------------------------------------------ etcd -> this node
    def _changed_in_etcd(self, key: str, value: bytes | None) -> None:
        if not key.startswith(keys.AMQP):
            return
        parsed = parse_key(key)
        if parsed is None:
            return
        vhost = self.amqp.vhosts.get(parsed[0])
        if vhost is None:
            return
        name = parsed[1]
        self._applying = True
        try:
            if value is None:
                self._delete(vhost, name)
            else:
                self._declare(vhost, name, keys.decode(value))
        except Exception as exc:  # noqa: BLE001 - one bad key must not stop the watch
            log.warning("cluster: cannot apply AMQP exchange %r of vhost %r from etcd: %s",
                        name, vhost.name, exc)
        finally:
            self._applying = False

    @staticmethod
    def _declare(vhost: Any, name: str, definition: dict[str, Any]) -> None:
        from ..protocols.amqp.vhost import EXCHANGE_TYPES, Exchange

        existing = vhost.exchanges.get(name)
        if existing is not None:
            if existing.type != definition.get("type"):
                log.warning("cluster: AMQP exchange %r is %s here but %s on another node; kept",
                            name, existing.type, definition.get("type"))
            return
        if definition.get("type") not in EXCHANGE_TYPES:
            return
        vhost.exchanges[name] = Exchange(
            name, definition["type"], True, bool(definition.get("auto_delete")),
            bool(definition.get("internal")), dict(definition.get("arguments") or {}))
        vhost.save_topology()
        log.info("cluster: AMQP exchange %r declared on another node", name)

    @staticmethod
    def _delete(vhost: Any, name: str) -> None:
        from ..protocols.amqp.vhost import PREDECLARED

        if name in PREDECLARED or name not in vhost.exchanges:
            return
        vhost.delete_exchange(name, False)
        log.info("cluster: AMQP exchange %r deleted on another node", name)
