"""`StateWriter`: the background writer of the state a node keeps in etcd for the others
(MQTT session snapshots, durable subscriptions' and wills' records): the latest value per
key, in order, batched, retried while etcd is away.

Puts queued one after another go to etcd together, up to `MAX_BATCH_PUTS` keys and
`MAX_BATCH_BYTES` per transaction, one transaction at a time: a node's writes cost etcd one
request per batch. Every write goes through the node's `StateStore` (`state_store.py`); this
module decides nothing about what is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .set_aside import decode_record
from .waits import wait_within

if TYPE_CHECKING:
    from .control import ClusterNode


log = logging.getLogger(__name__)

# One etcd transaction of the state writer holds at most this many puts (etcd's
# --max-txn-ops is 128) and this many bytes of values (its request limit is 1.5 MiB).
MAX_BATCH_PUTS = 100
MAX_BATCH_BYTES = 1_000_000


def holder_in(raw: bytes) -> Any:
    """The node a record kept in etcd names (`node`); None when it cannot be read."""
    try:
        return decode_record(raw).get("node")
    except ValueError:
        return None


class _Put:
    """A queued put whose value is made when it is written (`make`: bytes, or None to skip)."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], bytes | None]) -> None:
        self.make = make


class StateWriter:
    """Writes snapshots to etcd in the background, the latest per key, in order, retrying
    while etcd is away. A value is made when it is written (`make` returns the bytes to put,
    or None to skip), so a burst of changes is one write. Puts queued one after another go
    to etcd together, up to `MAX_BATCH_PUTS` keys and `MAX_BATCH_BYTES` per transaction, one
    transaction at a time: a node's writes cost etcd one request per batch."""

    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        self._pending: dict[str, _Put | Callable[[], Awaitable[None]]] = {}
        self._wake = asyncio.Event()
        # set while nothing is queued or being written
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self.batches = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def put(self, key: str, make: Callable[[], bytes | None], *, replace: bool = True) -> None:
        """Queue a put of `key`; with `replace` False, a change of `key` already queued (which
        writes the state of its own moment) stays and this one is dropped."""
        if not replace and key in self._pending:
            return
        self._queue(key, _Put(make))

    def delete_if_mine(self, key: str, still_gone: Callable[[], bool]) -> None:
        """Delete `key` if its snapshot names this node (another may hold it by now)."""
        async def delete() -> None:
            if not still_gone():
                return
            kv = await self.node.state_store.get(key)
            if kv is None or holder_in(kv.value) != self.node.node_id:
                return
            await self.node.state_store.delete_unchanged(key, kv.mod_revision)
        self._queue(key, delete)

    def run(self, key: str, write: Callable[[], Awaitable[None]]) -> None:
        """Queue `write` as the latest change of `key` (it replaces one not yet made)."""
        self._queue(key, write)

    def _queue(self, key: str, write: _Put | Callable[[], Awaitable[None]]) -> None:
        self._pending.pop(key, None)
        self._pending[key] = write
        self._idle.clear()
        self._wake.set()

    def _take_puts(self) -> list[tuple[str, _Put]]:
        """The puts at the head of the queue, as many as one transaction takes."""
        taken: list[tuple[str, _Put]] = []
        for key, write in self._pending.items():
            if not isinstance(write, _Put) or len(taken) >= MAX_BATCH_PUTS:
                break
            taken.append((key, write))
        for key, _write in taken:
            del self._pending[key]
        return taken

    async def _write_puts(self, puts: list[tuple[str, _Put]]) -> None:
        """Put the values made now, in transactions of at most `MAX_BATCH_BYTES` (one larger
        value goes alone)."""
        chunk: list[tuple[str, bytes]] = []
        size = 0
        for key, put in puts:
            value = put.make()
            if value is None:
                continue
            if chunk and size + len(value) > MAX_BATCH_BYTES:
                await self.node.state_store.write(chunk)
                self.batches += 1
                chunk, size = [], 0
            chunk.append((key, value))
            size += len(value)
        if chunk:
            await self.node.state_store.write(chunk)
            self.batches += 1

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                puts = self._take_puts()
                if puts:
                    try:
                        await self._write_puts(puts)
                    except Exception as exc:  # noqa: BLE001 - retried while etcd is away
                        log.warning("cluster: cannot write %d snapshots to etcd yet (%s); retrying",
                                    len(puts), exc)
                        for key, put in puts:
                            self._pending.setdefault(key, put)
                        await asyncio.sleep(0.5)
                    continue
                key = next(iter(self._pending))
                write = self._pending.pop(key)
                assert not isinstance(write, _Put)
                try:
                    await write()
                except Exception as exc:  # noqa: BLE001 - retried while etcd is away
                    log.warning("cluster: cannot write %s to etcd yet (%s); retrying", key, exc)
                    self._pending.setdefault(key, write)
                    await asyncio.sleep(0.5)
            self._idle.set()

    async def drain(self, timeout_s: float = 2.0) -> None:
        """Wait (bounded) until every queued write is made: a graceful stop's last snapshots,
        before the node's cluster port closes (`SessionHandover._take_now` reads them then)."""
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                await wait_within(self._idle.wait(), timeout_s)

    async def stop(self, drain_s: float = 2.0) -> None:
        if self._task is None:
            return
        await self.drain(drain_s)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
