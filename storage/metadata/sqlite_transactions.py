"""The metadata store's transactions over its one SQLite connection: atomic blocks (nested
ones as savepoints), the group commit of a stretch of writes (`group_writes`, `commit_group`:
one fsync, a future the caller holds its acknowledgements on), writes whose fsync nobody waits
for (`deferred_sync`), and the statement helpers every table's methods use. The fsync itself
runs in the store's `WalSyncer` thread (`durability.py`), never on the caller's.

`SqliteTransactions` is the base of `SqliteMetadataStore` (`sqlite.py`), which opens the
database, migrates it and holds the tables. Knows no table.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardgate.storage.metadata.durability import WalSyncer, done_future
from shardgate.storage.metadata.interface import MetadataError

# The store's logger, as before this part had a module of its own.
log = logging.getLogger("shardgate.storage.metadata.sqlite")


def _chain(done: Future[None], future: Future[None]) -> None:
    """Settle `future` as `done` settled."""
    if future.done():
        return
    error = done.exception()
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class SqliteTransactions:
    """Transactions, group commit and statement helpers over `_conn` (see the module's
    docstring); `SqliteMetadataStore.__init__` sets the state declared here."""

    path: Path
    _conn: sqlite3.Connection | None
    _depth: int
    _grouping: bool
    _group_open: bool
    _group_future: Future[None] | None
    _last_durable: Future[None] | None
    write_count: int
    _wait_for_sync: bool
    _deferred: int
    _syncer: WalSyncer | None

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise MetadataError("the metadata store is closed")
        return self._conn

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Group writes into one atomic commit; nested blocks use savepoints.

        While a write group is open (`group_writes`), an outermost block is a savepoint of
        the group's transaction: it is atomic on its own, and durable at `commit_group`."""
        conn = self._db
        depth = self._depth
        grouped = depth == 0 and (self._grouping or self._group_open)
        if grouped and not self._group_open:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise MetadataError(f"cannot begin a metadata transaction: {exc}") from exc
            self._group_open = True
        level = depth + 1 if grouped or depth else 0
        try:
            conn.execute("BEGIN IMMEDIATE" if level == 0 else f"SAVEPOINT sp{level}")
        except sqlite3.Error as exc:
            raise MetadataError(f"cannot begin a metadata transaction: {exc}") from exc
        self._depth = depth + 1
        try:
            yield
        except BaseException:
            self._depth = depth
            self._rollback(conn, level)
            raise
        self._depth = depth
        try:
            conn.execute("COMMIT" if level == 0 else f"RELEASE sp{level}")
        except sqlite3.Error as exc:
            self._rollback(conn, level)
            raise MetadataError(f"metadata commit failed: {exc}") from exc
        if depth:
            return
        self.write_count += 1
        if grouped and self._grouping:
            return  # durable at `commit_group`
        # A write outside the group: durable now (with the open group's writes, if any).
        durable = self.commit_group() if grouped else self._request_sync()
        if durable is not None and not self._deferred:
            self._wait(durable)

    def group_writes(self, on: bool) -> None:
        """Start (True) or stop (False) collecting writes into one transaction, committed (one
        fsync) by `commit_group`. Stopping does not commit: the caller commits before it sends
        any acknowledgement of what was written. A write made outside the group while it is
        open commits the group with it."""
        self._grouping = on

    @property
    def group_pending(self) -> bool:
        """Writes are waiting in an open group for `commit_group`."""
        return self._group_open

    def commit_group(self) -> Future[None] | None:
        """Commit every write of the open group and return the future that resolves once they
        are durable (None without an open group). The caller does not wait: it holds back
        what depends on the writes until the future is done. On failure the group is rolled
        back, its future fails, and MetadataError is raised."""
        if not self._group_open or self._depth:
            return None
        self._group_open = False
        future, self._group_future = self._group_future, None
        conn = self._db
        try:
            if not conn.in_transaction:  # SQLite rolled it back on an error (e.g. disk full)
                raise MetadataError("the metadata write group was rolled back")
            try:
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback(conn, 0)
                raise MetadataError(f"metadata group commit failed: {exc}") from exc
        except MetadataError as exc:
            if future is not None:
                future.set_exception(exc)
            raise
        durable = self._request_sync()
        if future is not None:
            durable.add_done_callback(lambda done: _chain(done, future))
            return future
        return durable

    def durable_waiter(self) -> Future[None] | None:
        """The future that resolves once every write made so far is durable: the open
        group's, else the last commit's; None when everything is durable already."""
        if self._group_open:
            if self._group_future is None:
                self._group_future = Future()
            return self._group_future
        last = self._last_durable
        if last is None or last.done():
            return None
        return last

    @contextmanager
    def deferred_sync(self) -> Iterator[None]:
        """Writes inside the block commit without waiting for their fsync (it follows in the
        sync thread): for writes that acknowledge nothing, such as periodic cursor saves."""
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1

    def sync(self) -> None:
        """Wait until every commit made so far is durable."""
        durable = self.durable_waiter()
        if durable is not None and not self._group_open:
            self._wait(durable)

    def _request_sync(self) -> Future[None]:
        if self._syncer is None:
            future = done_future()
        else:
            future = self._syncer.request()
        self._last_durable = future
        return future

    def _wait(self, durable: Future[None]) -> None:
        if not self._wait_for_sync:
            return
        try:
            durable.result()
        except Exception as exc:
            raise MetadataError(f"metadata sync failed: {exc}") from exc

    @staticmethod
    def _rollback(conn: sqlite3.Connection, depth: int) -> None:
        if not conn.in_transaction:  # SQLite already rolled back (e.g. disk full)
            return
        try:
            if depth == 0:
                conn.execute("ROLLBACK")
            else:
                conn.execute(f"ROLLBACK TO sp{depth}")
                conn.execute(f"RELEASE sp{depth}")
        except sqlite3.Error:
            pass  # the original error is what the caller needs to see

    def close(self) -> None:
        if self._conn is None:
            return
        try:
            self.commit_group()
        except MetadataError:
            pass  # rolled back; the caller never acknowledged what it held
        if self._syncer is not None:
            self._syncer.request()
            self._syncer.stop()  # every commit synced, its checkpoint connection closed
            self._syncer = None
        conn, self._conn = self._conn, None
        try:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        finally:
            conn.close()  # the last connection: SQLite checkpoints (with fsyncs) and drops the WAL

    # ---------------------------------------------------------------- statement helpers

    def _write(self, sql: str, params: Sequence[Any]) -> int:
        """Run one write in its own (or the enclosing) transaction; returns rows changed."""
        with self.transaction():
            try:
                return self._db.execute(sql, params).rowcount
            except sqlite3.Error as exc:
                raise MetadataError(f"metadata write failed: {exc}") from exc

    def _write_many(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> int:
        """Run several writes in one transaction; returns the rows the first one changed."""
        with self.transaction():
            try:
                changed = [self._db.execute(sql, params).rowcount for sql, params in statements]
            except sqlite3.Error as exc:
                raise MetadataError(f"metadata write failed: {exc}") from exc
        return changed[0]

    def _rows(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        try:
            return self._db.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise MetadataError(f"metadata read failed: {exc}") from exc

    def _row(self, sql: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
        try:
            return self._db.execute(sql, params).fetchone()
        except sqlite3.Error as exc:
            raise MetadataError(f"metadata read failed: {exc}") from exc

    def _one(self, sql: str, params: Sequence[Any]) -> Any:
        row = self._row(sql, params)
        return None if row is None else row[0]
