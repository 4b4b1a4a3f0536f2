"""A small asyncio etcd v3 client: key ranges, transactions, leases with keep-alive, watches.

Why this shape: the maintained asyncio client `aetcd` (1.0) ships etcd's v3 gRPC stubs
generated for today's protobuf (they import and work with protobuf 7 and grpcio 1.85, which
the older `etcd3`/`aioetcd3` stubs do not), but its `Client` speaks to one plain-text endpoint
only and hides watch revisions and compaction. So Shardgate uses aetcd's stubs over
`grpc.aio` directly (no generated code of our own, no grpcio-tools at build time) and adds
what a cluster member needs: several endpoints with fail-over, TLS and user/password, a
lease kept alive on one bidirectional stream (or from a thread: `etcd_lease.py`), and a watch that reports the revision it is at
and fails loudly on compaction so the caller re-reads and resumes.

Nothing here knows what Shardgate stores in etcd (see `keys.py` and `control_store.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import grpc
from aetcd import rpc

from .waits import wait_within

if TYPE_CHECKING:
    from .etcd_lease import LeaseKeeper

log = logging.getLogger(__name__)


class EtcdError(Exception):
    """Base of the errors of this client."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered (within the call's timeout)."""


class EtcdCompacted(EtcdError):
    """A watch asked for a revision etcd has compacted away: re-read, then watch again."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A put (value set) or a delete (value None) of `key` at `revision`."""

    key: str
    value: bytes | None
    revision: int
    create_revision: int


def _kv(raw: rpc.KeyValue) -> KeyValue:
    return KeyValue(raw.key.decode(), raw.value, raw.create_revision, raw.mod_revision, raw.lease)


def _closed_under_us() -> bool:
    """True when a CancelledError reached the running task from a gRPC call whose channel was
    closed (grpc.aio reports it so), not from a cancellation of the task itself."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix` (etcd's convention)."""
    end = bytearray(prefix)
    for index in range(len(end) - 1, -1, -1):
        if end[index] < 0xFF:
            end[index] += 1
            return bytes(end[: index + 1])
    return b"\0"


# ---------------------------------------------------------------- transaction building blocks
def version_is(key: str, version: int) -> rpc.Compare:
    """Compare: the key's version (0 = absent)."""
    return rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.VERSION, key=key.encode(),
                       version=version)


def create_revision_is(key: str, revision: int) -> rpc.Compare:
    return rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, key=key.encode(),
                       create_revision=revision)


def mod_revision_is(key: str, revision: int) -> rpc.Compare:
    return rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, key=key.encode(),
                       mod_revision=revision)


def put_op(key: str, value: bytes, lease: int = 0) -> rpc.RequestOp:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key.encode(), value=value, lease=lease))


def get_op(key: str) -> rpc.RequestOp:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key.encode()))


def delete_op(key: str) -> rpc.RequestOp:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key.encode()))


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    # the key-values read by the get ops of the branch that ran, in order
    reads: list[list[KeyValue]]


@dataclass(frozen=True, slots=True)
class Endpoint:
    target: str
    secure: bool


def parse_endpoints(endpoints: Sequence[str]) -> list[Endpoint]:
    """`http://host:port`, `https://host:port` or `host:port` → gRPC targets."""
    parsed = []
    for text in endpoints:
        text = text.strip()
        if not text:
            continue
        if "://" not in text:
            text = f"http://{text}"
        url = urlsplit(text)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"etcd endpoint {text!r}: expected http://host:port or https://host:port")
        parsed.append(Endpoint(f"{url.hostname}:{url.port or 2379}", url.scheme == "https"))
    if not parsed:
        raise ValueError("no etcd endpoint given")
    return parsed


