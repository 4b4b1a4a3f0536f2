"""`cluster.schemas.SharedSchemas` against an in-process stand-in of the cluster node: etcd's
schema versions load into the registry, a registration here is put in etcd once, a change seen
in etcd is loaded and persisted locally but not written back."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from shardgate.core.schema_registry import (
    SchemaIncompatible,
    SchemaRegistry,
    SchemaRegistryUnavailable,
)

from shardgate.cluster import keys
from shardgate.cluster.etcd import KeyValue
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


class Etcd:
    """An in-process stand-in of etcd's key space: values with mod revisions, and the
    compare-and-set `put_at`. `before_put` runs once before the next `put_at` (another node
    registering between this node's read and its write)."""

    def __init__(self) -> None:
        self.revision = 0
        self.data: dict[str, tuple[bytes, int]] = {}
        self.before_put: Callable[[], Awaitable[None]] | None = None

    async def get(self, key: str) -> KeyValue | None:
        if key not in self.data:
            return None
        value, revision = self.data[key]
        return KeyValue(key, value, revision, revision, 0)

    async def create(self, key: str, value: bytes,
                     lease: int = 0) -> tuple[bool, KeyValue | None]:
        return await self.put_at(key, 0, value, lease)

    async def put_at(self, key: str, mod_revision: int, value: bytes,
                     lease: int = 0) -> tuple[bool, KeyValue | None]:
        if self.before_put is not None:
            hook, self.before_put = self.before_put, None
            await hook()
        if self.data.get(key, (b"", 0))[1] != mod_revision:
            return False, await self.get(key)
        self.revision += 1
        self.data[key] = (value, self.revision)
        return True, None


@dataclass
class EtcdNode(Node):
    state_store: Etcd = field(default_factory=Etcd)

    def key(self, suffix: str) -> str:
        return "/sg/" + suffix


async def test_schemas_follow_etcd_and_registrations_go_there_once() -> None:
    persisted: list[tuple[str, int]] = []
    other = SchemaRegistry()
    other.register("held", "json", SCHEMA)
    node = EtcdNode()
    node.view.documents[keys.SCHEMAS + "held"] = encode(other.versions("held"))
    registry = SchemaRegistry(on_change=lambda stream, versions: persisted.append(
        (stream, len(versions))))
    registry.register("mine", "json", SCHEMA)  # registered before the node joined
    persisted.clear()
    await SharedSchemas(node, registry).install()  # type: ignore[arg-type]
    assert registry.versions("held") == other.versions("held")
    assert persisted == [("held", 1)]  # kept in the node's own store too
    # the stream etcd lacked is created there (a compare-and-set, not a blind put)
    assert decode(node.state_store.data["/sg/" + keys.SCHEMAS + "mine"][0]) == \
        registry.versions("mine")
    assert not node.submitted

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


async def two_nodes() -> tuple[SharedSchemas, SharedSchemas]:
    etcd = Etcd()
    shared = []
    for _ in range(2):
        shared.append(SharedSchemas(EtcdNode(state_store=etcd), SchemaRegistry()))  # type: ignore[arg-type]
        await shared[-1].install()
    return shared[0], shared[1]


async def test_a_registration_that_loses_the_race_is_checked_against_the_winner() -> None:
    """Two nodes register a version of one stream at once: etcd takes the first write; the
    other node's compare-and-set is refused and it checks its schema again against the
    version that won, which it extends (version 2, not a second version 1 replacing it)."""
    first, second = await two_nodes()
    etcd = first.node.state_store
    assert (await first.registry.register_ordered("s", "json", SCHEMA)).version == 1

    async def meanwhile() -> None:  # n2 registers between n1's read and n1's write
        assert (await second.registry.register_ordered("s", "json", WIDER)).version == 2

    etcd.before_put = meanwhile
    widest = {**WIDER, "properties": {**WIDER["properties"], "v": {"type": "string"}}}
    version = await first.registry.register_ordered("s", "json", widest)
    assert version.version == 3
    held = decode(etcd.data["/sg/" + keys.SCHEMAS + "s"][0])
    assert [(v.version, v.parsed) for v in held] == [(1, SCHEMA), (2, WIDER), (3, widest)]
    assert first.registry.versions("s") == held  # loaded here at once, not written back
    assert not first.node.submitted and not second.node.submitted


async def test_a_registration_incompatible_with_the_winner_is_refused() -> None:
    first, second = await two_nodes()
    etcd = first.node.state_store
    await first.registry.register_ordered("s", "json", SCHEMA)
    closed = {**WIDER, "additionalProperties": False}

    async def meanwhile() -> None:
        await second.registry.register_ordered("s", "json", closed)

    etcd.before_put = meanwhile
    # backward from version 2 (closed): a reader of 3 must read what 2 accepted; 3 drops "u"
    # from the properties and closes them too, so a payload with "u" is no longer accepted
    narrower = {"type": "object", "properties": {"t": {"type": "number"}},
                "required": ["t"], "additionalProperties": False}
    with pytest.raises(SchemaIncompatible, match="version 2"):
        await first.registry.register_ordered("s", "json", narrower)
    held = decode(etcd.data["/sg/" + keys.SCHEMAS + "s"][0])
    assert [v.version for v in held] == [1, 2]


async def test_a_registry_that_keeps_losing_says_so() -> None:
    first, _second = await two_nodes()
    etcd = first.node.state_store

    async def put_at(key: str, mod_revision: int, value: bytes,
                     lease: int = 0) -> tuple[bool, KeyValue | None]:
        return False, None

    etcd.put_at = put_at  # type: ignore[method-assign]
    with pytest.raises(SchemaRegistryUnavailable, match="try again"):
        await first.registry.register_ordered("s", "json", SCHEMA)
    assert first.registry.versions("s") == []


async def test_two_nodes_that_ran_alone_join_at_once_and_keep_each_others_versions() -> None:
    """Each node registered a schema of one stream while it ran alone; both join at once, each
    reading etcd before either writes. etcd takes the first node's versions as they are; the
    second's create is refused, it loads the first's and registers its own after them
    (version 2), so both nodes and etcd end with both schemas, neither replacing the other."""
    etcd = Etcd()
    nodes = [EtcdNode(state_store=etcd), EtcdNode(state_store=etcd)]
    registries = [SchemaRegistry(), SchemaRegistry()]
    registries[0].register("s", "json", SCHEMA)
    registries[1].register("s", "json", WIDER)
    shared = [SharedSchemas(node, registry)  # type: ignore[arg-type]
              for node, registry in zip(nodes, registries, strict=True)]

    async def meanwhile() -> None:  # node 1 joins between node 2's read of etcd and its write
        await shared[0].install()

    etcd.before_put = meanwhile
    await shared[1].install()
    held = decode(etcd.data["/sg/" + keys.SCHEMAS + "s"][0])
    assert [(v.version, v.parsed) for v in held] == [(1, SCHEMA), (2, WIDER)]
    assert registries[1].versions("s") == held  # the loser loaded the winner's, then its own
    for listener in nodes[0].document_listeners:  # the winner hears of version 2 by its watch
        listener(keys.SCHEMAS + "s", etcd.data["/sg/" + keys.SCHEMAS + "s"][0])
    assert registries[0].versions("s") == held
    assert not nodes[0].submitted and not nodes[1].submitted


async def test_a_version_registered_alone_that_breaks_the_winners_is_refused_not_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    etcd = Etcd()
    nodes = [EtcdNode(state_store=etcd), EtcdNode(state_store=etcd)]
    registries = [SchemaRegistry(), SchemaRegistry()]
    registries[0].register("s", "json", WIDER)
    closed = {"type": "object", "properties": {"t": {"type": "number"}}, "required": ["t"],
              "additionalProperties": False}
    registries[1].register("s", "json", closed)  # backward from WIDER: a "u" is refused
    shared = [SharedSchemas(node, registry)  # type: ignore[arg-type]
              for node, registry in zip(nodes, registries, strict=True)]

    async def meanwhile() -> None:
        await shared[0].install()

    etcd.before_put = meanwhile
    await shared[1].install()
    held = decode(etcd.data["/sg/" + keys.SCHEMAS + "s"][0])
    assert [(v.version, v.parsed) for v in held] == [(1, WIDER)]
    assert registries[1].versions("s") == held
    assert "is not kept" in caplog.text and "version 1" in caplog.text
