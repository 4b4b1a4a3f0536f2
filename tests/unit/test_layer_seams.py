"""The layer rules of issue 27, read from the source: the cluster layer sets no attribute of a
core or protocol object, nor of its own data plane (they reach each other through the typed
ports they are built with and the Edge), and protocols, bridges and admin code reach the
broker through the Edge, not `edge.broker`.

What the cluster layer still sets is listed (`STILL_ASSIGNED`), and what the composition root
still sets on the core and the protocols after building them (`ROOT_STILL_ASSIGNS`): an entry
may go, none may be added.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Names under which cluster code holds core and protocol objects.
CORE_AND_PROTOCOL_NAMES = frozenset({
    "broker", "edge", "service", "mqtt", "amqp", "vhost", "grpc", "grpc_server", "server",
    "session", "cursor", "sub", "subscription", "delayed", "persistence", "placement", "fanout",
    "connection", "queue",
})
# Names under which code holds the cluster's data plane, which gets its collaborators at
# construction too (`cluster/plane_ports.py`: owner reads, replica requests, the peer watch).
DATA_PLANE_NAMES = frozenset({"plane", "data_plane"})
BUILT_WITH_PORTS = CORE_AND_PROTOCOL_NAMES | DATA_PLANE_NAMES

# Assignments still made by the cluster layer, as `name.attribute` of the assigned target:
# none since the MQTT session handover reaches the service through its `RemoteSessions` port
# (issue 27). Never add one.
STILL_ASSIGNED: frozenset[str] = frozenset()


def _base_name(node: ast.expr) -> str | None:
    """The object an attribute is set on, by the name cluster code holds it under: `broker`
    in `broker.x = ...` and in `self.broker.x = ...`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _holder_name(node: ast.expr) -> str | None:
    """The name an assigned-to object is held under, at any depth: `broker` in `broker.x = ...`
    and `self.broker.x = ...`, `delayed` in `self.broker.delayed.x = ...`, `persistence` in
    `app.persistence.x = ...`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _assigned_attributes(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store):
                    name = _holder_name(part.value)
                    if name in BUILT_WITH_PORTS:
                        found.append((node.lineno, f"{name}.{part.attr}"))
    return found


def test_the_cluster_layer_sets_no_attribute_of_a_core_or_protocol_object() -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{line}: {target} = ..."
        for path in sorted((ROOT / "shardgate" / "cluster").rglob("*.py"))
        for line, target in _assigned_attributes(path) + _filled_entries(path)
        if target not in STILL_ASSIGNED
    ]
    assert not offending, (
        "the cluster layer must reach the core and the protocols through their ports and the "
        "Edge, not by setting their attributes:\n" + "\n".join(offending))


def _private_reads(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return sorted(
        (node.lineno, f"{name}.{node.attr}")
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and (name := _base_name(node.value)) in CORE_AND_PROTOCOL_NAMES
    )


def test_the_cluster_layer_uses_no_private_member_of_a_core_or_protocol_object() -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{line}: {target}"
        for path in sorted((ROOT / "shardgate" / "cluster").rglob("*.py"))
        for line, target in _private_reads(path)
    ]
    assert not offending, (
        "the cluster layer calls what the core and the protocols offer (their ports, the Edge, "
        "public methods), not their private members:\n" + "\n".join(offending))


def test_the_rule_sees_a_private_read(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(service, self):\n    service._timers.pop(1)\n"
                      "    self.session._enqueue(2)\n    self._own = 3\n    self.__class__\n")
    assert _private_reads(sample) == [(2, "service._timers"), (3, "session._enqueue")]


def test_the_rule_sees_an_assignment_it_forbids(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(broker, self):\n    broker.hook = 1\n    self.vhost.directory = 2\n"
                      "    self.own = 3\n    plane.peer_gone = 4\n    self.plane.stats.frames = 5\n"
                      "    link.port = 6\n    self.broker.delayed.store = 7\n"
                      "    app.persistence.archiver = 8\n")
    assert _assigned_attributes(sample) == [(2, "broker.hook"), (3, "vhost.directory"),
                                            (5, "plane.peer_gone"), (8, "delayed.store"),
                                            (9, "persistence.archiver")]


# What the composition root (`shardgate/` outside the cluster layer) still sets on a core or
# protocol object after building it, by file: none since the broker is built with its cursor
# sink, its delayed messages' store and the slots its stores fill (`core/store_ports.py`), the
# persistence starts with the archiver, the services offer what the memory alarm and their
# listeners change as methods, and a bridge takes over its restored subscription
# (`DurableSubscription.take_over`) (issue 27). Nor does it fill in a mapping such an object
# holds (`edge.owner_factories[kind] = ...`: the Edge is built with them). Never add one: give
# the object a constructor argument, a typed port.
ROOT_STILL_ASSIGNS: dict[str, frozenset[str]] = {}


def _filled_entries(path: Path) -> list[tuple[int, str]]:
    """Entries set in (or deleted from) a mapping a core or protocol object holds:
    `edge.owner_factories[kind] = ...` is `edge.owner_factories[]`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute):
                name = _holder_name(target.value.value)
                if name in BUILT_WITH_PORTS:
                    found.append((node.lineno, f"{name}.{target.value.attr}[]"))
    return found


def test_the_rule_sees_an_entry_filled_in(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(edge, self):\n    edge.owner_factories['grpc'] = 1\n"
                      "    self.broker.internal_state['t'] = 2\n    self.seen['x'] = 3\n"
                      "    del self.vhost.exchanges['x']\n")
    assert _filled_entries(sample) == [(2, "edge.owner_factories[]"),
                                       (3, "broker.internal_state[]"), (5, "vhost.exchanges[]")]