class EtcdClient:
    """One connection (to one endpoint at a time, failing over in order) to an etcd cluster."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        username: str | None = None,
        password: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        timeout: float = 5.0,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.username = username
        self.password = password
        self.timeout = timeout
        self._credentials: grpc.ChannelCredentials | None = None
        if any(e.secure for e in self.endpoints) or ca_file or cert_file:
            root = open(ca_file, "rb").read() if ca_file else None  # noqa: SIM115
            cert = open(cert_file, "rb").read() if cert_file else None  # noqa: SIM115
            key = open(key_file, "rb").read() if key_file else None  # noqa: SIM115
            self._credentials = grpc.ssl_channel_credentials(root, key, cert)
        self._index = 0
        self._options = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                         ("grpc.initial_reconnect_backoff_ms", 200),
                         ("grpc.min_reconnect_backoff_ms", 200),
                         ("grpc.max_reconnect_backoff_ms", 1_000)]
        self._channel: grpc.aio.Channel | None = None
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._lock = asyncio.Lock()
        self.kv: rpc.KVStub | None = None
        self.lease: rpc.LeaseStub | None = None
        self.watch_stub: rpc.WatchStub | None = None

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._index].target

    # ---------------------------------------------------------------- connection
    async def _open(self, index: int) -> None:
        endpoint = self.endpoints[index]
        # etcd restarts: reconnect within a second rather than after gRPC's default backoff
        # (up to two minutes), so leases are refreshed again before they run out
        options = self._options
        if endpoint.secure or self._credentials is not None:
            assert self._credentials is not None
            channel = grpc.aio.secure_channel(endpoint.target, self._credentials, options=options)
        else:
            channel = grpc.aio.insecure_channel(endpoint.target, options=options)
        metadata = None
        try:
            if self.username:
                auth = rpc.AuthStub(channel)
                reply = await auth.Authenticate(
                    rpc.AuthenticateRequest(name=self.username, password=self.password or ""),
                    timeout=self.timeout,
                )
                metadata = (("token", reply.token),)
            else:
                maintenance = rpc.MaintenanceStub(channel)
                await maintenance.Status(rpc.StatusRequest(), timeout=self.timeout)
        except BaseException:
            await channel.close()
            raise
        old = self._channel
        self._channel, self._metadata, self._index = channel, metadata, index
        self.kv = rpc.KVStub(channel)
        self.lease = rpc.LeaseStub(channel)
        self.watch_stub = rpc.WatchStub(channel)
        if old is not None:
            await old.close()

    async def connect(self) -> None:
        """Open a channel to the first endpoint that answers; EtcdUnavailable if none does."""
        async with self._lock:
            await self._connect_locked()

    async def _connect_locked(self) -> None:
        errors = []
        count = len(self.endpoints)
        for step in range(count):
            index = (self._index + step) % count
            try:
                await self._open(index)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.FAILED_PRECONDITION):
                    raise EtcdError(f"etcd at {self.endpoints[index].target}: {exc.details()}") from None
                errors.append(f"{self.endpoints[index].target}: {exc.code().name}")
            except (TimeoutError, OSError) as exc:
                errors.append(f"{self.endpoints[index].target}: {exc}")
        raise EtcdUnavailable("no etcd endpoint answered (" + "; ".join(errors) + ")")

    async def reconnect(self, failed: grpc.aio.Channel | None) -> None:
        async with self._lock:
            if failed is not None and self._channel is not failed:
                return  # someone else already moved on
            if failed is not None:
                self._index = (self._index + 1) % len(self.endpoints)
            await self._connect_locked()

    async def close(self) -> None:
        # no longer the current channel while it closes: a call it cancels is not asked again
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def _unary(self, method: str, stub_name: str, request: object) -> object:
        """Call a unary RPC, failing over to the next endpoint once on UNAVAILABLE and
        re-authenticating once on an expired token. A call whose channel another call's
        reconnect closed (grpc.aio then raises CancelledError in the caller, which no
        `except Exception` retry loop catches) is a read asked again, or EtcdUnavailable."""
        for attempt in range(2):
            if self._channel is None:
                await self.connect()
            channel = self._channel
            stub = getattr(self, stub_name)
            try:
                return await getattr(stub, method)(request, timeout=self.timeout,
                                                   metadata=self._metadata)
            except asyncio.CancelledError:
                if not _closed_under_us():
                    raise
                # another call moved this client to a new channel and closed this one: a read
                # is asked again there; a write may have been applied, so the caller decides
                if method == "Range" and attempt == 0 and self._channel not in (None, channel):
                    continue
                raise EtcdUnavailable(f"etcd at {self.endpoint}: the call's channel was closed "
                                      "(the client reconnected)") from None
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                retry = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED) or (
                    code is grpc.StatusCode.INVALID_ARGUMENT and "token" in (exc.details() or ""))
                if code is grpc.StatusCode.DEADLINE_EXCEEDED or (retry and attempt == 1):
                    raise EtcdUnavailable(f"etcd at {self.endpoint}: {code.name} {exc.details()}") from None
                if not retry:
                    raise EtcdError(f"etcd at {self.endpoint}: {code.name} {exc.details()}") from None
                try:
                    await self.reconnect(channel)
                except EtcdUnavailable:
                    raise
        raise AssertionError("unreachable")

    # ---------------------------------------------------------------- keys
    async def get(self, key: str) -> KeyValue | None:
        reply = await self._unary("Range", "kv", rpc.RangeRequest(key=key.encode()))
        return _kv(reply.kvs[0]) if reply.kvs else None  # type: ignore[attr-defined]

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, and the store revision they were read at."""
        raw = prefix.encode()
        reply = await self._unary("Range", "kv", rpc.RangeRequest(key=raw, range_end=prefix_end(raw)))
        return [_kv(kv) for kv in reply.kvs], reply.header.revision  # type: ignore[attr-defined]

    async def get_keys(self, prefix: str) -> list[str]:
        """The names of every key under `prefix` (no values)."""
        raw = prefix.encode()
        reply = await self._unary("Range", "kv", rpc.RangeRequest(
            key=raw, range_end=prefix_end(raw), keys_only=True))
        return [kv.key.decode() for kv in reply.kvs]  # type: ignore[attr-defined]

    async def latest_modification(self, prefix: str) -> int:
        """The highest mod revision of a key under `prefix` (0: none), a watch's health check.
        (A count_only range ignores min_mod_revision in etcd: it counts every key.)"""
        raw = prefix.encode()
        reply = await self._unary("Range", "kv", rpc.RangeRequest(
            key=raw, range_end=prefix_end(raw), limit=1, keys_only=True,
            sort_order=rpc.RangeRequest.DESCEND, sort_target=rpc.RangeRequest.MOD))
        kvs = reply.kvs  # type: ignore[attr-defined]
        return kvs[0].mod_revision if kvs else 0

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        reply = await self._unary("Put", "kv", rpc.PutRequest(key=key.encode(), value=value, lease=lease))
        return int(reply.header.revision)  # type: ignore[attr-defined]

    async def delete(self, key: str) -> bool:
        reply = await self._unary("DeleteRange", "kv", rpc.DeleteRangeRequest(key=key.encode()))
        return bool(reply.deleted > 0)  # type: ignore[attr-defined]

    async def txn(
        self,
        compare: Sequence[rpc.Compare],
        success: Sequence[rpc.RequestOp],
        failure: Sequence[rpc.RequestOp] = (),
    ) -> TxnResult:
        reply = await self._unary("Txn", "kv", rpc.TxnRequest(
            compare=list(compare), success=list(success), failure=list(failure)))
        reads = [
            [_kv(kv) for kv in response.response_range.kvs]
            for response in reply.responses  # type: ignore[attr-defined]
            if response.WhichOneof("response") == "response_range"
        ]
        return TxnResult(reply.succeeded, reply.header.revision, reads)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- conditional writes
    # The transactions of the cluster's modules, named by what they mean: the session
    # registry, elections and placement are the control plane's store's (`control_store.py`);
    # every other module writes through these and builds no compare or op of its own.
    async def create(self, key: str, value: bytes, lease: int = 0) -> tuple[bool, KeyValue | None]:
        """Write `value` at `key` unless the key exists (one transaction): (True, None) when
        written, else (False, what the key holds now, None when it went meanwhile)."""
        return await self.put_at(key, 0, value, lease)

    async def put_at(self, key: str, mod_revision: int, value: bytes,
                     lease: int = 0) -> tuple[bool, KeyValue | None]:
        """Write `value` at `key` only while the key is at `mod_revision` (0: absent), in one
        transaction: (True, None) when written, else (False, what the key holds now)."""
        compare = version_is(key, 0) if mod_revision == 0 else mod_revision_is(key, mod_revision)
        result = await self.txn([compare], [put_op(key, value, lease)], [get_op(key)])
        if result.succeeded:
            return True, None
        return False, result.reads[0][0] if result.reads and result.reads[0] else None

    async def write(
        self, puts: Iterable[tuple[str, bytes]] = (), deletes: Iterable[str] = (), *,
        if_at: tuple[str, int] | None = None, lease: int = 0,
    ) -> int | None:
        """Delete `deletes` and write `puts` (under `lease`) in one transaction; with `if_at`
        (a key and its mod revision), only while that key is still at that revision. The
        revision written, or None when `if_at` no longer held."""
        compare = [] if if_at is None else [mod_revision_is(*if_at)]
        ops = [delete_op(key) for key in deletes]
        ops += [put_op(key, value, lease) for key, value in puts]
        result = await self.txn(compare, ops)
        return result.revision if result.succeeded else None

    async def delete_unchanged(self, key: str, mod_revision: int) -> bool:
        """Delete `key` only while it is still at `mod_revision`; True when deleted."""
        return await self.write(deletes=[key], if_at=(key, mod_revision)) is not None

    async def replace_unchanged(self, key: str, mod_revision: int, value: bytes, lease: int = 0) -> bool:
        """Write `value` at `key` only while it is still at `mod_revision`; True when written."""
        return await self.write([(key, value)], if_at=(key, mod_revision), lease=lease) is not None

    # ---------------------------------------------------------------- leases
    async def grant(self, ttl: int) -> int:
        reply = await self._unary("LeaseGrant", "lease", rpc.LeaseGrantRequest(TTL=ttl))
        if reply.error:  # type: ignore[attr-defined]
            raise EtcdError(f"lease grant: {reply.error}")  # type: ignore[attr-defined]
        return int(reply.ID)  # type: ignore[attr-defined]

    async def revoke(self, lease_id: int) -> None:
        try:
            await self._unary("LeaseRevoke", "lease", rpc.LeaseRevokeRequest(ID=lease_id))
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    async def keep_alive(self, lease_id: int, interval: float) -> AsyncIterator[int]:
        """Refresh the lease every `interval` seconds on one stream; yields the TTL etcd grants
        each time (0: the lease is gone). Raises EtcdUnavailable when the stream breaks."""
        if self._channel is None:
            await self.connect()
        assert self.lease is not None
        call = self.lease.LeaseKeepAlive(metadata=self._metadata)
        try:
            while True:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                reply = await wait_within(call.read(), self.timeout)
                if reply is grpc.aio.EOF:
                    raise EtcdUnavailable("etcd closed the lease keep-alive stream")
                yield reply.TTL
                await asyncio.sleep(interval)
        except grpc.aio.AioRpcError as exc:
            raise EtcdUnavailable(f"lease keep-alive: {exc.code().name} {exc.details()}") from None
        except TimeoutError:
            raise EtcdUnavailable("lease keep-alive: no answer from etcd") from None
        except asyncio.CancelledError:
            if not _closed_under_us():
                raise
            raise EtcdUnavailable("lease keep-alive: the channel was closed (the client "
                                  "reconnected)") from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            raise EtcdUnavailable(f"lease keep-alive stream ended: {exc!r}") from None
        finally:
            call.cancel()

    def lease_keeper(self, lease_id: int, interval: float,
                     refreshed: Callable[[int, float, int], None]) -> LeaseKeeper:
        """A thread that keeps `lease_id` alive whatever the event loop is doing (see
        LeaseKeeper); same endpoints, TLS and credentials as this client."""
        from .etcd_lease import LeaseKeeper

        return LeaseKeeper(self, lease_id, interval, refreshed)

    # ---------------------------------------------------------------- watches
    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncGenerator[list[WatchEvent], None]:
        """Every change under `prefix` from `start_revision` on, one list per etcd response.
        Raises EtcdCompacted when that revision is gone, EtcdUnavailable when the stream breaks."""
        if self._channel is None:
            await self.connect()
        assert self.watch_stub is not None
        raw = prefix.encode()
        request = rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
            key=raw, range_end=prefix_end(raw), start_revision=start_revision,
            progress_notify=True))
        call = self.watch_stub.Watch(metadata=self._metadata)
        try:
            await call.write(request)
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise EtcdUnavailable("etcd closed the watch stream")
                if reply.compact_revision:
                    raise EtcdCompacted(f"revision {start_revision} compacted "
                                        f"(oldest kept: {reply.compact_revision})")
                if reply.canceled:
                    raise EtcdUnavailable(f"watch cancelled: {reply.cancel_reason}")
                if not reply.events:
                    continue
                yield [
                    WatchEvent(
                        event.kv.key.decode(),
                        None if event.type == rpc.Event.DELETE else event.kv.value,
                        event.kv.mod_revision,
                        event.kv.create_revision,
                    )
                    for event in reply.events
                ]
        except grpc.aio.AioRpcError as exc:
            raise EtcdUnavailable(f"watch: {exc.code().name} {exc.details()}") from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            raise EtcdUnavailable(f"watch stream ended: {exc!r}") from None
        except asyncio.CancelledError:
            if not _closed_under_us():
                raise
            raise EtcdUnavailable("watch: the channel was closed (the client reconnected)") from None
        finally:
            call.cancel()
