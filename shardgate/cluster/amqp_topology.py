"""AMQP exchanges shared by every node of a cluster, through etcd, as RabbitMQ's exchanges are
cluster-wide whether durable or not.

Each exchange declared through any node is one key in etcd, `amqp/<vhost>/exchanges/<name>`
(its type, durable, auto-delete and internal flags and its arguments), and each
exchange-to-exchange binding one key `amqp/<vhost>/xbindings/<binding>`. Every node's watch
applies them to its own virtual host: a client of any node can declare the exchange passively,
redeclare it (406 PRECONDITION_FAILED when a property differs, as in RabbitMQ), bind its queues
to it, publish to it and delete it; the message is routed by topic like any other
(`$amqp/<exchange>/<routing key>`), forwarded to its shard's owner and pushed to the nodes
whose queues are bound. Exchanges are few and change at administrator speed, so etcd is the
right place for them.

- A declare of a name this node does not know is a create-if-absent transaction in etcd
  before its declare-ok: of two nodes declaring it at once, one defines it and the other's
  declare is checked against that definition.
- A passive declare, a bind or a delete naming an exchange this node's view does not know yet
  reads etcd first (it may have been declared elsewhere an instant ago).
- What a node changes itself (`VirtualHost.on_exchanges_changed`) is compared with etcd's keys
  and the difference written.
- The queues bound to an exchange are known on their own nodes only, so a delete with
  if-unused, and an auto-delete exchange losing its last binding here, ask the other live
  nodes (`exchange_in_use`, over the queues' call) before deleting.
- A delete-ok waits until the deletion is committed in etcd and every other live node's watch
  has reached its revision (bounded by `CAUGHT_UP_S`), so a client that deletes an exchange on
  one node and declares or publishes on another right after finds it gone there, as in
  RabbitMQ, where the deletion is one cluster-wide transaction. A declare-ok needs no wait: a
  node that does not know a name reads etcd before it answers or routes.
- A non-durable exchange lives while any node of the cluster does: a node that starts while
  no other node is registered drops the non-durable exchanges (and their exchange bindings)
  left in etcd, as RabbitMQ drops them when its last node stops.

A queue lives on the node where it was declared and is used from every node through it
(`amqp_queues.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from . import keys
from .amqp_queues import SharedQueues

if TYPE_CHECKING:
    from ..core.broker import Broker
    from .amqp_queue_replicas import QueueReplicas
    from .control import ClusterNode
    from .data_plane import DataPlane

log = logging.getLogger(__name__)

EXCHANGES, XBINDINGS = "exchanges", "xbindings"


def exchange_key(vhost: str, name: str) -> str:
    return f"{keys.AMQP}{quote(vhost, safe='')}/{EXCHANGES}/{quote(name, safe='')}"


def binding_key(vhost: str, binding: Any) -> str:
    """The key of an exchange-to-exchange binding (`vhost.ExchangeBinding`)."""
    name = json.dumps(list(binding.key), separators=(",", ":"))
    return f"{keys.AMQP}{quote(vhost, safe='')}/{XBINDINGS}/{quote(name, safe='')}"


def parse_key(key: str) -> tuple[str, str, str] | None:
    """(vhost, kind, name) of an exchange or exchange-binding key, else None."""
    parts = key[len(keys.AMQP):].split("/")
    if len(parts) != 3 or parts[1] not in (EXCHANGES, XBINDINGS):
        return None
    return unquote(parts[0]), parts[1], unquote(parts[2])


def exchange_definition(type_: str, durable: bool, auto_delete: bool, internal: bool,
                        arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": type_, "durable": durable, "auto_delete": auto_delete, "internal": internal,
            "arguments": json.loads(json.dumps(arguments, default=str))}


class SharedExchanges:
    """Keeps every node's AMQP exchanges equal through etcd (module docstring); the
    `remote.ExchangeDirectory` of this node's virtual hosts."""

    def __init__(self, node: ClusterNode, broker: Broker, plane: DataPlane | None = None,
                 replicas: QueueReplicas | None = None) -> None:
        self.node = node
        self.broker = broker
        # the AMQP service, whose virtual hosts are built with this object as their exchange
        # directory (and `queues` as their queue directory): once `install`ed
        self.amqp: Any = None
        self._applying = False
        # the queues: where each lives, and the calls that reach it from other nodes
        self.queues = SharedQueues(node, broker, replicas)
        self._plane = plane
        self._claiming: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # exchange keys being deleted in etcd: the deletion's revision when done
        self._deletions: dict[str, asyncio.Future[int]] = {}

    def install(self, amqp: Any) -> None:
        """The node has joined: take part for `amqp`'s virtual hosts."""
        self.amqp = amqp
        if self._plane is not None:
            self.queues.install(self._plane, amqp)
            self._claiming = asyncio.get_running_loop().create_task(self.queues.claim_restored())
        self.node.document_listeners.append(self._changed_in_etcd)
        if not [node for node in self.node.view.registrations if node != self.node.node_id]:
            self._drop_transient()
        # etcd's exchanges into this node, then this node's (declared before it joined) into etcd
        for key, value in list(self.node.view.documents.items()):
            if key.startswith(keys.AMQP):
                self._changed_in_etcd(key, value)
        for vhost in self.amqp.vhosts.values():
            vhost.use_exchange_directory()
            vhost.on_exchanges_changed.append(self._changed_here)
            self._share(vhost, delete=False)

    def _drop_transient(self) -> None:
        """This node starts a cluster that had stopped entirely: the non-durable exchanges and
        the exchange-to-exchange bindings of those are gone, as RabbitMQ drops them when its
        last node stops. (Each key goes only if nobody wrote it again meanwhile.)"""
        documents = self.node.view.documents
        dropped: dict[str, bytes] = {}
        transient: set[tuple[str, str]] = set()
        for key, value in list(documents.items()):
            parsed = parse_key(key) if key.startswith(keys.AMQP) else None
            if parsed is not None and parsed[1] == EXCHANGES and not keys.decode(value).get("durable", True):
                dropped[key] = value
                transient.add((parsed[0], parsed[2]))
        for key, value in list(documents.items()):
            parsed = parse_key(key) if key.startswith(keys.AMQP) else None
            if parsed is not None and parsed[1] == XBINDINGS:
                binding = keys.decode(value)
                if {(parsed[0], binding.get("source")), (parsed[0], binding.get("destination"))} & transient:
                    dropped[key] = value
        if not dropped:
            return
        for key in dropped:
            del documents[key]
        log.info("cluster: %d non-durable AMQP exchanges and their bindings ended with the "
                 "cluster's last stop; dropped", len(transient))
        # one of this node's writes: joining lets them reach etcd before it reads the whole
        # state again, which would otherwise bring the dropped keys back (and the exchanges
        # with them, until the deletion's watch event) when etcd was slow to delete them
        self.node.writes.run_later(lambda: self._delete_unchanged(dropped))

    async def _delete_unchanged(self, values: dict[str, bytes]) -> None:
        for key, value in values.items():
            full = self.node.key(key)
            try:
                kv = await self.node.state_store.get(full)
                if kv is not None and kv.value == value:
                    await self.node.state_store.delete_unchanged(full, kv.mod_revision)
            except Exception as exc:  # noqa: BLE001 - the next lone start drops it
                log.warning("cluster: cannot drop AMQP %s from etcd: %s", key, exc)

    # ------------------------------------------------------------ this node -> etcd
    def _changed_here(self, vhost: Any) -> None:
        if not self._applying:
            self._share(vhost, delete=True)

    @staticmethod
    def _local_exchanges(vhost: Any) -> dict[str, bytes]:
        from ..protocols.amqp.vhost import PREDECLARED

        return {
            exchange_key(vhost.name, name): keys.encode(exchange_definition(
                e.type, e.durable, e.auto_delete, e.internal, e.arguments))
            for name, e in vhost.exchanges.items() if name not in PREDECLARED
        }

    @staticmethod
    def _local_bindings(vhost: Any) -> dict[str, bytes]:
        from ..protocols.amqp.remote import encode_table

        return {
            binding_key(vhost.name, b): keys.encode({
                "source": b.source, "destination": b.destination, "routing_key": b.routing_key,
                "arguments": encode_table(b.arguments)})
            for b in vhost.exchange_bindings.values()
        }

    def _share(self, vhost: Any, *, delete: bool) -> None:
        documents = self.node.view.documents
        for kind, local in ((EXCHANGES, self._local_exchanges(vhost)),
                            (XBINDINGS, self._local_bindings(vhost))):
            for key, value in local.items():
                if documents.get(key) != value:
                    documents[key] = value
                    self.node.submit(key, value)
            if delete:
                prefix = f"{keys.AMQP}{quote(vhost.name, safe='')}/{kind}/"
                for key in [k for k in documents if k.startswith(prefix) and k not in local]:
                    del documents[key]
                    if kind == EXCHANGES:
                        self._deletions[key] = asyncio.ensure_future(self._delete_in_etcd(key))
                    else:
                        self.node.submit(key, None)

    async def _delete_in_etcd(self, key: str) -> int:
        """Delete an exchange's key now (not after the node's queued writes: its delete-ok
        waits for it); the etcd revision of the deletion, 0 when etcd is away (then the
        queued writer retries it)."""
        try:
            return await self.node.state_store.write(deletes=[self.node.key(key)]) or 0
        except Exception as exc:  # noqa: BLE001 - retried by the node's writer
            log.warning("cluster: cannot delete AMQP exchange %s in etcd yet (%s); retrying", key, exc)
            self.node.submit(key, None)
            return 0
        finally:
            self._deletions.pop(key, None)

    # ------------------------------------------------------------ ExchangeDirectory
    def create(self, vhost: Any, name: str, definition: dict[str, Any]) -> asyncio.Future[None]:
        return asyncio.ensure_future(self._create(vhost, name, definition))

    async def _create(self, vhost: Any, name: str, definition: dict[str, Any]) -> None:
        key = exchange_key(vhost.name, name)
        full = self.node.key(key)
        value = keys.encode(exchange_definition(
            definition["type"], definition["durable"], definition["auto_delete"],
            definition["internal"], definition["arguments"]))
        created, current = await self.node.state_store.create(full, value)
        if created:
            # this declare defines it: the caller declares it here, and `_share` finds the
            # key already written
            self.node.view.documents[key] = value
            return
        if current is not None:
            self._learn(key, current.value)

    def lookup(self, vhost: Any, names: list[str]) -> asyncio.Future[None]:
        return asyncio.ensure_future(self._lookup(vhost, names))

    async def _lookup(self, vhost: Any, names: list[str]) -> None:
        for name in names:
            key = exchange_key(vhost.name, name)
            kv = await self.node.state_store.get(self.node.key(key))
            if kv is not None and name not in vhost.exchanges:
                self._learn(key, kv.value)

    def _learn(self, key: str, value: bytes) -> None:
        """What etcd holds under `key`, applied here before the watch brings it."""
        if self.node.view.documents.get(key) != value:
            self.node.view.documents[key] = value
            self._changed_in_etcd(key, value)

    def in_use_elsewhere(self, vhost: Any, name: str) -> asyncio.Future[bool]:
        return asyncio.ensure_future(self._in_use_elsewhere(vhost.name, name))

    async def _in_use_elsewhere(self, vhost: str, name: str) -> bool:
        me = self.node.node_id
        others = [node for node in self.node.view.nodes() if node != me and self.queues.live(node)]
        if not others:
            return False
        replies = await asyncio.gather(*(
            self.queues.call(node, {"op": "exchange_in_use", "vhost": vhost, "queue": "",
                                    "exchange": name})
            for node in others), return_exceptions=True)
        return any(isinstance(reply, dict) and reply.get("in_use") for reply in replies)

    def auto_delete(self, vhost: Any, name: str) -> None:
        async def check() -> None:
            if not await self._in_use_elsewhere(vhost.name, name):
                vhost.auto_delete(name)

        task = asyncio.get_running_loop().create_task(check())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def deleted(self, vhost: Any, name: str) -> asyncio.Future[None]:
        return asyncio.ensure_future(self._deleted(self._deletions.get(exchange_key(vhost.name, name))))

    async def _deleted(self, deletion: asyncio.Future[int] | None) -> None:
        revision = await deletion if deletion is not None else 0
        if revision:
            await self.queues.peers_caught_up(revision)

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
        kind, name = parsed[1], parsed[2]
        self._applying = True
        try:
            if kind == EXCHANGES:
                if value is None:
                    self._delete(vhost, name)
                else:
                    self._declare(vhost, name, keys.decode(value))
            elif value is None:
                self._unbind(vhost, name)
            else:
                self._bind(vhost, keys.decode(value))
        except Exception as exc:  # noqa: BLE001 - one bad key must not stop the watch
            log.warning("cluster: cannot apply AMQP %s %r of vhost %r from etcd: %s",
                        kind, name, vhost.name, exc)
        finally:
            self._applying = False

    @staticmethod
    def _declare(vhost: Any, name: str, definition: dict[str, Any]) -> None:
        from ..protocols.amqp.vhost import EXCHANGE_TYPES, Exchange

        existing = vhost.exchanges.get(name)
        durable = bool(definition.get("durable", True))
        if existing is not None:
            if existing.type != definition.get("type"):
                log.warning("cluster: AMQP exchange %r is %s here but %s on another node; kept",
                            name, existing.type, definition.get("type"))
            return
        if definition.get("type") not in EXCHANGE_TYPES:
            return
        vhost.add_declared_elsewhere(Exchange(
            name, definition["type"], durable, bool(definition.get("auto_delete")),
            bool(definition.get("internal")), dict(definition.get("arguments") or {})))
        log.info("cluster: AMQP exchange %r declared on another node", name)

    @staticmethod
    def _delete(vhost: Any, name: str) -> None:
        from ..protocols.amqp.vhost import PREDECLARED

        if name in PREDECLARED or name not in vhost.exchanges:
            return
        vhost.delete_exchange(name, False)
        log.info("cluster: AMQP exchange %r deleted on another node", name)

    @staticmethod
    def _bind(vhost: Any, definition: dict[str, Any]) -> None:
        from ..protocols.amqp.remote import decode_table
        from ..protocols.amqp.vhost import ExchangeBinding

        binding = ExchangeBinding(
            str(definition["source"]), str(definition["destination"]),
            str(definition.get("routing_key", "")),
            decode_table(str(definition.get("arguments", ""))))
        vhost.add_exchange_binding(binding)

    @staticmethod
    def _unbind(vhost: Any, name: str) -> None:
        try:
            wanted = json.loads(name)
        except ValueError:
            return
        for key in list(vhost.exchange_bindings):
            if json.loads(json.dumps(list(key))) == wanted:
                vhost.remove_exchange_binding(key)
                return
