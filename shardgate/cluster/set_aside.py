"""Cluster state in etcd that cannot be restored: the same rule as every restore of a single
node (`core.restoring`). A record that cannot be read or rebuilt (a session snapshot, a durable
subscription, an AMQP queue's home, a will, a delayed message) is logged once with what it
was and set aside: it stays in etcd, untouched, for an operator to look at, and everything
else is restored. This module reads nothing and writes nothing; it only decides and logs."""

from __future__ import annotations

import logging
from typing import Any

from ..core.restoring import set_aside, shown
from . import keys
from .etcd import KeyValue

# What rebuilding a record from its JSON can raise when the record is not what was written.
UNREADABLE = (ValueError, KeyError, TypeError, AttributeError, IndexError)


def decode_record(raw: bytes) -> dict[str, Any]:
    """A record kept in etcd: a JSON object. ValueError when it is not one."""
    value = keys.decode(raw)
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    return value


class SetAside:
    """Logs each record set aside once per version (a record read again at every scan is not
    logged again until it changes)."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._seen: set[tuple[str, int]] = set()  # (key, revision) or (what, hash of the record)
        self.count = 0

    def __call__(self, what: str, kv: KeyValue | None, error: BaseException, record: Any = None) -> None:
        if kv is not None:
            what = f"{what} (etcd key {kv.key})"
            record = kv.value if record is None else record
        seen = (kv.key, kv.mod_revision) if kv is not None else (what, hash(shown(record)))
        if seen in self._seen:
            return
        if len(self._seen) > 10_000:
            self._seen.clear()
        self._seen.add(seen)
        self.count += 1
        set_aside(self._log, what, record, error)
