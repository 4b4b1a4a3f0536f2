"""Calls one node makes on another for shared state, served on the cluster port beside the
data plane's `PeerLink` stream (`DataPlane.add_service`).

- `ReleaseSession`: "a client whose MQTT session you hold connected to me: end its connection
  there (DISCONNECT 0x8E), and hand me the session" — the reply is the session's state
  (`sessions.py`).
- `ReleaseDurable`: the same for a durable subscription (`durables.py`) whose consumer came
  here; refused while consumers are attached there.
- `TakeSession`: "I am leaving: take this persistent session of mine" — the peer takes it
  over as if its client had connected there (it claims the session and calls
  `ReleaseSession` back), so that a session whose node stops keeps living, offline, on a
  live node (`sessions.SessionHandover.hand_over_offline`).
- `ReadShard`: "give me the records of your shard from this offset that match these filters" —
  how a node replays a reliable shard it does not own for a durable cursor that resumed here
  (`shard_reader.py`); the owner also says whether this node's routes already cover the
  filters, after which every later match is pushed to it anyway.

These are rare calls (a session changing node, a cursor catching up), not the hot path, so they
are unary gRPC calls with JSON requests, not messages of `proto/cluster.proto`; records travel
as raw bytes (`encode_records`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from ..storage.interfaces import StoredRecord
from .link_auth import NodeCredentials, cluster_channel
from .membership import ClusterView

SERVICE = "shardgate.cluster.v1.ClusterState"
RELEASE_SESSION = "ReleaseSession"
RELEASE_DURABLE = "ReleaseDurable"
READ_SHARD = "ReadShard"
TAKE_SESSION = "TakeSession"
_RECORD = struct.Struct("<qqI")
_HEADER = struct.Struct("<I")
MAX_MESSAGE = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]

JsonHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
ReadHandler = Callable[[dict[str, Any]], Awaitable[tuple[dict[str, Any], list[StoredRecord]]]]


class StateCallError(Exception):
    """A call to a peer failed (unreachable, not in the view, or it answered an error).
    `outcome_unknown`: the peer may have done what it was asked (the call timed out or broke
    after it was sent), as opposed to refused or never reached."""

    def __init__(self, message: str, *, outcome_unknown: bool = False) -> None:
        super().__init__(message)
        self.outcome_unknown = outcome_unknown


# The statuses of a call that may have been carried out by the peer all the same.
_OUTCOME_UNKNOWN = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                              grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})


def encode_records(header: dict[str, Any], records: list[StoredRecord]) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [_HEADER.pack(len(head)), head]
    for record in records:
        parts += (_RECORD.pack(record.offset, record.timestamp_ms, len(record.data)), bytes(record.data))
    return b"".join(parts)


def decode_records(data: bytes) -> tuple[dict[str, Any], list[StoredRecord]]:
    view = memoryview(data)
    (size,) = _HEADER.unpack_from(view, 0)
    position = _HEADER.size + size
    header = json.loads(bytes(view[_HEADER.size:position]))
    records = []
    while position < len(view):
        offset, timestamp, length = _RECORD.unpack_from(view, position)
        position += _RECORD.size
        records.append(StoredRecord(offset, timestamp, bytes(view[position:position + length])))
        position += length
    return header, records


def _json(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


class StateRpc:
    """Both ends: `handler()` serves this node's answers; `release_session` and `read_shard`
    call a peer (one channel per peer address, opened on first use)."""

    def __init__(self, view: ClusterView, credentials: NodeCredentials | None = None) -> None:
        self.view = view
        # every call proves this node to the peer (`link_auth.py`)
        self.credentials = credentials or NodeCredentials(view.node_id)
        self.on_release: JsonHandler | None = None
        self.on_take: JsonHandler | None = None
        self.on_release_durable: JsonHandler | None = None
        self.on_read: ReadHandler | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}

    # ------------------------------------------------------------ serving
    def handler(self) -> grpc.GenericRpcHandler:
        async def release(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if self.on_release is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "this node has no MQTT service")
            assert self.on_release is not None
            return _json(await self.on_release(json.loads(request)))

        async def take(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if self.on_take is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "this node has no MQTT service")
            assert self.on_take is not None
            return _json(await self.on_take(json.loads(request)))

        async def release_durable(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if self.on_release_durable is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "this node shares no durable subscriptions")
            assert self.on_release_durable is not None
            return _json(await self.on_release_durable(json.loads(request)))

        async def read(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if self.on_read is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "this node reads no shards")
            assert self.on_read is not None
            header, records = await self.on_read(json.loads(request))
            return encode_records(header, records)

        return grpc.method_handlers_generic_handler(SERVICE, {
            RELEASE_SESSION: grpc.unary_unary_rpc_method_handler(release),
            TAKE_SESSION: grpc.unary_unary_rpc_method_handler(take),
            RELEASE_DURABLE: grpc.unary_unary_rpc_method_handler(release_durable),
            READ_SHARD: grpc.unary_unary_rpc_method_handler(read),
        })

    # ------------------------------------------------------------ calling
    def channel(self, node_id: str) -> grpc.aio.Channel:
        """The channel to a live peer's cluster port (StateCallError if it is not live)."""
        return self._channel(node_id)

    def _channel(self, node_id: str) -> grpc.aio.Channel:
        info = self.view.nodes().get(node_id)
        if info is None:
            raise StateCallError(f"node {node_id} is not live")
        channel = self._channels.get(info.cluster_address)
        if channel is None:
            channel = cluster_channel(info.cluster_address, self.credentials, CHANNEL_OPTIONS)
            self._channels[info.cluster_address] = channel
        return channel

    async def _call(self, node_id: str, method: str, request: dict[str, Any], timeout: float) -> bytes:
        call = self._channel(node_id).unary_unary(f"/{SERVICE}/{method}")
        try:
            return await call(_json(request), timeout=timeout)  # type: ignore[no-any-return]
        except grpc.aio.AioRpcError as exc:
            raise StateCallError(f"{method} on node {node_id}: {exc.code().name} {exc.details()}",
                                 outcome_unknown=exc.code() in _OUTCOME_UNKNOWN) from None

    async def release_session(self, node_id: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        return json.loads(await self._call(node_id, RELEASE_SESSION, request, timeout))  # type: ignore[no-any-return]

    async def take_session(self, node_id: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        return json.loads(await self._call(node_id, TAKE_SESSION, request, timeout))  # type: ignore[no-any-return]

    async def release_durable(self, node_id: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        return json.loads(await self._call(node_id, RELEASE_DURABLE, request, timeout))  # type: ignore[no-any-return]

    async def read_shard(self, node_id: str, request: dict[str, Any],
                         timeout: float) -> tuple[dict[str, Any], list[StoredRecord]]:
        return decode_records(await self._call(node_id, READ_SHARD, request, timeout))

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(grace=None)
