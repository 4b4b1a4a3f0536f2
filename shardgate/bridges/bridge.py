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
rewritten with `local_prefix` / `remote_prefix`, the same way in both directions: each
direction's filters name topics as they are on the side its messages are read from, that side's
prefix included (`out` local topics under `local_prefix`, `inbound` remote topics under
`remote_prefix`); the prefix of the source side is stripped and the other side's added. A
filter outside its side's prefix is refused at start; a message that is not forwarded all the
same (outside the prefix under a wildcard filter, refused locally) is counted by reason and
logged (`BridgeBase.dropped_in`).
Messages the bridge itself brought in are never sent back out; out and in filters that overlap
on the remote side still make a loop through the remote, which this module cannot see (MQTT
3.1.1 has no "no local" option): keep them disjoint.

The bridge talks to the core through its front door (a durable subscription and `Edge.publish`);
it does not go through the local MQTT listener, its authentication or its ACLs. The consumer,
outbox, echo guard and reconnect loop are every bridge's (`bridges.base`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from amqtt.client import MQTTClient

from ..core.message import Message
from .base import (
    OUTSIDE_PREFIX,
    REFUSED_LOCALLY,
    BridgeBase,
    BridgeSettingsBase,
    check_filters_under_prefix,
    rewrite_topic,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..core.edge import Edge

log = logging.getLogger(__name__)

PRODUCER_PROTOCOL = "bridge"
QOS_1 = 1


@dataclass(slots=True)
class BridgeSettings(BridgeSettingsBase):
    """One `[[bridges]]` entry of the configuration; `remote` is
    mqtt://[user:password@]host:port (mqtts:// for TLS)."""

    # Filters subscribed on the remote ("in" is a Python keyword).
    inbound: list[str] = field(default_factory=list)
    remote_prefix: str = ""
    # Empty: "shardgate-bridge-<name>".
    client_id: str = ""
    keep_alive: int = 30
    ack_timeout_s: float = 10.0

    RANGES: ClassVar[dict[str, tuple[float | None, float | None]]] = {
        **BridgeSettingsBase.RANGES, "keep_alive": (0, 65535), "ack_timeout_s": (0.001, None),
    }


class Bridge(BridgeBase[MQTTClient]):
    """A running MQTT bridge: `start()` on the node's loop, `await stop()`; the core calls
    `deliver`."""

    producer_protocol = PRODUCER_PROTOCOL
    kind = "bridge"
    schemes = ("mqtt", "mqtts", "ws", "wss")
    nothing_to_do = "no out or in topic filters"
    log = log

    def __init__(self, edge: Edge, settings: BridgeSettings) -> None:
        super().__init__(edge, settings)
        check_filters_under_prefix(self.kind, settings.name, "inbound", settings.inbound,
                                   "remote_prefix", settings.remote_prefix, log)
        self.settings = settings
        self.client_id = settings.client_id or f"shardgate-bridge-{settings.name}"

    def _brings_in(self, settings: BridgeSettingsBase) -> bool:
        return isinstance(settings, BridgeSettings) and bool(settings.inbound)

    # ------------------------------------------------------------------ the connection
    async def _connect(self) -> MQTTClient:
        # One fresh client per attempt: amqtt's own reconnect is off.
        client = MQTTClient(client_id=self.client_id, config={
            "auto_reconnect": False, "keep_alive": self.settings.keep_alive,
            "default_qos": QOS_1, "cleansession": False,
        })
        await client.connect(self.settings.remote)
        return client

    async def _close(self, client: MQTTClient) -> None:
        await client.disconnect()

    async def _serve(self, client: MQTTClient) -> None:
        self._ready()
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
            batch = await self._next_batch(1)
            if not batch:
                continue
            entry = batch[0]
            message = entry.message
            topic = self._remote_topic(entry, settings.remote_prefix)
            if topic is None:
                continue
            if entry.encoded is None:
                entry.encoded = bytes(message.payload)
            payload = entry.encoded
            assert isinstance(payload, bytes)
            await asyncio.wait_for(
                client.publish(topic, payload, qos=QOS_1, retain=message.retain),
                settings.ack_timeout_s,
            )
            self.forwarded_out += 1
            self.settle(batch)  # the remote has it (PUBACK): the cursor moves on

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
            topic = rewrite_topic(received.topic, settings.remote_prefix, settings.local_prefix)
            if topic is None:
                self.dropped_in(OUTSIDE_PREFIX, received.topic, f"not under remote_prefix "
                                f"{settings.remote_prefix!r}")
                continue
            message = Message(
                topic, bytes(received.data), qos=QOS_1, retain=bool(received.retain),
                producer_protocol=PRODUCER_PROTOCOL, producer_id=self.name,
            )
            try:
                await self._publish_in(message)
            except Exception as exc:  # the remote has its PUBACK already: the message is lost
                self.dropped_in(REFUSED_LOCALLY, topic, str(exc) or type(exc).__name__)


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
