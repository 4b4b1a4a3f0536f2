"""`Consumer`: an async iterator over a subscription, with acks, nacks, credit and reconnects.

```python
consumer = client.consumer("billing", ["orders/#"], type="shared")
await consumer.subscribe()          # raises FailedPrecondition for a busy Exclusive subscription
async for message in consumer:
    handle(message.payload)
    message.ack()
```

Flow control: the broker pushes at most `credit` messages ahead; the consumer grants more as the
application takes messages, so a slow application holds the broker back instead of being
flooded. Acks and nacks are batched: they leave together once `ack_batch` of them are waiting,
`ack_interval_s` after the first one, with the next credit grant, or on `close()` — one gRPC
write for many messages, which is what lets a Python consumer keep up with a streaming producer.
`receive_batch()` takes every message already received in one call.

When the stream breaks for a reason worth retrying (broker restart, network), the consumer
resubscribes with exponential backoff and carries on; acks of messages received before the
break are dropped (the broker hands those messages to another consumer, or, for durable
subscriptions, redelivers them). Errors that retrying cannot fix end the iteration by raising.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import random
from collections import deque
from collections.abc import Awaitable, Generator
from typing import TYPE_CHECKING, Any

import grpc

from ..proto import shardgate_pb2 as pb
from ..proto import shardgate_pb2_grpc as pb_grpc
from .errors import (
    FINAL,
    FailedPrecondition,
    ShardgateError,
    Unavailable,
    error_for,
    from_rpc_error,
)
from .types import Position, ReceivedMessage, SubscriptionType

if TYPE_CHECKING:
    from .client import Client

_CLOSED = object()


class Consumer:
    """A consumer of one subscription. Create it with `Client.consumer()`."""

    def __init__(
        self, client: Client, subscription: str, topics: list[str], *, stream: str | None = None,
        type: SubscriptionType = SubscriptionType.EXCLUSIVE, position: Position | None = None,
        credit: int = 1000, name: str = "", durable: bool = False, reconnect: bool = True,
        retries: int | None = None, backoff_s: float = 0.1, max_backoff_s: float = 2.0,
        ack_batch: int = 256, ack_interval_s: float = 0.01, max_deliveries: int = 0,
    ) -> None:
        self._client = client
        self.subscription = subscription
        self.topics = list(topics)
        self.stream = stream
        self.type = type
        self.position = position or Position.latest()
        self.credit = max(1, credit)
        self.name = name
        self.durable = durable
        self.max_deliveries = max(0, max_deliveries)
        self.reconnect = reconnect
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.consumer_id = ""
        self.active = False
        self.errors: list[ShardgateError] = []
        self._stub = pb_grpc.ConsumerStub(client.channel)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._generation = 0
        self.ack_batch = max(1, ack_batch)
        self.ack_interval_s = ack_interval_s
        # Received messages (and, last, the error or _CLOSED that ended the stream).
        self._received: deque[object] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._taken = 0
        self._acks: list[int] = []
        # Futures of `ack()`/`nack()` calls, resolved once their batch is written.
        self._settled: list[asyncio.Future[None]] = []
        self._nacks: dict[int, list[int]] = {}
        self._credit_due = 0
        self._flush_timer: asyncio.TimerHandle | None = None
        self._sending: asyncio.Future[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self._active_changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._write_lock = asyncio.Lock()

    # ---------------------------------------------------------------- lifecycle
    async def subscribe(self) -> Consumer:
        """Open the stream and wait for the broker to accept the subscription."""
        if self._reader is None:
            await self._open()
            self._reader = asyncio.ensure_future(self._read_loop())
        return self

    async def _open(self) -> None:
        request = pb.Subscribe(
            subscription=self.subscription, type=self.type.to_pb(), topic_filters=self.topics,
            stream=self.stream or "", position=self.position.to_pb(), credit=self.credit,
            consumer_name=self.name, durable=self.durable, max_deliveries=self.max_deliveries,
        )
        call = self._stub.Subscribe(metadata=self._client.metadata)
        try:
            await call.write(pb.ConsumeRequest(subscribe=request))
            first = await asyncio.wait_for(call.read(), self._client.timeout)
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            raise from_rpc_error(exc) from None
        except TimeoutError:
            call.cancel()
            raise Unavailable("the broker did not answer the subscription") from None
        if first is grpc.aio.EOF or first.WhichOneof("response") != "subscribed":
            call.cancel()
            raise Unavailable("the broker ended the stream before accepting the subscription")
        self._generation += 1
        self._loop = asyncio.get_running_loop()
        self._call = call
        # Settlements of the broken stream are void, and the new stream starts with full credit.
        self._taken = self._credit_due = 0
        self._acks, self._nacks = [], {}
        self.consumer_id = first.subscribed.consumer_id
        self._set_active(first.subscribed.active)

    async def close(self) -> None:
        """Send pending acks, end the stream; unacknowledged messages go to other consumers."""
        if self._closed:
            return
        self._closed = True
        if self._sending is not None and not self._sending.done():
            with contextlib.suppress(Exception):
                await self._sending
        await self._send_settlements()
        call = self._call
        if call is not None:
            with contextlib.suppress(Exception):
                async with self._write_lock:
                    await call.done_writing()
        if self._reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), 2.0)
            except (TimeoutError, Exception):
                self._reader.cancel()
        if call is not None:
            call.cancel()
        self._push(_CLOSED)
        self._client._forget(self)

    async def __aenter__(self) -> Consumer:
        return await self.subscribe()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------------- receiving
    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> ReceivedMessage:
        try:
            return await self.receive()
        except StopAsyncIteration:
            raise
        except _Closed:
            raise StopAsyncIteration from None

    def _push(self, item: object) -> None:
        self._received.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait_received(self, timeout: float | None) -> None:
        """Until something was received (raises `TimeoutError` after `timeout` seconds)."""
        if self._reader is None:
            await self.subscribe()
        while not self._received:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                if timeout is None:
                    await waiter
                else:
                    await asyncio.wait_for(waiter, timeout)
            finally:
                self._waiter = None

    def _end_item(self, item: object) -> None:
        """`item` ended the stream: keep it for the next call, and raise it."""
        self._received.appendleft(item)
        if item is _CLOSED:
            raise _Closed()
        assert isinstance(item, BaseException)
        raise item

    async def receive(self, timeout: float | None = None) -> ReceivedMessage:
        """The next message; raises `TimeoutError` after `timeout` seconds, the subscription's
        error if it ended, or `StopAsyncIteration` once closed."""
        received = self._received
        if not received:
            await self._wait_received(timeout)
        item = received.popleft()
        if type(item) is not ReceivedMessage:
            self._end_item(item)
        self._taken += 1
        if self._taken >= self._grant_every:
            self._grant(self._taken)
            self._taken = 0
        return item  # type: ignore[return-value]

    async def receive_batch(self, max_messages: int = 1000,
                            timeout: float | None = None) -> list[ReceivedMessage]:
        """Every message already received (at most `max_messages`), waiting up to `timeout`
        seconds for the first one; raises as `receive()` does when nothing is left."""
        received = self._received
        if not received:
            await self._wait_received(timeout)
        batch: list[ReceivedMessage] = []
        while received and len(batch) < max_messages:
            item = received[0]
            if type(item) is not ReceivedMessage:
                if not batch:
                    received.popleft()
                    self._end_item(item)
                break
            batch.append(received.popleft())  # type: ignore[arg-type]
        self._taken += len(batch)
        if self._taken >= self._grant_every:
            self._grant(self._taken)
            self._taken = 0
        return batch

    @property
    def buffered(self) -> int:
        """Messages received from the broker that the application has not taken yet."""
        return sum(1 for item in self._received if type(item) is ReceivedMessage)

    @property
    def _grant_every(self) -> int:
        return max(1, self.credit // 2)

    async def wait_active(self, timeout: float | None = None) -> None:
        """Until this consumer is the active one (Failover standbys wait here)."""
        while not self.active:
            self._active_changed.clear()
            await asyncio.wait_for(self._active_changed.wait(), timeout)

    def _set_active(self, active: bool) -> None:
        self.active = active
        self._active_changed.set()

    # ---------------------------------------------------------------- acks, nacks, credit
    def _settle(self, generation: int, message: ReceivedMessage, ok: bool,
                delay_s: float) -> Awaitable[None]:
        """Queue an ack or nack; the awaitable is done once it is written to the stream."""
        loop = self._loop
        if loop is not None and not _running_on(loop):
            done: concurrent.futures.Future[None] = concurrent.futures.Future()

            def settle_on_loop() -> None:
                future = self._settle(generation, message, ok, delay_s)
                asyncio.ensure_future(future).add_done_callback(
                    lambda f: done.set_exception(f.exception()) if f.exception() else done.set_result(None))

            loop.call_soon_threadsafe(settle_on_loop)
            return asyncio.wrap_future(done) if _running_loop() is not None else _Ready(done)
        future: asyncio.Future[None] = (loop or asyncio.get_event_loop()).create_future()
        if generation != self._generation or self._closed and self._call is None:
            future.set_result(None)  # received on a stream that has since broken: redelivered
            return future
        self._settled.append(future)
        if ok:
            acks = self._acks
            acks.append(message.delivery_id)
            if len(acks) < self.ack_batch:
                if self._flush_timer is None and loop is not None:
                    self._flush_timer = loop.call_later(self.ack_interval_s, self._flush)
                return future
        else:
            self._nacks.setdefault(round(delay_s * 1000), []).append(message.delivery_id)
        self._flush()
        return future

    def _flush(self) -> None:
        """Send what is waiting (acks, nacks, credit) from one task, in order."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._sending is None or self._sending.done():
            self._sending = asyncio.ensure_future(self._send_settlements())

    async def _send_settlements(self) -> None:
        while True:
            if self._flush_timer is not None:
                self._flush_timer.cancel()
                self._flush_timer = None
            call = self._call
            acks, self._acks = self._acks, []
            nacks, self._nacks = self._nacks, {}
            credit, self._credit_due = self._credit_due, 0
            settled, self._settled = self._settled, []
            if call is None or not (acks or nacks or credit):
                _resolve(settled)
                return
            try:
                # Acks first, so that a durable subscription's cursor moves before more is pushed.
                if acks:
                    await self._write(call, pb.ConsumeRequest(ack=pb.Ack(delivery_ids=acks)))
                for delay_ms, ids in nacks.items():
                    await self._write(call, pb.ConsumeRequest(
                        nack=pb.Nack(delivery_ids=ids, delay_ms=delay_ms)))
            finally:
                _resolve(settled)
            if credit:
                await self._write(call, pb.ConsumeRequest(credit=pb.Credit(credit=credit)))

    async def _write(self, call: grpc.aio.StreamStreamCall, request: pb.ConsumeRequest) -> None:
        """One writer at a time: gRPC refuses concurrent writes on a call."""
        async with self._write_lock:
            current = self._call
            if current is None or call is not current or current.done():
                return
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError):
                await call.write(request)

    def _grant(self, credit: int) -> None:
        if self._call is None:
            return
        self._credit_due += credit
        self._flush()  # acks waiting go with it

    # ---------------------------------------------------------------- the stream
    async def _read_loop(self) -> None:
        attempt = 0
        while True:
            call = self._call
            error: ShardgateError | None = None
            try:
                assert call is not None
                await self._pump(call)
                if self._closed:
                    return
                error = Unavailable("the broker ended the subscription stream")
            except grpc.aio.AioRpcError as exc:
                if self._closed:
                    return
                error = from_rpc_error(exc)
            except asyncio.CancelledError:
                return
            # Messages still queued locally came from the broken stream: they are still handed
            # to the application (at least once), but their acks are void.
            self._call = None
            while True:
                # A busy Exclusive subscription may still hold our previous stream's consumer.
                busy = attempt > 0 and attempt < 20 and isinstance(error, FailedPrecondition)
                if not self.reconnect or (error.code in FINAL and not busy) or (
                        self.retries is not None and attempt >= self.retries):
                    self._push(error)
                    return
                attempt += 1
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                if self._closed:
                    return
                try:
                    await self._open()
                    attempt = 0
                    break
                except ShardgateError as exc:
                    error = exc

    async def _pump(self, call: grpc.aio.StreamStreamCall) -> None:
        settle = functools.partial(self._settle, self._generation)
        from_pb = ReceivedMessage.from_pb
        received = self._received
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                return
            kind = response.WhichOneof("response")
            if kind == "messages":
                received.extend([from_pb(message, settle) for message in response.messages.messages])
                waiter = self._waiter
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            elif kind == "status":
                self._set_active(response.status.active)
            elif kind == "error":
                self.errors.append(error_for(response.error.code, response.error.error))


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    return asyncio._get_running_loop() is loop  # the C accessor: no exception off the loop


class _Closed(ShardgateError):
    def __init__(self) -> None:
        super().__init__("the consumer is closed", grpc.StatusCode.CANCELLED)


def _resolve(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class _Ready:
    """What `ack()` returns to a thread without an event loop (the sync client): `wait()`
    blocks until the settlement is written; nothing needs to be done with it."""

    __slots__ = ("_future",)

    def __init__(self, future: concurrent.futures.Future[None]) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> None:
        self._future.result(timeout)

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.wrap_future(self._future).__await__()
