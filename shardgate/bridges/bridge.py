"""MQTT bridge connector: mirror topic filters to and from another MQTT broker.

One `Bridge` per remote broker, run inside a Shardgate node:

- **out** filters: messages published locally (any protocol) that match are forwarded to the
  remote broker with QoS 1, read through a durable core subscription (`$bridge/<name>`) whose
  cursor advances only once the remote has acknowledged a message (PUBACK). While the remote
  is down the cursor simply stops: messages of reliable streams stay in the journal, survive a
  restart of this node and are sent, in order, when the remote is back (at least once). Messages
  of non-reliable streams have no cursor: they wait in a bounded memory queue (past `max_queued`
  the oldest is dropped and counted).
- **in** filters: subscribed on the remote broker with QoS 1 under a fixed client id and a
  persistent session (clean session off), so the remote keeps what arrives while the bridge is
  away; received messages are published into the local core as producer protocol "bridge".

The remote side speaks MQTT 3.1.1 through amqtt's client (`amqtt.client.MQTTClient`), one fresh
client per connection attempt, with exponential back-off between attempts. Topics may be
rewritten with `local_prefix` / `remote_prefix` (stripped from one side, added on the other).
Messages the bridge itself brought in are never sent back out; out and in filters that overlap
on the remote side still make a loop through the remote, which this module cannot see (MQTT
3.1.1 has no "no local" option): keep them disjoint.

The bridge talks to the core through its front door (a durable subscription and `Edge.publish`); it does not
go through the local MQTT listener, its authentication or its ACLs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from amqtt.client import MQTTClient

from ..core.durable import DurableOptions, DurableSubscription
from ..core.message import Message
from ..logs import ReconnectReport

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..core.edge import Edge
    from ..core.subscriptions import Subscription

log = logging.getLogger(__name__)

PRODUCER_PROTOCOL = "bridge"
QOS_1 = 1


@dataclass(slots=True)
class BridgeSettings:
    """One `[[bridges]]` entry of the configuration."""

    name: str
    # mqtt://[user:password@]host:port (mqtts:// for TLS).
    remote: str
    out: list[str] = field(default_factory=list)
    # Filters subscribed on the remote ("in" is a Python keyword).
    inbound: list[str] = field(default_factory=list)
    local_prefix: str = ""
    remote_prefix: str = ""
    # Empty: "shardgate-bridge-<name>".
    client_id: str = ""
    keep_alive: int = 30
    max_queued: int = 100_000
    ack_timeout_s: float = 10.0
    # Messages handed to the bridge and not yet acknowledged by the remote, at most.
    window: int = 256
    reconnect_min_s: float = 0.2
    reconnect_max_s: float = 10.0


def _rewrite(topic: str, strip: str, add: str) -> str | None:
    if strip:
        if not topic.startswith(strip):
            return None
        topic = topic[len(strip):]
    return add + topic


class Bridge:
    """A running bridge: `start()` on the node's loop, `await stop()`; the core calls `deliver`."""

    def __init__(self, edge: Edge, settings: BridgeSettings) -> None:
        if not settings.out and not settings.inbound:
            raise ValueError(f"bridge {settings.name!r}: no out or in topic filters")
        if urlparse(settings.remote).scheme not in ("mqtt", "mqtts", "ws", "wss"):
            raise ValueError(f"bridge {settings.name!r}: remote must be an mqtt:// URL")
        # The front door: publishes and subscriptions go through it.
        self.edge = edge
        self.broker = edge.broker
        self.settings = settings
        self.name = settings.name
        self.client_id = settings.client_id or f"shardgate-bridge-{settings.name}"
        # (message, subscription) waiting to be sent or acknowledged, in delivery order.
        self.queue: collections.deque[tuple[Message, Subscription]] = collections.deque()
        self._queued_offsets: set[tuple[str, int, int]] = set()
        self.connected = False
        # Counters for the admin API and metrics.
        self.forwarded_out = 0
        self.forwarded_in = 0
        self.dropped = 0
        self.connects = 0
        self._wakeup = asyncio.Event()
        self._subscription: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._client: MQTTClient | None = None
        self._report = ReconnectReport(log, f"bridge {self.name}")

    # ------------------------------------------------------------------ core Consumer
    @property
    def consumer_id(self) -> str:
        return f"bridge:{self.name}"

    @property
    def available(self) -> bool:
        # Messages of non-reliable streams are taken while the remote is away (into the
        # bounded queue); the cursor of a reliable stream waits until the window has room.
        return self.connected and len(self.queue) < self.settings.window

    def deliver(self, message: Message, subscription: Subscription, filters: Sequence[str]) -> None:
        if message.producer_protocol == PRODUCER_PROTOCOL and message.producer_id == self.name:
            subscription.ack(message)  # brought in by this bridge: never echo it back
            return
        if self._reliable(message):
            key = (message.stream, message.shard, message.offset)
            if key in self._queued_offsets:
                return  # a redelivery of what is already waiting here
            self._queued_offsets.add(key)
        elif len(self.queue) >= self.settings.max_queued:
            for index, (queued, _) in enumerate(self.queue):
                if not self._reliable(queued):
                    del self.queue[index]
                    break
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("bridge %s: queue full, %d messages dropped", self.name, self.dropped)
        self.queue.append((message, subscription))
        self._wakeup.set()

    def _reliable(self, message: Message) -> bool:
        stream = self.broker.streams.get(message.stream)
        return stream is not None and stream.reliable and message.offset >= 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.settings.out:
            sub = self.edge.durable_subscription(
                f"$bridge/{self.name}", options=DurableOptions(ack_timeout_s=None), owner=self,
            )
            # Restored from the metadata store after a restart: take it over.
            sub.owner = self
            sub.options = DurableOptions(ack_timeout_s=None)
            for topic_filter in list(sub.filters):
                if topic_filter not in self.settings.out:
                    self.edge.remove_filter(sub, topic_filter)
            for topic_filter in self.settings.out:
                self.edge.add_filter(sub, topic_filter)
            self.edge.attach(sub, self)
            self._subscription = sub
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"bridge-{self.name}")

    async def stop(self) -> None:
        """Stop forwarding; the durable subscription stays, so what the remote did not
        acknowledge is sent when the bridge next runs."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._subscription is not None:
            self.edge.detach(self._subscription, self)
        lost = sum(1 for message, _ in self.queue if not self._reliable(message))
        if lost:
            log.warning("bridge %s: stopped with %d messages of non-reliable streams not forwarded",
                        self.name, lost)

    @property
    def backlog(self) -> int:
        """Messages not yet acknowledged by the remote: behind the cursor on reliable streams,
        plus those of non-reliable streams queued in memory."""
        lag = self._subscription.lag() if isinstance(self._subscription, DurableSubscription) else 0
        return lag + sum(1 for message, _ in self.queue if not self._reliable(message))

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name, "remote": urlparse(self.settings.remote).hostname,
            "connected": self.connected, "queued": self.backlog, "dropped": self.dropped,
            "forwarded_out": self.forwarded_out, "forwarded_in": self.forwarded_in,
            "connects": self.connects,
        }

    # ------------------------------------------------------------------ the connection loop
    async def _run(self) -> None:
        delay = self.settings.reconnect_min_s
        while True:
            client = MQTTClient(client_id=self.client_id, config={
                "auto_reconnect": False, "keep_alive": self.settings.keep_alive,
                "default_qos": QOS_1, "cleansession": False,
            })
            self._client = client
            try:
                await client.connect(self.settings.remote)
            except Exception as exc:  # amqtt raises ConnectError and others
                self._report.failed(exc, self.settings.reconnect_max_s)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.reconnect_max_s)
                continue
            delay = self.settings.reconnect_min_s
            self.connected = True
            if self._subscription is not None:
                self._subscription.wake()  # the cursor resumes from where the remote stopped it
            self.connects += 1
            self._report.connected(urlparse(self.settings.remote).netloc)
            try:
                await self._serve(client)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.disconnect(), 2)
                raise
            except Exception as exc:
                self._report.lost(exc)
            finally:
                self.connected = False
                self._client = None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.disconnect(), 2)
            await asyncio.sleep(self.settings.reconnect_min_s)

    async def _serve(self, client: MQTTClient) -> None:
        receiver: asyncio.Task[None] | None = None
        if self.settings.inbound:
            codes = await client.subscribe([(f, QOS_1) for f in self.settings.inbound])
            for topic_filter, code in zip(self.settings.inbound, codes, strict=False):
                if code not in (0, 1, 2):
                    log.warning("bridge %s: remote refused subscription %r (0x%02x)",
                                self.name, topic_filter, code)
            receiver = asyncio.get_running_loop().create_task(self._receive(client))
        try:
            await self._forward(client, receiver)
        finally:
            if receiver is not None:
                receiver.cancel()
                with contextlib.suppress(BaseException):
                    await receiver

    def _alive(self, client: MQTTClient) -> bool:
        session = client.session
        return session is not None and session.transitions.is_connected()

    async def _forward(self, client: MQTTClient, receiver: asyncio.Task[None] | None) -> None:
        settings = self.settings
        while True:
            if receiver is not None and receiver.done():
                receiver.result()  # raises what ended it
                raise ConnectionError("remote stopped delivering")
            if not self._alive(client):
                raise ConnectionError("remote connection closed")
            if not self.queue:
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), 1.0)
                continue
            head = self.queue[0]
            message, subscription = head
            topic = _rewrite(message.topic, settings.local_prefix, settings.remote_prefix)
            if topic is not None and not message.expired():
                await asyncio.wait_for(
                    client.publish(topic, bytes(message.payload), qos=QOS_1, retain=message.retain),
                    settings.ack_timeout_s,
                )
                self.forwarded_out += 1
            if self.queue and self.queue[0] is head:
                self.queue.popleft()
                self._queued_offsets.discard((message.stream, message.shard, message.offset))
                subscription.ack(message)  # the remote has it: the cursor moves on
                subscription.wake()  # the window has room again

    async def _receive(self, client: MQTTClient) -> None:
        settings = self.settings
        while True:
            try:
                received = await client.deliver_message(1.0)
            except TimeoutError:
                if not self._alive(client):
                    return
                continue
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                return  # amqtt cancelled its own delivery task: the connection went away
            if received is None:
                continue
            topic = _rewrite(received.topic, settings.remote_prefix, settings.local_prefix)
            if topic is None:
                continue
            message = Message(
                topic, bytes(received.data), qos=QOS_1, retain=bool(received.retain),
                producer_protocol=PRODUCER_PROTOCOL, producer_id=self.name,
            )
            try:
                pending = self.edge.publish(message)
                if pending is not None:
                    await pending
            except Exception as exc:
                log.warning("bridge %s: message on %r not accepted locally: %s", self.name, topic, exc)
                continue
            self.forwarded_in += 1


def start_bridges(app: Any, entries: Sequence[BridgeSettings]) -> list[Bridge]:
    """Start one bridge per entry on the running loop; keeps them in `app.bridges`."""
    bridges = []
    for entry in entries:
        bridge = Bridge(app.edge, entry)
        bridge.start()
        bridges.append(bridge)
    app.bridges = [*getattr(app, "bridges", []), *bridges]
    return bridges


async def stop_bridges(app: Any) -> None:
    for bridge in getattr(app, "bridges", []):
        await bridge.stop()
    app.bridges = []
