"""The schema registry of a cluster: every stream's registered schema versions live in etcd
(`schemas/<stream>`, the versions as the registry hands them out), so that a schema registered
on one node checks publishes on every node, and the archive of every node types its columns
alike.

A registration is made on the node that received it (its registry checks validity and
compatibility against the latest version it knows, which the watch keeps equal to etcd's),
kept in its metadata store as on a single node, and put in etcd; the other nodes' watches load
it into their registries (and their metadata stores). Changes that came from etcd are not
written back. At join, etcd's schemas are loaded, then this node's streams whose schemas etcd
does not hold yet (registered while it ran alone, or from its configuration file) are put there.

Not covered: two nodes registering a new version of one stream at the same moment both
succeed and the later put wins in etcd (each node then loads the winner); registrations are
administrator actions, rare enough for that.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from ..core.schema_registry import SchemaRegistry, SchemaVersion
from . import keys

if TYPE_CHECKING:
    from .control import ClusterNode

log = logging.getLogger(__name__)

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

    def install(self) -> None:
        """etcd's schemas into the registry, this node's missing ones into etcd; from then on
        changes go both ways."""
        self.registry.add_listener(self._changed_here)
        self.node.document_listeners.append(self._changed_in_etcd)
        held = {key[len(keys.SCHEMAS):]: value for key, value in self.node.view.documents.items()
                if key.startswith(keys.SCHEMAS)}
        for stream, value in held.items():
            self._changed_in_etcd(keys.SCHEMAS + stream, value)
        for stream in self.registry.streams():
            if stream not in held:
                self.node.submit(keys.SCHEMAS + stream, encode(self.registry.versions(stream)))

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