def test_the_composition_root_sets_no_new_attribute_of_a_core_protocol_or_cluster_object() -> None:
    cluster = ROOT / "shardgate" / "cluster"
    offending = [
        f"{name}:{line}: {target} = ..."
        for path in sorted((ROOT / "shardgate").rglob("*.py")) if cluster not in path.parents
        for line, target in _assigned_attributes(path) + _filled_entries(path)
        if target not in ROOT_STILL_ASSIGNS.get(name := str(path.relative_to(ROOT)), frozenset())
    ]
    assert not offending, (
        "build the object with its collaborator (a constructor argument, a typed port) instead "
        "of setting it afterwards:\n" + "\n".join(offending))


# Outside the core, only the composition root (`shardgate/app.py`, `shardgate/persistence.py`)
# and the cluster layer hold the broker itself; these reach the core through the Edge.
EDGE_CLIENTS = ("protocols", "shardgate/admin", "shardgate/bridges", "shardgate/security")


def _broker_reads(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return sorted(
        node.lineno for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "broker" and isinstance(node.ctx, ast.Load)
    )


def test_protocols_bridges_and_admin_reach_the_broker_only_through_the_edge() -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{line}"
        for folder in EDGE_CLIENTS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line in _broker_reads(path)
    ]
    assert not offending, (
        "protocols, bridges and admin code reach the core through the Edge (`core/edge.py`: "
        "add the method they need there), not `edge.broker`:\n" + "\n".join(offending))


def test_the_rule_sees_a_broker_read(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(edge):\n    edge.broker.stats.drop('x')\n    return edge.stats\n")
    assert _broker_reads(sample) == [2]


def test_nothing_outside_the_core_names_edge_broker() -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in ("protocols", "shardgate", "client")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "edge.broker" in line
    ]
    assert not offending, "\n".join(offending)


# The two modules that build etcd transactions: the client (`etcd.py`, with its named
# conditional writes) and the control plane's store (`control_store.py`: the session registry,
# elections and placement). Every other module writes through one of them.
TRANSACTION_BUILDERS = frozenset({"etcd.py", "control_store.py"})
# Modules that still build etcd transactions of their own: none since the control plane's
# moved to `control_store.py` (issue 27). Never add one.
STILL_BUILDING_TRANSACTIONS: frozenset[str] = frozenset()
TRANSACTION_PARTS = frozenset({"txn", "version_is", "mod_revision_is", "create_revision_is",
                               "put_op", "get_op", "delete_op"})


def _transaction_parts(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            used.update(alias.name for alias in node.names if alias.name in TRANSACTION_PARTS)
        elif isinstance(node, ast.Attribute) and node.attr in TRANSACTION_PARTS:
            used.add(node.attr)
    return sorted(used)


def test_etcd_transactions_are_built_in_one_place() -> None:
    offending = {
        path.name: parts
        for path in sorted((ROOT / "shardgate" / "cluster").glob("*.py"))
        if path.name not in TRANSACTION_BUILDERS and path.name not in STILL_BUILDING_TRANSACTIONS
        and (parts := _transaction_parts(path))
    }
    assert not offending, (
        "etcd transactions go through `cluster/etcd.py` (`EtcdClient.create`, `put_at`, `write`, "
        "`delete_unchanged`, `replace_unchanged`) or, for the control plane, "
        f"`cluster/control_store.py`, not built in other modules: {offending}")


# The modules that hold the etcd client itself: the client (`etcd.py`, with its lease keeper
# `etcd_lease.py`), the node that owns it, its leases and its watch (`control.py`), and the
# control plane's store (`control_store.py`). Every other module reads and writes etcd through
# `ClusterNode.store` (the control plane's transactions) or `ClusterNode.state_store` (the
# plain reads and writes of cluster state: `cluster/state_store.py`).
ETCD_CLIENT_HOLDERS = frozenset({"etcd.py", "etcd_lease.py", "control.py", "control_store.py"})
# Names under which code outside them holds the node (`ClusterNode`), whose `client` it must
# not reach for.
NODE_NAMES = frozenset({"node", "cluster"})


def _etcd_client_uses(path: Path) -> list[tuple[int, str]]:
    """Where a module names `EtcdClient` or reaches a node's `client` (`node.client`,
    `self.node.client`, `self.cluster.client`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name == "EtcdClient"]
        elif isinstance(node, ast.Name) and node.id == "EtcdClient":
            found.append((node.lineno, "EtcdClient"))
        elif (isinstance(node, ast.Attribute) and node.attr == "client"
              and (name := _base_name(node.value)) in NODE_NAMES):
            found.append((node.lineno, f"{name}.client"))
    return sorted(set(found))


def test_only_the_etcd_modules_hold_the_etcd_client() -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{line}: {use}"
        for folder in ("shardgate", "core", "protocols", "storage")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if not (path.parent.name == "cluster" and path.name in ETCD_CLIENT_HOLDERS)
        for line, use in _etcd_client_uses(path)
    ]
    assert not offending, (
        "cluster state is read and written through `ClusterNode.state_store` "
        "(`cluster/state_store.py`) or the control plane's `ClusterNode.store` "
        "(`cluster/control_store.py`), not the etcd client:\n" + "\n".join(offending))


def test_the_rule_sees_a_use_of_the_etcd_client(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from .etcd import EtcdClient, KeyValue\n"
                      "async def f(node, self):\n    await node.client.get('k')\n"
                      "    client = self.node.client\n    await self.cluster.client.close()\n"
                      "    await self.node.state_store.get('k')\n    self.client = 1\n")
    assert _etcd_client_uses(sample) == [(1, "EtcdClient"), (3, "node.client"),
                                         (4, "node.client"), (5, "cluster.client")]
