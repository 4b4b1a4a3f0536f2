"""Settings of the MQTT protocol layer (limits, defaults, what CONNACK advertises)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(slots=True)
class MqttSettings:
    # The largest packet the server accepts (MQTT 5 Maximum Packet Size in CONNACK).
    max_packet_size: int = 1024 * 1024
    # The largest first packet (CONNECT) of a client not yet authenticated, as RabbitMQ's
    # mqtt.max_packet_size_unauthenticated: a stranger holds little memory. 0: max_packet_size.
    max_packet_size_unauthenticated: int = 65536
    # Origins (`https://app.example.com`, or "*" for any) whose pages may open MQTT over
    # WebSocket. Empty: only pages of the listener's own host name (the Host header's), and
    # clients that send no Origin (not browsers). A browser page of any other origin could
    # otherwise use the broker with the rights of an anonymous client.
    ws_allowed_origins: list[str] = field(default_factory=list)
    # How many QoS 1/2 publishes a client may have unacknowledged towards the server.
    receive_maximum: int = 1024
    # Outbound in-flight window for 3.1.1 clients (5.0 clients set theirs in CONNECT).
    max_inflight: int = 100
    # Messages queued per session while offline or while the in-flight window is full.
    max_queued_messages: int = 1000
    # Payload bytes queued per session (0: no bound), beside the message count: whichever
    # limit is reached first applies, as mosquitto's max_queued_bytes. A message that finds
    # the queue at its limit is dropped (QoS 1/2 too, as mosquitto does), counted under the
    # reason "queue_bytes" and logged, rate-limited. Messages in flight are not counted
    # (`max_inflight` / the client's Receive Maximum bound them).
    max_queued_bytes: int = 64 * 1024 * 1024
    queue_qos0_offline: bool = False
    topic_alias_maximum: int = 65535
    maximum_qos: int = 2
    retain_available: bool = True
    # 0 = accept whatever the client asks; otherwise the largest keepalive the server allows.
    max_keepalive: int = 0
    # Session expiry applied to 3.1.1 persistent sessions (clean session 0); None = never.
    persistent_session_expiry: int | None = None
    max_client_id_length: int = 65535
    # Outbound bytes buffered for a client beyond which QoS 0 messages are dropped.
    max_outbound_buffer: int = 8 * 1024 * 1024
    # Outbound bytes waiting for a client (this loop turn's and its socket buffer's) above
    # which the broker stops replaying its persistent session's backlog to it and holds the
    # clients publishing QoS 1/2 messages to it, until it has read them (below a quarter).
    output_high_water: int = 256 * 1024
    # Seconds between $SYS updates; 0 turns them off.
    sys_interval: float = 10.0
    allow_anonymous: bool = True
    # Connected clients allowed at once (0: no limit); more get CONNACK "server busy".
    max_connections: int = 0
    # PUBLISH packets per second per client (0: no limit); beyond it the broker stops
    # reading from that client for a while (TCP back-pressure), losing nothing.
    max_publish_rate: float = 0.0
    # Seconds a client may hold unacknowledged QoS 1/2 messages without acknowledging any
    # while not reading (0: never): such a dead subscriber is disconnected so its messages go
    # back to its session or, for shared subscriptions, to the other members.
    dead_subscriber_timeout: float = 0.0
    # A session belongs to the user who made it. Another user's CONNECT with its client id:
    # "refuse" (CONNACK 0x87, 3.1.1 return code 5) or "new_session" (the old session ends,
    # the newcomer gets a new one, as with clean start).
    session_takeover_by_other_user: str = "refuse"

    # The allowed range of each numeric setting, inclusive (None: no bound), checked by the
    # configuration loader with the file, the name and the value.
    RANGES: ClassVar[dict[str, tuple[float | None, float | None]]] = {
        "max_packet_size": (16, 268_435_455),  # MQTT 5.0 §1.5.5: a Variable Byte Integer
        "max_packet_size_unauthenticated": (0, 268_435_455),  # 0: max_packet_size
        "receive_maximum": (1, 65535),  # §3.2.2.3.3: 0 is a protocol error
        "max_inflight": (1, 65535),
        "max_queued_messages": (0, None),
        "max_queued_bytes": (0, None),
        "topic_alias_maximum": (0, 65535),
        "maximum_qos": (0, 2),
        "max_keepalive": (0, 65535),
        "persistent_session_expiry": (0, 4_294_967_295),
        "max_client_id_length": (23, 65535),  # §3.1.3.1: at least 23 must be allowed
        "max_outbound_buffer": (1, None),
        "output_high_water": (1, None),
        "sys_interval": (0, None),
        "max_connections": (0, None),
        "max_publish_rate": (0, None),
        "dead_subscriber_timeout": (0, None),
    }
