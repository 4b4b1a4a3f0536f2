"""The plain etcd reads and writes of the cluster's state, as one small typed port.

The modules that keep cluster state in etcd besides the control plane (sessions, durable
subscriptions, wills, delayed messages, AMQP queues and exchanges, schemas, retention floors,
the batched state writer) read and write it through `StateStore`, held by the node as
`ClusterNode.state_store`: reads of one key or a prefix, writes, deletes and the few
conditional writes they need (create if absent, write or delete only while unchanged, a batch
in one transaction). They build no compare or op and hold no etcd client: the client, its
leases and watches are `control.py`'s, and every transaction of the control plane
(registration, election, placement, session claims) is `control_store.ControlStore`'s
(`tests/unit/test_layer_seams.py` holds the rule).

`etcd.EtcdClient` implements it (no wrapper: one call per request, as before); a test can
give a module any object with these methods.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from .etcd import KeyValue


class StateStore(Protocol):
    """What a cluster state module may ask of etcd (module docstring)."""

    async def get(self, key: str) -> KeyValue | None:
        """The key's value and revisions; None when there is no such key."""
        ...

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, and the store revision they were read at."""
        ...

    async def get_keys(self, prefix: str) -> list[str]:
        """The names of every key under `prefix` (no values)."""
        ...

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write `value` at `key`; the revision written."""
        ...

    async def delete(self, key: str) -> bool:
        """Delete `key`; whether it was there."""
        ...

    async def create(self, key: str, value: bytes, lease: int = 0) -> tuple[bool, KeyValue | None]:
        """Write `value` at `key` unless the key exists: (True, None) when written, else
        (False, what the key holds now, None when it went meanwhile)."""
        ...

    async def put_at(self, key: str, mod_revision: int, value: bytes,
                     lease: int = 0) -> tuple[bool, KeyValue | None]:
        """Write `value` at `key` only while the key is at `mod_revision` (0: absent):
        (True, None) when written, else (False, what the key holds now)."""
        ...

    async def write(
        self, puts: Iterable[tuple[str, bytes]] = (), deletes: Iterable[str] = (), *,
        if_at: tuple[str, int] | None = None, lease: int = 0,
    ) -> int | None:
        """Delete `deletes` and write `puts` in one transaction; with `if_at` (a key and its
        mod revision), only while that key is still at that revision. The revision written,
        or None when `if_at` no longer held."""
        ...

    async def delete_unchanged(self, key: str, mod_revision: int) -> bool:
        """Delete `key` only while it is still at `mod_revision`; True when deleted."""
        ...

    async def replace_unchanged(self, key: str, mod_revision: int, value: bytes,
                                lease: int = 0) -> bool:
        """Write `value` at `key` only while it is still at `mod_revision`; True when written."""
        ...
