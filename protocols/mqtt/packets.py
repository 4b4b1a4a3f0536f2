"""MQTT control packets as plain data: packet types, reason codes, properties, one dataclass
per packet.

These classes carry no behaviour and know nothing of bytes; `codec.py` turns them into bytes
and back for MQTT 3.1 (protocol level 3), 3.1.1 (level 4) and 5.0 (level 5). Fields that a
protocol version does not have (properties and reason codes before 5.0) keep their defaults.
Numbers cite the MQTT 5.0 OASIS standard, section 2.1.2 (packet types), 2.4 (reason codes)
and 2.2.2.2 (properties), and MQTT 3.1.1 section 3.2.2.3 (CONNACK return codes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TypeAlias

__all__ = [
    "Auth",
    "Connack",
    "ConnackCode311",
    "Connect",
    "Disconnect",
    "Packet",
    "PacketType",
    "Pingreq",
    "Pingresp",
    "Properties",
    "PropertyId",
    "Puback",
    "Pubcomp",
    "Publish",
    "Pubrec",
    "Pubrel",
    "ReasonCode",
    "Suback",
    "Subscribe",
    "SubscriptionRequest",
    "Unsuback",
    "Unsubscribe",
    "Will",
]


class PacketType(IntEnum):
    """Control packet types, the high nibble of the fixed header (MQTT 5.0 §2.1.2)."""

    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


class ReasonCode(IntEnum):
    """MQTT 5.0 reason codes (§2.4). 0x00 has three names: SUCCESS, NORMAL_DISCONNECTION and
    GRANTED_QOS_0 are the same member."""

    SUCCESS = 0x00
    NORMAL_DISCONNECTION = 0x00
    GRANTED_QOS_0 = 0x00
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    REAUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2


class ConnackCode311(IntEnum):
    """CONNACK return codes of MQTT 3.1 and 3.1.1 (3.1.1 §3.2.2.3)."""

    ACCEPTED = 0
    UNACCEPTABLE_PROTOCOL_VERSION = 1
    IDENTIFIER_REJECTED = 2
    SERVER_UNAVAILABLE = 3
    BAD_USERNAME_OR_PASSWORD = 4
    NOT_AUTHORIZED = 5


class PropertyId(IntEnum):
    """MQTT 5.0 property identifiers (§2.2.2.2)."""

    PAYLOAD_FORMAT_INDICATOR = 1
    MESSAGE_EXPIRY_INTERVAL = 2
    CONTENT_TYPE = 3
    RESPONSE_TOPIC = 8
    CORRELATION_DATA = 9
    SUBSCRIPTION_IDENTIFIER = 11
    SESSION_EXPIRY_INTERVAL = 17
    ASSIGNED_CLIENT_IDENTIFIER = 18
    SERVER_KEEP_ALIVE = 19
    AUTHENTICATION_METHOD = 21
    AUTHENTICATION_DATA = 22
    REQUEST_PROBLEM_INFORMATION = 23
    WILL_DELAY_INTERVAL = 24
    REQUEST_RESPONSE_INFORMATION = 25
    RESPONSE_INFORMATION = 26
    SERVER_REFERENCE = 28
    REASON_STRING = 31
    RECEIVE_MAXIMUM = 33
    TOPIC_ALIAS_MAXIMUM = 34
    TOPIC_ALIAS = 35
    MAXIMUM_QOS = 36
    RETAIN_AVAILABLE = 37
    USER_PROPERTY = 38
    MAXIMUM_PACKET_SIZE = 39
    WILDCARD_SUBSCRIPTION_AVAILABLE = 40
    SUBSCRIPTION_IDENTIFIER_AVAILABLE = 41
    SHARED_SUBSCRIPTION_AVAILABLE = 42


@dataclass(slots=True)
class Properties:
    """MQTT 5.0 properties; None (or an empty list) means absent. Only the properties the
    spec allows in a packet may be set on it (§2.2.2.2)."""

    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    subscription_identifiers: list[int] = field(default_factory=list)
    session_expiry_interval: int | None = None
    assigned_client_identifier: str | None = None
    server_keep_alive: int | None = None
    authentication_method: str | None = None
    authentication_data: bytes | None = None
    request_problem_information: int | None = None
    will_delay_interval: int | None = None
    request_response_information: int | None = None
    response_information: str | None = None
    server_reference: str | None = None
    reason_string: str | None = None
    receive_maximum: int | None = None
    topic_alias_maximum: int | None = None
    topic_alias: int | None = None
    maximum_qos: int | None = None
    retain_available: int | None = None
    user_properties: list[tuple[str, str]] = field(default_factory=list)
    maximum_packet_size: int | None = None
    wildcard_subscription_available: int | None = None
    subscription_identifier_available: int | None = None
    shared_subscription_available: int | None = None


@dataclass(slots=True)
class Will:
    """The will message a CONNECT carries (§3.1.3.2-3.1.3.4)."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Connect:
    """CONNECT (§3.1). `protocol_name` is "MQTT" for levels 4 and 5, "MQIsdp" for 3."""

    protocol_name: str
    protocol_level: int
    clean_start: bool
    keep_alive: int
    client_id: str
    will: Will | None = None
    username: str | None = None
    password: bytes | None = None
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Connack:
    """CONNACK (§3.2). `reason_code` is a ConnackCode311 before 5.0, a ReasonCode on 5.0."""

    session_present: bool
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Publish:
    """PUBLISH (§3.3). `packet_id` is set exactly when qos > 0. An empty `topic` with a
    topic alias property is legal on 5.0; the codec never checks topic semantics."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Puback:
    """PUBACK (§3.4)."""

    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Pubrec:
    """PUBREC (§3.5)."""

    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Pubrel:
    """PUBREL (§3.6)."""

    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Pubcomp:
    """PUBCOMP (§3.7)."""

    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class SubscriptionRequest:
    """One topic filter of a SUBSCRIBE with its subscription options (§3.8.3.1). Options
    other than `qos` exist on 5.0 only."""

    topic_filter: str
    qos: int
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(slots=True)
class Subscribe:
    """SUBSCRIBE (§3.8)."""

    packet_id: int
    subscriptions: list[SubscriptionRequest]
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Suback:
    """SUBACK (§3.9): one reason code (granted QoS or failure) per requested filter."""

    packet_id: int
    reason_codes: list[int]
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Unsubscribe:
    """UNSUBSCRIBE (§3.10)."""

    packet_id: int
    topic_filters: list[str]
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Unsuback:
    """UNSUBACK (§3.11). Before 5.0 it has no reason codes: they are not encoded and decode
    as an empty list."""

    packet_id: int
    reason_codes: list[int] = field(default_factory=list)
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Pingreq:
    """PINGREQ (§3.12)."""


@dataclass(slots=True)
class Pingresp:
    """PINGRESP (§3.13)."""


@dataclass(slots=True)
class Disconnect:
    """DISCONNECT (§3.14). Reason code and properties exist on 5.0 only."""

    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Auth:
    """AUTH (§3.15), 5.0 only."""

    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


Packet: TypeAlias = (
    Connect | Connack | Publish | Puback | Pubrec | Pubrel | Pubcomp | Subscribe | Suback
    | Unsubscribe | Unsuback | Pingreq | Pingresp | Disconnect | Auth
)
