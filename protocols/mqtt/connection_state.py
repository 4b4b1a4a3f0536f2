"""The state every part of an MQTT connection shares (`ConnectionState`: its slots and their
first values), the connection's states and its transport (`Link`). The parts (`outbound.py`,
`connect.py`, `inbound_publish.py`, `subscribing.py`) and `connection.py`, which assembles
them into `MqttConnection`, each handle one concern over this state; none touches a socket.
"""

from __future__ import annotations

import logging
import time
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from ...core.edge import Principal
from ...core.scheduling import Timer
from . import packets as p
from .codec import MQTTCodecError, PacketParser
from .session import NO_PACKET_IDS, MqttSession

if TYPE_CHECKING:
    import asyncio

    from .service import MqttService

log = logging.getLogger("shardgate.protocols.mqtt.connection")

RC = p.ReasonCode
MQTT_V5 = 5
# The longest a publisher is held for a subscriber that does not catch up (see `held`).
HOLD_MAX_S = 0.5
# While the memory alarm holds publishers, a publishing connection is read again this often
# (one read's publishes each time), to see whether it cleared.
BLOCKED_RECHECK_S = 1.0


class Link(Protocol):
    """What the connection needs of its transport."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...

    def buffered(self) -> int:
        """Bytes written but not yet sent to the network."""

    def throttle(self, seconds: float) -> None:
        """Stop reading from the client for `seconds` (back-pressure)."""

    def resume(self) -> None:
        """Read from the client again before a `throttle` runs out."""


class State(Enum):
    AWAIT_CONNECT = "await-connect"
    # CONNECT accepted, CONNACK waits for the session (a cluster fetches it from another node)
    OPENING = "opening"
    CONNECTED = "connected"
    CLOSED = "closed"


# The states and the success code as plain names for the per-message path (reads, PUBLISH,
# delivery, acknowledgements): on CPython 3.11 reading a member off its Enum class costs about
# as much as a function call. Code off that path keeps `State.X` / `RC.X`.
AWAIT_CONNECT, OPENING, CONNECTED, CLOSED = State.AWAIT_CONNECT, State.OPENING, State.CONNECTED, State.CLOSED
SUCCESS = RC.SUCCESS


class ProtocolViolation(Exception):
    """The client broke the protocol: the connection ends with this reason code."""

    def __init__(self, reason_code: int, message: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code


class ConnectionState:
    """What every part of `MqttConnection` shares. A part hands `self` to the service as the
    `MqttConnection` it is part of (the type checker is told so where it cannot see it)."""

    # Slots, not a __dict__: an idle connection costs about 1.3 KiB less (a class with more
    # than 30 attributes gets no key-sharing dict).
    __slots__ = (
        "service", "link", "remote", "transport_name", "state", "parser", "version", "client_id",
        "username", "principal", "certificate_identity", "session", "keep_alive",
        "last_received", "connected_at", "send_window", "client_max_packet_size",
        "client_topic_alias_max", "problem_info", "inbound_aliases", "outbound_aliases",
        "inbound_pending", "qos2_open", "will", "session_expiry_at_connect", "_out", "_out_bytes",
        "_flush_requested", "messages_in", "messages_out", "last_ack", "_tokens", "_tokens_at",
        "_throttled_for", "_backlog", "_backlog_error", "_valid_topic", "held", "_hold_timer",
        "_allowed_topic", "_read_ms", "_link_buffered", "_acks_waiting", "_held_subacks",
        "_sent_stream", "_sent_count", "_sent_bytes",
        "_held_from", "_close_when_sent", "_connect_marks", "_drain_wanted", "_after_connack",
        "_checked",
    )

    def __init__(self, service: MqttService, link: Link, remote: str = "", transport_name: str = "tcp") -> None:
        self.service = service
        self.link = link
        self.remote = remote
        self.transport_name = transport_name
        self.state = State.AWAIT_CONNECT
        settings = service.settings
        # Until it has authenticated, a client may send no more than a small CONNECT.
        self.parser = PacketParser(max_packet_size=min(
            settings.max_packet_size, settings.max_packet_size_unauthenticated or settings.max_packet_size))
        self.version = 4
        self.client_id = ""
        self.username: str | None = None
        # Who this client is to the front door's authorization (set once connected).
        self.principal = Principal("mqtt", None, "", remote)
        # Set by the adapter from a verified client certificate when the listener maps
        # certificate identities to users.
        self.certificate_identity: str | None = None
        # The verdict of a password checked off the event loop, for the CONNECT handled again.
        self._checked: tuple[str | None] | None = None
        self.session: MqttSession | None = None
        self.keep_alive = 0
        self.last_received = self.service.clock()
        self.connected_at = time.time()
        self.send_window = service.settings.max_inflight
        self.client_max_packet_size = 0
        self.client_topic_alias_max = 0
        # Request Problem Information 0: no reason string on acknowledgements [MQTT-3.1.2-29].
        self.problem_info = True
        self.inbound_aliases: dict[int, str] = {}
        self.outbound_aliases: dict[str, int] = {}
        # QoS 1 publishes waiting for the journal, and QoS 2 publishes received on this
        # connection and not yet completed: together they use the Receive Maximum quota.
        self.inbound_pending = 0
        self.qos2_open: set[int] = NO_PACKET_IDS  # a set of its own from the first
        self.will: p.Will | None = None
        self.session_expiry_at_connect = 0
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._flush_requested = False
        self.messages_in = 0
        self.messages_out = 0
        self.last_ack = self.service.clock()
        self._tokens = float(service.settings.max_publish_rate)
        self._tokens_at = self.service.clock()
        self._throttled_for = 0.0
        self._backlog: list[p.Packet] = []
        self._backlog_error: MQTTCodecError | None = None
        self._valid_topic = ""
        # The topic this client was last allowed to publish to, during the current read only
        # (authorization is asked once per topic per read, not once per PUBLISH).
        self._allowed_topic: str | None = None
        # Publish time of the messages of the current read (one clock read per read).
        self._read_ms = 0
        # The link's send buffer when it was last asked: it grows only when `flush` writes,
        # so between flushes it is an upper bound of what the link still holds.
        self._link_buffered = 0
        # Commit futures of QoS 1/2 publishes → what to acknowledge, in order, once each is
        # durable: one callback per commit group and connection, not one per PUBLISH.
        self._acks_waiting: dict[asyncio.Future[None], list[tuple[int, int]]] | None = None
        # Held: a subscriber this client publishes to has more queued than it reads; this
        # client is not read until that subscriber catches up (or HOLD_MAX_S passes).
        self.held = False
        self._hold_timer: Timer | None = None
        # SUBACKs waiting, in order, for the cluster's other nodes to know the subscription.
        self._held_subacks: list[list[Any]] | None = None
        # Messages sent since the broker's statistics last counted them, all of one stream:
        # counted at the next flush (or sooner, when a message of another stream comes).
        self._sent_stream = ""
        self._sent_count = 0
        self._sent_bytes = 0
        # Output held for session state to be durable: [index in `_out` from which output
        # waits, future of the metadata commit it waits for], oldest first (they resolve in
        # order). Closed while output was held: the link closes once it is sent.
        self._held_from: list[list[Any]] | None = None
        self._close_when_sent = False
        # CONNECT → CONNACK inside the broker: [read, session open, commit durable] clock
        # values, until the CONNACK is handed to the link (`timing.ConnectTiming`).
        self._connect_marks: list[float] | None = None
        # Output passed `output_high_water` while a session wanted to send more (replay, or
        # live QoS 1/2 messages): the session is told when it has drained.
        self._drain_wanted = False
        # A new persistent session's CONNACK was just queued: the index in `_out` after it,
        # from which output waits for the session's commit to be durable (see `_opened`).
        self._after_connack: int | None = None

    if TYPE_CHECKING:  # the parts' methods the other parts call (`connection.py` assembles them)
        def _send(self, data: bytes) -> None: ...

        def _send_packet(self, packet: p.Packet) -> None: ...

        def flush(self) -> None: ...

        def _process(self, packets: list[p.Packet], error: MQTTCodecError | None = None) -> None: ...

        def _resume_backlog(self) -> None: ...

        def close(self, reason_code: int | None = None, reason: str | None = None, *,
                  normal: bool = False) -> None: ...

    @property
    def open(self) -> bool:
        return self.state is not CLOSED

