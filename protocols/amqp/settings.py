"""Settings of the AMQP 0-9-1 protocol layer: what connection.tune proposes, users, vhosts.

`None` passed to the listener means these defaults, which mirror RabbitMQ's: frame-max 128 KiB,
2047 channels, a 60 s heartbeat, one virtual host "/" and a guest/guest user that may only
connect from the loopback interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(slots=True)
class AmqpSettings:
    # connection.tune proposals (AMQP 0-9-1 §4.2.3 frame-max, channel-max, heartbeat).
    frame_max: int = 131072
    channel_max: int = 2047
    heartbeat: int = 60
    # username -> password, checked for PLAIN and AMQPLAIN.
    users: dict[str, str] = field(default_factory=lambda: {"guest": "guest"})
    # Users that may only log in over a loopback address (RabbitMQ's loopback_users).
    loopback_users: tuple[str, ...] = ("guest",)
    vhosts: tuple[str, ...] = ("/",)
    # Seconds a client has to complete the handshake before the socket is closed.
    handshake_timeout: float = 10.0
    # Outbound bytes buffered for a connection beyond which its consumers stop receiving
    # until the socket drains.
    max_outbound_buffer: int = 4 * 1024 * 1024
    # Memory alarm: when the ready messages of all queues hold more payload bytes than this,
    # publishing connections are blocked (connection.blocked) until they drop below half of it.
    # (Ready and delivered but unacknowledged messages both count.)
    memory_high_watermark: int = 512 * 1024 * 1024
    # Largest message body accepted on publish.
    max_message_size: int = 128 * 1024 * 1024
    product: str = "Shardgate"

    # The allowed range of each numeric setting, inclusive (None: no bound), checked by the
    # configuration loader with the file, the name and the value.
    RANGES: ClassVar[dict[str, tuple[float | None, float | None]]] = {
        "frame_max": (4096, 4_294_967_295),  # AMQP 0-9-1 §4.2.3: at least 4096
        "channel_max": (1, 65535),
        "heartbeat": (0, 65535),
        "handshake_timeout": (0.001, None),
        "max_outbound_buffer": (1, None),
        "memory_high_watermark": (0, None),
        "max_message_size": (1, None),
    }
