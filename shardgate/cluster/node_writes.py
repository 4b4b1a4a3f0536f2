"""This node's background writes to etcd, in the order they were asked for: catalog keys put
or deleted by synchronous code (the broker's topology sink, the MQTT service, in-sync set
proposals), session registry claims and releases, and the deletion of the non-durable AMQP
exchanges a lone start drops (`amqp_topology.py`), run one at a time by one task.

A catalog write is retried until etcd takes it; a registry write is tried a bounded number
of times. `pending` counts what is queued or running: the node lets its own writes reach
etcd before it reads the whole state again, or they would look undone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from .control_store import ControlStore

log = logging.getLogger(__name__)

# a background registry write (claim, release) is tried this many times while etcd fails
REGISTRY_WRITE_ATTEMPTS = 20


class NodeWrites:
    """One queue of writes, run in order by `run()` while `running()`."""

    def __init__(self, store: ControlStore, lease: Callable[[], int],
                 running: Callable[[], bool]) -> None:
        self._store = store
        self._lease = lease
        self._running = running
        self._queue: asyncio.Queue[
            tuple[str, bytes | None, bool] | Callable[[], Awaitable[None]]] = asyncio.Queue()
        self.pending = 0

    def submit(self, suffix: str, value: bytes | None, *, under_lease: bool = False) -> None:
        """Put (value) or delete (None) the key `suffix`, after every earlier write;
        `under_lease`: the key goes when this node's lease does."""
        self.pending += 1
        self._queue.put_nowait((suffix, value, under_lease))

    def run_later(self, write: Callable[[], Awaitable[None]]) -> None:
        """Run an async write (a registry claim or release, say) after the writes queued before
        it; etcd errors it raises are retried (bounded)."""
        self.pending += 1
        self._queue.put_nowait(write)

    async def run(self) -> None:
        while self._running():
            item = await self._queue.get()
            if not isinstance(item, tuple):
                await self._run_registry_write(item)
                continue
            suffix, value, under_lease = item
            while self._running():
                try:
                    if value is None:
                        await self._store.delete(suffix)
                    else:
                        await self._store.put(suffix, value, self._lease() if under_lease else 0)
                    self.pending -= 1
                    break
                except Exception as exc:
                    log.warning("cluster: cannot write %s to etcd yet (%s); retrying", suffix, exc)
                    await asyncio.sleep(0.5)

    async def _run_registry_write(self, write: Callable[[], Awaitable[None]]) -> None:
        """One registry write (a claim or a release); tried again (bounded) while etcd fails."""
        try:
            for attempt in range(REGISTRY_WRITE_ATTEMPTS):
                try:
                    await write()
                    return
                except Exception as exc:
                    if attempt == REGISTRY_WRITE_ATTEMPTS - 1 or not self._running():
                        log.warning("cluster: session registry write failed: %s", exc)
                        return
                await asyncio.sleep(0.5)
        finally:
            self.pending -= 1
