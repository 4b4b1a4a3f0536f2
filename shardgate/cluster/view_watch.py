"""The etcd watch that keeps this node's cached view (`etcd_view.py`) fresh, and the
listeners told what changed.

One watch on the whole cluster prefix applies every change to the view; a broken or
compacted watch reads the whole state again and resumes, and a watch that silently stopped
delivering (seen after an etcd restart) is found by a periodic check against etcd and
restarted. After each change the listeners hear, on the event loop, of the catalog (streams,
routes), of whole documents (users, ACL, AMQP topology, schemas) and of MQTT sessions that
moved to another node; then the view's own change callbacks run and the controller wakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from .control_store import ControlStore
from .etcd_view import EtcdClusterView

log = logging.getLogger(__name__)

# how often the watch's health is checked against etcd (see `ViewWatch.run`)
WATCH_CHECK_S = 2.0

Snapshot = tuple[dict[str, Any], dict[str, Any], dict[str, Any]]


class ViewWatch:
    """The watch loop over the view, and the listeners of its changes."""

    def __init__(self, store: ControlStore, view: EtcdClusterView, node_id: str, *,
                 running: Callable[[], bool], pending_writes: Callable[[], int],
                 wake: Callable[[], None]) -> None:
        self._store = store
        self._view = view
        self._node_id = node_id
        self._running = running
        self._pending_writes = pending_writes
        self._wake = wake
        # told (on the event loop) about catalog changes seen in etcd: (kind, name, definition)
        self.catalog_listeners: list[Callable[[str, str, dict[str, Any] | None], None]] = []
        # told when a client's session moved to another node: (client id, node id)
        self.session_listeners: list[Callable[[str, str], object]] = []
        # told about changes of whole documents (auth/...) seen in etcd: (key, value)
        self.document_listeners: list[Callable[[str, bytes | None], None]] = []

    async def run(self, revision: int) -> None:
        """Run the watch from after `revision`; every WATCH_CHECK_S ask etcd whether keys
        changed after the view's revision, and restart the watch (re-reading everything) when
        they still have at the next check: a watch stream that silently stopped delivering
        (seen after an etcd restart) must not leave this node's view stale."""
        watch = asyncio.create_task(self._watch(revision), name="cluster-watch-stream")
        stale_since: int | None = None
        try:
            while self._running():
                await asyncio.sleep(WATCH_CHECK_S)
                seen = self._view.revision
                try:
                    behind = await self._store.latest_modification() > seen
                except Exception:
                    continue  # etcd away: the watch loop itself deals with that
                if not behind:
                    stale_since = None
                elif stale_since != seen:
                    stale_since = seen  # give the watch until the next check
                else:
                    log.warning("cluster: the etcd watch is behind (at revision %d); "
                                "reading the state again", seen)
                    watch.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await watch
                    watch = asyncio.create_task(self._watch(0), name="cluster-watch-stream")
                    stale_since = None
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watch

    async def _watch(self, revision: int) -> None:
        view, prefix = self._view, self._store.prefix
        while self._running():
            try:
                if revision == 0:
                    # read everything again; what changed meanwhile (a stream created or
                    # deleted while this node could not watch) is applied as any change is.
                    # This node's own writes still queued go first, or they would look undone.
                    while self._pending_writes() and self._running():
                        await asyncio.sleep(0.05)
                    kvs, revision = await self._store.read_all()
                    before = self.catalog_snapshot()
                    view.load(prefix, kvs, revision)
                    self.after_change(before)
                    log.info("cluster: watching etcd again from revision %d", revision)
                async with contextlib.aclosing(self._store.watch(revision + 1)) as changes:
                    async for events in changes:
                        before = self.catalog_snapshot()
                        relevant = view.apply(prefix, events)
                        revision = view.revision
                        self.after_change(before, wake=relevant)
            except Exception as exc:  # a broken stream must never end the watch loop
                (log.warning if revision else log.debug)(
                    "cluster: watch interrupted (%s); reading the state again", exc)
                revision = 0
                await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                if _cancelling():
                    raise
                revision = 0  # the channel under the stream was closed (fail-over): resume
                await asyncio.sleep(0.5)

    def catalog_snapshot(self) -> Snapshot:
        """The view's streams, routes and documents, to compare with after a change."""
        view = self._view
        return dict(view.streams), dict(view.routes), dict(view.documents)

    def after_change(self, before: Snapshot | None = None, *, wake: bool = True) -> None:
        """Tell the listeners what changed since `before` (None: tell none of them)."""
        if wake:
            self._wake()
        view = self._view
        changes, view.session_changes = view.session_changes, []
        if before is not None:
            for client_id, node_id in changes:
                if node_id is not None and node_id != self._node_id:
                    for session_listener in self.session_listeners:
                        try:
                            session_listener(client_id, node_id)
                        except Exception:
                            log.exception("cluster session listener failed")
        if before is not None:
            old_documents, new_documents = before[2], view.documents
            for key in old_documents.keys() | new_documents.keys():
                if old_documents.get(key) != new_documents.get(key):
                    for document_listener in self.document_listeners:
                        try:
                            document_listener(key, new_documents.get(key))
                        except Exception:
                            log.exception("cluster document listener failed")
        if before is not None and self.catalog_listeners:
            for kind, old, new in zip(("stream", "route"), before[:2],
                                      self.catalog_snapshot()[:2], strict=True):
                for name in old.keys() | new.keys():
                    if old.get(name) != new.get(name):
                        for listener in self.catalog_listeners:
                            try:
                                listener(kind, name, new.get(name))
                            except Exception:
                                log.exception("cluster catalog listener failed")
        if wake:
            view.changed()


def _cancelling() -> bool:
    """True when the running task itself is being cancelled (not merely a gRPC call under it,
    which grpc.aio reports as CancelledError when its channel is closed)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
