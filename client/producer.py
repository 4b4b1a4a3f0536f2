"""`Producer`: publishes messages, batched over one `PublishStream`, with retries and backoff.

`send()` and `send_nowait()` put the message into the current batch; a batch leaves when it is
full (`max_batch_messages` / `max_batch_bytes`) or after `linger_s` (by default at the next turn
of the event loop), and at most `max_inflight_batches` wait for their acknowledgement. Batches go
out, and are acknowledged, in order, so messages keep their order per key (and per topic).

When the stream breaks (broker restarting, network), the producer reconnects with exponential
backoff and resends the batches not yet acknowledged, in order. A message the broker refuses
(schema mismatch, too large) fails its own future only.

`publish()` is the unary alternative: one round trip per message, also retried (after
UNAVAILABLE, DEADLINE_EXCEEDED or ABORTED).

Idempotent (the default, `idempotent=True`): every message carries the producer's identity (16
random bytes chosen per `Producer`) and its own sequence number, and whatever is sent again (a
retried `publish`, the batches resent on a new stream) is marked so. The broker then answers a
message it already stored with where it stored it, instead of storing it twice: a publish whose
answer was lost, or that outlived its deadline (a failover, a replicated shard below its
minimum of in-sync replicas), is stored once. The broker's look-up reaches back to 30 s before
the first send, for a resend up to 5 minutes after it (`ProducerIdentity` in
`proto/shardgate.proto` gives the bound); a resend beyond is stored again: at least once, as
with `idempotent=False`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
from collections import OrderedDict
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from ..proto import shardgate_pb2 as pb
from ..proto import shardgate_pb2_grpc as pb_grpc
from .errors import FINAL, RETRYABLE, ShardgateError, Unavailable, error_for, from_rpc_error
from .types import Receipt

if TYPE_CHECKING:
    from .client import Client

_T = TypeVar("_T")

Headers = dict[str, str] | list[tuple[str, str]] | None
_Entry = tuple[pb.PublishBatch, list[asyncio.Future[Receipt]]]


class Producer:
    """Publishes to topic names (or to a stream by name). Create it with `Client.producer()`."""

    def __init__(
        self, client: Client, name: str = "", *, max_batch_messages: int = 1000,
        max_batch_bytes: int = 1024 * 1024, linger_s: float = 0.0, max_inflight_batches: int = 16,
        retries: int = 5, backoff_s: float = 0.1, max_backoff_s: float = 2.0,
        idempotent: bool = True,
    ) -> None:
        self._client = client
        self.name = name
        # This producer's identity (see the module docstring); None: not idempotent.
        self.producer_id: bytes | None = os.urandom(16) if idempotent else None
        self._next_message = 1  # the sequence number of the next message
        self.max_batch_messages = max_batch_messages
        self.max_batch_bytes = max_batch_bytes
        self.linger_s = linger_s
        self.max_inflight_batches = max_inflight_batches
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._stub = pb_grpc.ProducerStub(client.channel)
        self._batch: list[pb.PublishRequest] = []
        self._batch_futures: list[asyncio.Future[Receipt]] = []
        self._batch_bytes = 0
        self._flush_handle: asyncio.Handle | None = None
        self._sequence = itertools.count(1)
        self._queue: asyncio.Queue[_Entry | None] = asyncio.Queue()
        self._inflight: OrderedDict[int, _Entry] = OrderedDict()
        # batch sequence -> when it was first written (loop time), while not acknowledged
        self._first_sent: dict[int, float] = {}
        self._acked = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._closed = False

    # ---------------------------------------------------------------- building requests
    def _request(
        self, topic: str, payload: bytes | str, *, key: bytes | str | None = None,
        headers: Headers = None, content_type: str = "", correlation_data: bytes = b"",
        reply_to: str = "", ttl_ms: int = 0, retain: bool = False, stream: str = "",
    ) -> pb.PublishRequest:
        if isinstance(payload, str):
            payload = payload.encode()
        request = pb.PublishRequest(
            topic=topic, payload=payload, content_type=content_type,
            correlation_data=correlation_data, reply_to=reply_to, ttl_ms=ttl_ms, retain=retain,
            stream=stream, producer_name=self.name,
        )
        if key is not None:
            request.key = key.encode() if isinstance(key, str) else key
        if headers:
            items = headers.items() if isinstance(headers, dict) else headers
            request.headers.extend(pb.Header(key=k, value=v) for k, v in items)
        return request

    # ---------------------------------------------------------------- unary
    async def publish(self, topic: str, payload: bytes | str, **fields: object) -> Receipt:
        """Publish one message with a unary call (retried on UNAVAILABLE); returns where it
        was stored. Takes the same keyword fields as `send`."""
        request = self._request(topic, payload, **fields)  # type: ignore[arg-type]
        if self.producer_id is not None:
            request.identity.producer_id = self.producer_id
            request.identity.sequence = self._take_sequences(1)
        loop = asyncio.get_running_loop()
        first_sent = loop.time()
        attempt = 0
        while True:
            if attempt and self.producer_id is not None:
                # sent before: the broker answers with the first copy if it stored one
                request.identity.resent = True
                request.identity.first_sent_ms_ago = int((loop.time() - first_sent) * 1000)
            try:
                response = await self._stub.Publish(
                    request, metadata=self._client.metadata, timeout=self._client.timeout)
                return Receipt(response.stream, response.shard, response.offset)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE or attempt >= self.retries:
                    raise from_rpc_error(exc) from None
            attempt += 1
            await asyncio.sleep(self._backoff(attempt))

    # ---------------------------------------------------------------- streaming
    async def send(self, topic: str, payload: bytes | str, **fields: object) -> Receipt:
        """Publish through the batching stream and wait for the broker's acknowledgement.

        Fields: `key`, `headers` (dict or list of pairs), `content_type`, `correlation_data`,
        `reply_to`, `ttl_ms`, `retain`, `stream` (the stream the topic must resolve to)."""
        return await self.send_nowait(topic, payload, **fields)

    def send_nowait(self, topic: str, payload: bytes | str, **fields: object) -> asyncio.Future[Receipt]:
        """Queue a message into the current batch; the future resolves with its `Receipt`."""
        if self._closed:
            raise ShardgateError("the producer is closed")
        request = self._request(topic, payload, **fields)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Receipt] = loop.create_future()
        self._batch.append(request)
        self._batch_futures.append(future)
        self._batch_bytes += len(request.payload)
        if len(self._batch) >= self.max_batch_messages or self._batch_bytes >= self.max_batch_bytes:
            self._seal()
        elif self._flush_handle is None:
            if self.linger_s > 0:
                self._flush_handle = loop.call_later(self.linger_s, self._seal)
            else:
                self._flush_handle = loop.call_soon(self._seal)
        return future

    def _seal(self) -> None:
        """Close the current batch and queue it for the stream."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if not self._batch:
            return
        batch = pb.PublishBatch(sequence=next(self._sequence), messages=self._batch)
        if self.producer_id is not None:
            batch.identity.producer_id = self.producer_id
            batch.identity.sequence = self._take_sequences(len(self._batch))
        self._queue.put_nowait((batch, self._batch_futures))
        self._batch, self._batch_futures, self._batch_bytes = [], [], 0
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._run())

    async def flush(self) -> None:
        """Wait until every message sent so far is acknowledged (or failed)."""
        self._seal()
        futures = [f for _, fs in list(self._inflight.values()) for f in fs]
        futures += [f for entry in list(self._queue._queue) if entry for f in entry[1]]  # type: ignore[attr-defined]
        if futures:
            await asyncio.wait(futures)

    async def __aenter__(self) -> Producer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Flush, then end the stream."""
        if self._closed:
            return
        with contextlib.suppress(Exception):
            await self.flush()
        self._closed = True
        self._queue.put_nowait(None)
        if self._pump is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._pump, self._client.timeout)
        self._client._forget(self)

    def _take_sequences(self, count: int) -> int:
        """Number `count` messages: returns the first one's sequence number."""
        first = self._next_message
        self._next_message = first + count
        return first

    def _backoff(self, attempt: int) -> float:
        delay = min(self.max_backoff_s, self.backoff_s * (2 ** (attempt - 1)))
        return delay * random.uniform(0.8, 1.2)

    async def _run(self) -> None:
        """Own the PublishStream: write batches, read acks, reconnect and resend on failure."""
        attempt = 0
        while True:
            call = self._stub.PublishStream(metadata=self._client.metadata)
            receiver = asyncio.ensure_future(self._receive(call))
            try:
                now = asyncio.get_running_loop().time()
                for batch, _ in list(self._inflight.values()):
                    if self.producer_id is not None:
                        # written before, on the stream that broke: the broker may hold it
                        batch.identity.resent = True
                        first_sent = self._first_sent.get(batch.sequence, now)
                        batch.identity.first_sent_ms_ago = int((now - first_sent) * 1000)
                    await call.write(batch)
                while True:
                    entry = await self._wait(self._queue.get(), receiver)
                    if entry is None:
                        await call.done_writing()
                        await receiver
                        return
                    while len(self._inflight) >= self.max_inflight_batches:
                        self._acked.clear()
                        await self._wait(self._acked.wait(), receiver)
                    self._inflight[entry[0].sequence] = entry
                    self._first_sent[entry[0].sequence] = asyncio.get_running_loop().time()
                    await call.write(entry[0])
                    attempt = 0
            except (grpc.aio.AioRpcError, ShardgateError, asyncio.InvalidStateError) as exc:
                error = from_rpc_error(exc) if isinstance(exc, grpc.aio.AioRpcError) else exc
                if not isinstance(error, ShardgateError):
                    error = Unavailable(str(error))
                if error.code in FINAL or attempt >= self.retries or self._closed:
                    self._fail_all(error)
                    return
                attempt += 1
                await asyncio.sleep(self._backoff(attempt))
            finally:
                receiver.cancel()
                call.cancel()

    @staticmethod
    async def _wait(awaitable: Awaitable[_T], receiver: asyncio.Future[None]) -> _T:
        """Await `awaitable` unless the ack reader ends first (then raise why it ended)."""
        task = asyncio.ensure_future(awaitable)
        waiting: set[asyncio.Future[Any]] = {task, receiver}
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        receiver.result()
        raise Unavailable("the publish stream ended")

    async def _receive(self, call: grpc.aio.StreamStreamCall) -> None:
        inflight = self._inflight
        while True:
            ack = await call.read()
            if ack is grpc.aio.EOF:
                if inflight:
                    raise Unavailable("the broker ended the publish stream")
                return
            entry = inflight.pop(ack.sequence, None)
            if entry is None:
                continue
            self._first_sent.pop(ack.sequence, None)
            for result, future in zip(ack.results, entry[1], strict=False):
                if future.done():
                    continue
                if result.code == 0:
                    future.set_result(Receipt(result.stream, result.shard, result.offset))
                else:
                    future.set_exception(error_for(result.code, result.error))
            self._acked.set()

    def _fail_all(self, error: ShardgateError) -> None:
        """Fail every queued and unacknowledged message; the next send opens a new stream."""
        entries = list(self._inflight.values())
        self._inflight.clear()
        self._first_sent.clear()
        while not self._queue.empty():
            entry = self._queue.get_nowait()
            if entry is not None:
                entries.append(entry)
        for _, futures in entries:
            for future in futures:
                if not future.done():
                    future.set_exception(error)
