"""`cluster.schemas.SharedSchemas` against an in-process stand-in of the cluster node: etcd's
schema versions load into the registry, a registration here is put in etcd once, a change seen
in etcd is loaded and persisted locally but not written back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardgate.core.schema_registry import SchemaRegistry

from shardgate.cluster import keys
from shardgate.cluster.schemas import SharedSchemas, decode, encode

SCHEMA = {"type": "object", "properties": {"t": {"type": "number"}}, "required": ["t"]}
WIDER = {"type": "object", "properties": {"t": {"type": "number"}, "u": {"type": "string"}},
         "required": ["t"]}


@dataclass
class View:
    documents: dict[str, bytes] = field(default_factory=dict)


@dataclass
class Node:
    view: View = field(default_factory=View)
    document_listeners: list[Any] = field(default_factory=list)
    submitted: list[tuple[str, bytes | None]] = field(default_factory=list)

    def submit(self, suffix: str, value: bytes | None) -> None:
        self.submitted.append((suffix, value))


def test_schemas_follow_etcd_and_registrations_go_there_once() -> None:
    persisted: list[tuple[str, int]] = []
    other = SchemaRegistry()
    other.register("held", "json", SCHEMA)
    node = Node()
    node.view.documents[keys.SCHEMAS + "held"] = encode(other.versions("held"))
    registry = SchemaRegistry(on_change=lambda stream, versions: persisted.append(
        (stream, len(versions))))
    registry.register("mine", "json", SCHEMA)  # registered before the node joined
    persisted.clear()
    SharedSchemas(node, registry).install()  # type: ignore[arg-type]
    assert registry.versions("held") == other.versions("held")
    assert persisted == [("held", 1)]  # kept in the node's own store too
    assert [suffix for suffix, _value in node.submitted] == [keys.SCHEMAS + "mine"]

    # a registration here goes to etcd, once
    node.submitted.clear()
    registry.register("held", "json", WIDER)
    ((suffix, value),) = node.submitted
    assert suffix == keys.SCHEMAS + "held" and value is not None
    assert [v.version for v in decode(value)] == [1, 2]

    # a version another node registered arrives through the watch: loaded, not written back
    node.submitted.clear()
    other.register("mine", "json", SCHEMA)
    other.register("mine", "json", WIDER)
    for listener in node.document_listeners:
        listener(keys.SCHEMAS + "mine", encode(other.versions("mine")))
    assert [v.version for v in registry.versions("mine")] == [1, 2]
    assert registry.checks["mine"] is not None and not node.submitted
    # and a deletion in etcd forgets the stream's schemas
    for listener in node.document_listeners:
        listener(keys.SCHEMAS + "mine", None)
    assert registry.versions("mine") == [] and not node.submitted
