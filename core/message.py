"""The message model shared by every protocol.

A `Message` carries the same fields whichever protocol brought it in: MQTT 5 user properties,
AMQP headers and gRPC metadata all become `headers`; MQTT response topic and AMQP reply-to
become `reply_to`. The core fills `stream`, `shard` and `offset` when it appends the message.

What the common fields cannot say travels in `native_properties`: the exact encoding of the
properties in the sending protocol's own format, by format name (AMQP's typed header table and
basic properties as `amqp-0-9-1`). The journal and the archive keep it byte for byte, so a
consumer of the same protocol gets back exactly what was published, across restarts and
archive replay; every other protocol reads the common fields. The core never looks inside.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(slots=True, eq=False)
class Message:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    key: bytes | None = None
    headers: list[tuple[str, str]] | None = None
    content_type: str | None = None
    correlation_data: bytes | None = None
    reply_to: str | None = None
    payload_format: int | None = None
    # Absolute expiry time in epoch milliseconds (MQTT 5 message expiry, AMQP expiration).
    expires_at_ms: int | None = None
    publish_time_ms: int = field(default_factory=now_ms)
    producer_protocol: str = ""
    producer_id: str = ""
    stream: str = ""
    shard: int = 0
    offset: int = -1
    # Exact encodings of the properties, by format name; opaque to the core (see above).
    native_properties: dict[str, bytes] | None = None
    # Encoded forms cached by protocol adapters so that many subscribers share one encoding.
    encoded: dict[Any, bytes] | None = None
    # The producer does not ask for it to be stored (an AMQP delivery-mode 1 message): on a
    # reliable stream it is journaled only when a durable subscription (or, in a cluster, a
    # subscription on another node) wants it, else it is
    # delivered from memory in its place among the stored messages, as RabbitMQ keeps
    # transient messages (see Broker.publish).
    transient: bool = False

    def expired(self, at_ms: int | None = None) -> bool:
        if self.expires_at_ms is None:
            return False
        return (at_ms if at_ms is not None else now_ms()) >= self.expires_at_ms

    def remaining_expiry_s(self, at_ms: int | None = None) -> int | None:
        """Seconds left before expiry (rounded up), None if the message never expires."""
        if self.expires_at_ms is None:
            return None
        left = self.expires_at_ms - (at_ms if at_ms is not None else now_ms())
        return max(0, -(-left // 1000))

