"""`Client`: one gRPC channel to a Shardgate broker, the factory of producers, consumers and `Admin`.

```python
async with Client("127.0.0.1:6650") as client:
    producer = client.producer()
    receipt = await producer.send("sensors/t1", b"21.5")
```

The address comes from the argument, else `SHARDGATE_URL`, else 127.0.0.1:6650.
"""

from __future__ import annotations

import asyncio
import base64
import os
from typing import Any

import grpc

from .admin import Admin
from .consumer import Consumer
from .errors import Unavailable
from .producer import Producer
from .types import Position, SubscriptionType

DEFAULT_URL = "127.0.0.1:6650"
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def resolve_url(url: str | None = None) -> tuple[str, bool]:
    """(`host:port`, tls) from `url`, `SHARDGATE_URL` or the default. `grpcs://` means TLS."""
    text = (url or os.environ.get("SHARDGATE_URL") or DEFAULT_URL).strip()
    tls = False
    for scheme in ("grpc://", "http://", "grpcs://", "https://"):
        if text.startswith(scheme):
            tls = scheme in ("grpcs://", "https://")
            text = text[len(scheme):]
    text = text.rstrip("/")
    if ":" not in text.rsplit("]", 1)[-1]:
        text = f"{text}:6650"
    return text, tls


class Client:
    """A connection to a broker. Use as `async with Client(...)`, or `await connect()` / `close()`.

    `username`/`password` (Basic) or `token` (Bearer) authenticate every call; `tls=True` (or a
    `grpcs://` URL) uses TLS with `root_certificates` (PEM) or the system roots.
    """

    def __init__(
        self, url: str | None = None, *, username: str | None = None, password: str | None = None,
        token: str | None = None, tls: bool | None = None, root_certificates: bytes | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.target, url_tls = resolve_url(url)
        self.tls = url_tls if tls is None else tls
        self.timeout = timeout
        self._root_certificates = root_certificates
        metadata: list[tuple[str, str]] = []
        if username is not None:
            basic = base64.b64encode(f"{username}:{password or ''}".encode()).decode()
            metadata.append(("authorization", f"Basic {basic}"))
        elif token is not None:
            metadata.append(("authorization", f"Bearer {token}"))
        self.metadata = tuple(metadata)
        self._channel: grpc.aio.Channel | None = None
        self._admin: Admin | None = None
        self._children: set[Any] = set()

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            if self.tls:
                credentials = grpc.ssl_channel_credentials(self._root_certificates)
                self._channel = grpc.aio.secure_channel(self.target, credentials, CHANNEL_OPTIONS)
            else:
                self._channel = grpc.aio.insecure_channel(self.target, CHANNEL_OPTIONS)
        return self._channel

    async def connect(self, timeout: float | None = None) -> Client:
        """Open the channel and wait until the broker answers; raises `Unavailable`."""
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout or self.timeout)
        except TimeoutError:
            raise Unavailable(f"no answer from {self.target}") from None
        return self

    async def close(self) -> None:
        for child in list(self._children):
            await child.close()
        self._children.clear()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> Client:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def admin(self) -> Admin:
        if self._admin is None:
            self._admin = Admin(self.channel, self.metadata, self.timeout)
        return self._admin

    def producer(self, name: str = "", **options: Any) -> Producer:
        """A `Producer`; see its docstring for batching and retry options."""
        producer = Producer(self, name, **options)
        self._children.add(producer)
        return producer

    def consumer(
        self, subscription: str, topics: list[str] | str | None = None, *, stream: str | None = None,
        type: SubscriptionType | str = SubscriptionType.EXCLUSIVE,
        position: Position | str = "latest", credit: int = 1000, name: str = "",
        durable: bool = False, reconnect: bool = True, max_deliveries: int = 0,
    ) -> Consumer:
        """A `Consumer` of `subscription` over topic filters or a stream; `await` its
        `subscribe()` (or iterate it) to start. `max_deliveries` (durable subscriptions):
        deliveries of a message after which it goes to the dead-letter topic
        `$dlq/<subscription>` instead (0: the broker's `grpc.max_deliveries`)."""
        if isinstance(topics, str):
            topics = [topics]
        if isinstance(position, str):
            position = {"latest": Position.latest(), "earliest": Position.earliest()}[position]
        consumer = Consumer(
            self, subscription, topics or [], stream=stream, type=SubscriptionType(type),
            position=position, credit=credit, name=name, durable=durable, reconnect=reconnect,
            max_deliveries=max_deliveries,
        )
        self._children.add(consumer)
        return consumer

    def _forget(self, child: Any) -> None:
        self._children.discard(child)
