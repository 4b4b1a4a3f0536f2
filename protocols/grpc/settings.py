"""Settings of the gRPC protocol layer: limits and defaults of the native API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

DEFAULT_PORT = 6650


@dataclass(slots=True)
class GrpcSettings:
    # The largest payload accepted in one message (RESOURCE_EXHAUSTED beyond it).
    max_payload_bytes: int = 1024 * 1024
    # The largest gRPC frame the server reads (a whole PublishBatch); gRPC refuses larger ones
    # with RESOURCE_EXHAUSTED before they reach the servicers.
    max_receive_message_bytes: int = 16 * 1024 * 1024
    max_send_message_bytes: int = 16 * 1024 * 1024
    # Messages held for a consumer that has no credit left; beyond it the oldest are dropped
    # (live subscriptions) and counted in the broker's messages_dropped.
    max_pending_per_consumer: int = 10_000
    # Credit a consumer gets when its Subscribe asks for none.
    default_credit: int = 1000
    # At most this many messages per MessageBatch pushed to a consumer.
    max_batch_messages: int = 500
    allow_anonymous: bool = True
    # Durable subscriptions that do not ask for their own (`Subscribe.max_deliveries`):
    # deliveries of a message before it goes to the dead-letter topic `$dlq/<subscription>`
    # (0: never dead-letter).
    max_deliveries: int = 0

    # The allowed range of each numeric setting, inclusive (None: no bound), checked by the
    # configuration loader with the file, the name and the value.
    RANGES: ClassVar[dict[str, tuple[float | None, float | None]]] = {
        "max_payload_bytes": (1, None),
        "max_receive_message_bytes": (1, 2_147_483_647),
        "max_send_message_bytes": (1, 2_147_483_647),
        "max_pending_per_consumer": (1, None),
        "default_credit": (1, None),
        "max_batch_messages": (1, None),
        "max_deliveries": (0, 1000),
    }
