"""A blocking wrapper over the async SDK, for scripts and code without an event loop.

```python
with SyncClient("127.0.0.1:6650") as client:
    client.producer().send("sensors/t1", b"21.5")
    for message in client.consumer("audit", ["sensors/#"]).iter(timeout=5):
        message.ack()
```

The async client runs on an event loop in a background thread; each call waits for its result.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from .admin import Admin
from .client import Client
from .consumer import Consumer
from .producer import Producer
from .types import Receipt, ReceivedMessage

T = TypeVar("T")


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="shardgate-client")
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class _SyncProxy:
    """Calls the wrapped object's coroutine methods and waits for them."""

    def __init__(self, loop: _Loop, target: Any) -> None:
        self._loop = loop
        self._target = target

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._target, name)
        if not callable(attribute) or not asyncio.iscoroutinefunction(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._loop.run(attribute(*args, **kwargs))

        call.__doc__ = attribute.__doc__
        return call


class SyncProducer(_SyncProxy):
    """`send()` and `publish()` block until the broker acknowledges."""

    _target: Producer

    def send(self, topic: str, payload: bytes | str, **fields: object) -> Receipt:
        return self._loop.run(self._target.send(topic, payload, **fields))

    def send_many(self, messages: list[tuple[str, bytes | str]], **fields: object) -> list[Receipt]:
        """Send many messages in batches and wait for all of them."""

        async def run() -> list[Receipt]:
            futures = [self._target.send_nowait(t, p, **fields) for t, p in messages]
            return list(await asyncio.gather(*futures))

        return self._loop.run(run())

    def __enter__(self) -> SyncProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncConsumer(_SyncProxy):
    _target: Consumer

    def receive(self, timeout: float | None = None) -> ReceivedMessage:
        return self._loop.run(self._target.receive(timeout))

    def receive_batch(self, max_messages: int = 1000,
                      timeout: float | None = None) -> list[ReceivedMessage]:
        """Every message already received (at most `max_messages`), waiting up to `timeout`
        seconds for the first one."""
        return self._loop.run(self._target.receive_batch(max_messages, timeout))

    def iter(self, timeout: float | None = None) -> Iterator[ReceivedMessage]:
        """Messages until none arrives within `timeout` seconds (forever if None)."""
        while True:
            try:
                yield self.receive(timeout)
            except TimeoutError:
                return

    def __iter__(self) -> Iterator[ReceivedMessage]:
        return self.iter()


class SyncClient:
    """The blocking twin of `Client`: same arguments, same methods, no `await`."""

    def __init__(self, url: str | None = None, **options: Any) -> None:
        self._loop = _Loop()

        async def make() -> Client:
            client = Client(url, **options)
            client.admin  # noqa: B018 - open the channel on the loop's thread
            return client

        self._client = self._loop.run(make())
        self.admin: Admin = _SyncProxy(self._loop, self._client.admin)  # type: ignore[assignment]

    @property
    def target(self) -> str:
        return self._client.target

    def connect(self, timeout: float | None = None) -> SyncClient:
        self._loop.run(self._client.connect(timeout))
        return self

    def producer(self, name: str = "", **options: Any) -> SyncProducer:
        async def make() -> Producer:
            return self._client.producer(name, **options)

        return SyncProducer(self._loop, self._loop.run(make()))

    def consumer(self, subscription: str, topics: list[str] | str | None = None,
                 **options: Any) -> SyncConsumer:
        async def make() -> Consumer:
            return self._client.consumer(subscription, topics, **options)

        return SyncConsumer(self._loop, self._loop.run(make()))

    def close(self) -> None:
        try:
            self._loop.run(self._client.close(), 10)
        finally:
            self._loop.stop()

    def __enter__(self) -> SyncClient:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()
