"""The etcd lease kept alive from a thread of its own (`LeaseKeeper`), so that a busy event loop
cannot let a live node's lease run out; made by `etcd.EtcdClient.lease_keeper`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from aetcd import rpc

from .etcd import EtcdError, EtcdUnavailable

if TYPE_CHECKING:
    from .etcd import EtcdClient

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Refreshes one lease every `interval` seconds from a daemon thread with its own
    synchronous gRPC channel, so a saturated event loop (a flood of QoS 0 publishes, a long
    synchronous step) cannot let the lease run out while the node is alive.

    After each answer it calls `refreshed(lease_id, sent, ttl)` on the thread: `sent` is the
    `time.monotonic()` the refresh was sent at, `ttl` what etcd granted (0: the lease is gone).
    The caller hands that to its event loop (`loop.call_soon_threadsafe`); fencing stays
    correct because the lease is only counted valid until `sent + ttl`, so a thread that
    cannot reach etcd makes the node stop acting for its shards once the TTL has passed.
    `lease_id` may be replaced (a new registration) while the thread runs.
    """

    def __init__(self, client: EtcdClient, lease_id: int, interval: float,
                 refreshed: Callable[[int, float, int], None]) -> None:
        self.client = client
        self.lease_id = lease_id
        self.interval = interval
        self.refreshed = refreshed
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._index = client._index
        self._channel: grpc.Channel | None = None
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._thread = threading.Thread(target=self._run, name="etcd-lease-keeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def refresh_now(self) -> None:
        """Refresh at once (a new lease id was set)."""
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to end and wait (up to `timeout`) until it has; does not revoke."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _open(self) -> None:
        self._close()
        client = self.client
        endpoint = client.endpoints[self._index]
        if endpoint.secure or client._credentials is not None:
            assert client._credentials is not None
            channel = grpc.secure_channel(endpoint.target, client._credentials,
                                          options=client._options)
        else:
            channel = grpc.insecure_channel(endpoint.target, options=client._options)
        metadata = None
        try:
            if client.username:
                reply = rpc.AuthStub(channel).Authenticate(
                    rpc.AuthenticateRequest(name=client.username, password=client.password or ""),
                    timeout=client.timeout)
                metadata = (("token", reply.token),)
        except BaseException:
            channel.close()
            raise
        self._channel, self._metadata = channel, metadata

    def _close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _refresh(self, lease_id: int) -> int:
        if self._channel is None:
            self._open()
        assert self._channel is not None
        call = rpc.LeaseStub(self._channel).LeaseKeepAlive(
            iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]), timeout=self.client.timeout,
            metadata=self._metadata)
        try:
            for reply in call:
                return int(reply.TTL)
        finally:
            call.cancel()
        raise EtcdUnavailable("etcd closed the lease keep-alive stream")

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            lease_id = self.lease_id
            sent = time.monotonic()
            wait = self.interval
            try:
                granted = self._refresh(lease_id)
            except (grpc.RpcError, EtcdError, OSError) as exc:
                (log.debug if failing else log.warning)(
                    "cluster: cannot refresh the lease at %s (%s); shards are served until "
                    "the last refresh's TTL runs out", self.client.endpoints[self._index].target,
                    exc)
                failing = True
                # the next endpoint (and a fresh token) on the next try
                self._close()
                self._index = (self._index + 1) % len(self.client.endpoints)
                wait = min(self.interval, 0.5)
            else:
                failing = False
                if self._stop.is_set():
                    break
                try:
                    self.refreshed(lease_id, sent, granted)
                except RuntimeError:  # the event loop is closed: nothing left to keep alive
                    break
            self._wake.wait(wait)
            self._wake.clear()
        self._close()
