"""Users and ACL rules shared by every node of a cluster, through etcd.

On a single node they are two files of the data directory (`users.json`, `acl.toml`) that
`shardgate users add` edits and the broker re-reads when they change. In a cluster each file
is one etcd key (`auth/users`, `auth/acl`, the file's bytes): a node whose file changes (the
CLI ran on that node) puts it in etcd, and every node whose watch sees a new value writes it
to its own file, which its `Security` then re-reads as usual. The last change wins, whole
file at a time. At join, etcd wins over the local file; a file etcd does not have yet is put
there. Password hashes (scrypt) travel, never clear-text passwords; use etcd's TLS and
authentication (`[cluster]` ca_file, username) to keep them private.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from .control import ClusterNode

log = logging.getLogger(__name__)

AUTH = "auth/"
POLL_S = 0.5


class SharedFiles:
    """Keeps local files and their etcd keys (`auth/<name>`) equal, both ways."""

    def __init__(self, node: ClusterNode, files: dict[str, Path]) -> None:
        self.node = node
        self.files = files
        # what this node last saw in etcd or wrote there, by name
        self._shared: dict[str, bytes | None] = {}
        self._mtimes: dict[str, tuple[int, int, int] | None] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for name, path in self.files.items():
            value = self.node.view.documents.get(AUTH + name)
            local = _read(path)
            if value is not None:
                self._shared[name] = value
                if local != value:
                    _write(path, value)
                    log.info("cluster: %s taken from etcd", path)
            elif local is not None:
                self._shared[name] = local
                self.node.submit(AUTH + name, local)
                log.info("cluster: %s shared through etcd", path)
            self._mtimes[name] = _mtime(path)
        self.node.document_listeners.append(self._changed_in_etcd)
        self._task = asyncio.create_task(self._poll(), name="cluster-shared-files")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _changed_in_etcd(self, key: str, value: bytes | None) -> None:
        if not key.startswith(AUTH) or value is None:
            return
        name = key[len(AUTH):]
        path = self.files.get(name)
        if path is None or self._shared.get(name) == value:
            return
        self._shared[name] = value
        if _read(path) != value:
            _write(path, value)
            log.info("cluster: %s changed on another node", path)
        self._mtimes[name] = _mtime(path)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            for name, path in self.files.items():
                mtime = _mtime(path)
                if mtime == self._mtimes.get(name):
                    continue
                self._mtimes[name] = mtime
                local = _read(path)
                if local is not None and local != self._shared.get(name):
                    self._shared[name] = local
                    self.node.submit(AUTH + name, local)
                    log.info("cluster: %s changed here; sharing it through etcd", path)


def _mtime(path: Path) -> tuple[int, int, int] | None:
    """The file's version: modification time, inode and size (two writes within one tick of
    the file system's clock share a modification time; every writer replaces the file)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_ino, stat.st_size


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _write(path: Path, value: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.cluster.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(value)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
