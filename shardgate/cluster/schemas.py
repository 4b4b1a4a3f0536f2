"""The schema registry of a cluster: every stream's registered schema versions live in etcd
(`schemas/<stream>`, the versions as the registry hands them out), so that a schema registered
on one node checks publishes on every node, and the archive of every node types its columns
alike.

A registration through the gRPC Admin service, the CLI or the SDK (`register_ordered`) is a
compare-and-set in etcd: the node reads `schemas/<stream>` and its mod revision, checks the
new version against the latest version etcd holds (validity, compatibility) and writes the
versions with it only while the key is still at that revision. When another node registered
meanwhile, the write is refused and the node checks again against the new latest: a schema
compatible with it becomes the next version (as a registry that orders registrations one at a
time would have it), one that is not is refused (SchemaIncompatible); never does a version
silently replace another. Once in etcd, the version is loaded into this node's registry (and
kept in its metadata store); the other nodes' watches load it into theirs. Changes that came
from etcd are not written back.

At join (`install`), etcd's schemas are loaded, then the streams whose schemas this node holds
and etcd does not (registered while the node ran alone) are created there as they are, only
while etcd holds no versions of that stream (a compare-and-set on the key's absence). Where
another node created them first (two nodes that each ran alone joining at once), its versions
hold: this node loads them and registers its own after them, one by one, through the
compare-and-set above, so each becomes the next version or, incompatible with the latest, is
refused and logged; neither node's versions silently replace the other's. A configured `schema_file` is not written at start in a cluster: it is registered once
the node has joined, through the compare-and-set above (`register_configured_schemas_ordered`
in `shardgate/topology.py`). A change made in this node's registry other than through
`register` (a delete, the registry's synchronous `register`) is put in etcd as it is.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from ..core.errors import CoreError
from ..core.schema_registry import (
    Compatibility,
    SchemaRegistry,
    SchemaRegistryUnavailable,
    SchemaType,
    SchemaVersion,
)
from . import keys

if TYPE_CHECKING:
    from .control import ClusterNode

log = logging.getLogger(__name__)
REGISTER_ATTEMPTS = 5
"""Compare-and-set rounds of one registration before it is refused as busy."""

def encode(versions: list[SchemaVersion]) -> bytes:
    return json.dumps([version.to_dict() for version in versions], sort_keys=True).encode()


def decode(value: bytes) -> list[SchemaVersion]:
    return [SchemaVersion.from_dict(entry) for entry in json.loads(value)]


class SharedSchemas:
    """Keeps a node's schema registry equal to etcd's (see the module docstring)."""

    def __init__(self, node: ClusterNode, registry: SchemaRegistry) -> None:
        self.node = node
        self.registry = registry
        self._from_etcd = False

    async def install(self) -> None:
        """etcd's schemas into the registry, this node's missing ones into etcd (created only
        where etcd holds none: `_put_missing`); from then on changes go both ways, and
        registrations are ordered by etcd (`register`)."""
        self.registry.registrar = self.register
        self.registry.add_listener(self._changed_here)
        self.node.document_listeners.append(self._changed_in_etcd)
        held = {key[len(keys.SCHEMAS):]: value for key, value in self.node.view.documents.items()
                if key.startswith(keys.SCHEMAS)}
        for stream, value in held.items():
            self._changed_in_etcd(keys.SCHEMAS + stream, value)
        for stream in self.registry.streams():
            if stream not in held:
                await self._put_missing(stream, self.registry.versions(stream))

    async def _put_missing(self, stream: str, versions: list[SchemaVersion]) -> None:
        """Create the stream's versions in etcd while it holds none; when another node's came
        first, load them and register this node's after them (see the module docstring)."""
        suffix = keys.SCHEMAS + stream
        value = encode(versions)
        try:
            created, now = await self.node.state_store.create(self.node.key(suffix), value)
        except Exception as exc:  # noqa: BLE001 - etcd away: written once it is back
            log.warning("cluster: schemas of stream %r not created in etcd (%s); writing them "
                        "when it is reachable", stream, exc)
            self.node.view.documents[suffix] = value
            self.node.submit(suffix, value)
            return
        if created:
            self.node.view.documents[suffix] = value
            return
        log.info("cluster: another node registered schemas of stream %r first; registering "
                 "this node's %d version(s) after them", stream, len(versions))
        self._changed_in_etcd(suffix, now.value if now is not None else None)
        for version in versions:
            try:
                await self.register(stream, version.type, version.definition,
                                    version.compatibility)
            except CoreError as exc:  # incompatible with the winner's, or etcd away
                log.warning("cluster: version %d of stream %r, registered on this node alone, "
                            "is not kept: %s", version.version, stream, exc)

    async def register(self, stream: str, kind: SchemaType | str,
                       definition: str | dict[str, Any],
                       compatibility: Compatibility | str | None = None) -> SchemaVersion:
        """Register a version in etcd by compare-and-set, then here (see the module
        docstring). Raises SchemaInvalid, SchemaIncompatible, or SchemaRegistryUnavailable
        when etcd cannot be reached or other registrations keep winning."""
        key = self.node.key(keys.SCHEMAS + stream)
        for _attempt in range(REGISTER_ATTEMPTS):
            try:
                held_kv = await self.node.state_store.get(key)
            except Exception as exc:
                raise SchemaRegistryUnavailable(
                    f"stream {stream!r}: the cluster's schema registry (etcd) cannot be read: "
                    f"{exc}") from exc
            try:
                held = decode(held_kv.value) if held_kv is not None and held_kv.value else []
            except (ValueError, KeyError, TypeError) as exc:
                raise SchemaRegistryUnavailable(
                    f"stream {stream!r}: the schemas etcd holds cannot be read: {exc}") from exc
            version = self.registry.prepare(stream, kind, definition, compatibility, held)
            if held and version is held[-1]:
                self._load(stream, held)
                return version
            value = encode([*held, version])
            try:
                written, _now = await self.node.state_store.put_at(
                    key, held_kv.mod_revision if held_kv is not None else 0, value)
            except Exception as exc:
                raise SchemaRegistryUnavailable(
                    f"stream {stream!r}: the cluster's schema registry (etcd) cannot be "
                    f"written: {exc}") from exc
            if written:
                self._load(stream, [*held, version])
                return version
            log.info("cluster: schemas of stream %r changed while registering; checking "
                     "against the new latest version", stream)
        raise SchemaRegistryUnavailable(
            f"stream {stream!r}: other schema registrations kept changing the stream's versions; "
            "try again")

    def _load(self, stream: str, versions: list[SchemaVersion]) -> None:
        """Versions as etcd holds them into this registry (not written back)."""
        value = encode(versions)
        self.node.view.documents[keys.SCHEMAS + stream] = value
        if versions == self.registry.versions(stream):
            return
        self._from_etcd = True
        try:
            self.registry.replace(stream, versions)
        finally:
            self._from_etcd = False

    def _changed_here(self, stream: str, versions: list[SchemaVersion]) -> None:
        # (the registry's own `on_change` has kept them in this node's metadata store)
        if self._from_etcd:
            return
        key = keys.SCHEMAS + stream
        value = encode(versions) if versions else None
        if self.node.view.documents.get(key) == value:
            return
        if value is None:
            self.node.view.documents.pop(key, None)
        else:
            self.node.view.documents[key] = value
        self.node.submit(key, value)

    def _changed_in_etcd(self, key: str, value: bytes | None) -> None:
        if not key.startswith(keys.SCHEMAS):
            return
        stream = key[len(keys.SCHEMAS):]
        try:
            versions = decode(value) if value else []
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("cluster: ignoring malformed schemas of stream %r in etcd: %s", stream, exc)
            return
        if versions == self.registry.versions(stream):
            return
        self._from_etcd = True
        try:
            if versions:
                self.registry.replace(stream, versions)
            else:
                self.registry.delete(stream)
        except Exception as exc:  # noqa: BLE001 - one bad document must not stop the watch
            log.warning("cluster: schemas of stream %r from etcd not loaded: %s", stream, exc)
        finally:
            self._from_etcd = False
