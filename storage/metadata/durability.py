"""Making committed SQLite transactions durable off the caller's thread.

The metadata store commits with `synchronous=NORMAL` in WAL mode: a COMMIT writes the
transaction's pages to the `-wal` file (into the page cache; a crash of the process keeps them)
without an fsync. `WalSyncer` owns one thread that fsyncs that file for every commit that asks
(`request`): each request's future resolves once an fsync that *started after the request*
has finished, so the commit before it is on disk, and one fsync serves every request that
arrived meanwhile (group commit). The thread also checkpoints the WAL into the database file
with its own connection (the committing connection's automatic checkpoint is switched off, as
it would fsync on the caller's thread), and fsyncs the directory once for the `-wal` file's
name.

Futures are `concurrent.futures.Future`: any thread may wait on them, and an event loop wraps
them (`asyncio.wrap_future`). This module knows nothing of the core or the protocols.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from concurrent.futures import Future
from pathlib import Path

log = logging.getLogger(__name__)

# Checkpoint the WAL into the database after this many sync batches (a batch is a few pages:
# SQLite's own default is a checkpoint per 1,000 pages).
CHECKPOINT_EVERY = 64
# ... or, while commits keep waiting for their fsync, after at most this many times as many.
CHECKPOINT_DEFER_MAX = 4


def done_future() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


class WalSyncer:
    """fsyncs the WAL of `db_path` in a thread, for every commit that asks, in order."""

    def __init__(self, db_path: Path, *, fsync: bool = True) -> None:
        self.db_path = Path(db_path)
        self.wal_path = Path(f"{self.db_path}-wal")
        # False (synchronous=NORMAL configured): nothing is fsynced per commit, as SQLite
        # itself does under NORMAL; checkpoints still run here.
        self.fsync = fsync
        self.fsyncs = 0
        self.fsync_file = os.fsync  # what syncs the WAL (a test can slow it down)
        self.checkpoints = 0
        self._batches = 0
        self._cond = threading.Condition()
        self._waiting: list[Future[None]] = []
        self._stopping = False
        self._fd: int | None = None
        self._inode: int | None = None
        self._thread = threading.Thread(target=self._run, name="metadata-sync", daemon=True)
        self._thread.start()

    def request(self) -> Future[None]:
        """A future that resolves once every commit made before this call is durable (or
        fails with the OSError of the fsync)."""
        future: Future[None] = Future()
        with self._cond:
            if self._stopping:
                future.set_exception(RuntimeError("the metadata store is closed"))
                return future
            self._waiting.append(future)
            self._cond.notify()
        return future

    def stop(self) -> None:
        """Serve what is waiting, then end the thread (and its connection)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                batch, self._waiting = self._waiting, []
                stopping = self._stopping
            if batch:
                error: BaseException | None = None
                try:
                    if self.fsync:
                        self._sync_wal()
                except OSError as exc:
                    log.error("metadata: fsync of %s failed: %s", self.wal_path, exc)
                    error = exc
                for future in batch:
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(error)
                self._maybe_checkpoint()
            if stopping:
                return

    def _sync_wal(self) -> None:
        try:
            inode = os.stat(self.wal_path).st_ino
        except FileNotFoundError:
            return  # no WAL: every commit is already in the (fsynced) database file
        if self._fd is None or inode != self._inode:
            if self._fd is not None:
                os.close(self._fd)
            self._fd = os.open(self.wal_path, os.O_RDONLY | os.O_CLOEXEC)
            self._inode = inode
            directory = os.open(self.wal_path.parent, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(directory)  # the -wal file's name, once per file
            finally:
                os.close(directory)
        self.fsync_file(self._fd)
        self.fsyncs += 1

    def _maybe_checkpoint(self) -> None:
        self._batches += 1
        if self._batches < CHECKPOINT_EVERY:
            return
        if self._waiting and self._batches < CHECKPOINT_DEFER_MAX * CHECKPOINT_EVERY:
            # Commits already wait for an fsync: they are served first, and the checkpoint
            # (a copy into the database file and its fsync) waits for a pause, up to a bound.
            return
        self._batches = 0
        try:
            # A connection of its own, closed again: no file descriptors held in between.
            checkpointer = sqlite3.connect(self.db_path, isolation_level=None)
        except sqlite3.Error as exc:
            log.warning("metadata: checkpoint failed: %s", exc)
            return
        try:
            checkpointer.execute("PRAGMA synchronous=NORMAL")  # syncs the WAL, then the db
            # PASSIVE: never waits for, nor blocks, the writer; the writer starts the WAL over
            # once it has all been copied.
            checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            self.checkpoints += 1
        except sqlite3.Error as exc:
            log.warning("metadata: checkpoint failed: %s", exc)
        finally:
            checkpointer.close()
