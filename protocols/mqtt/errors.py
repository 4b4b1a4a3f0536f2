"""Errors of the MQTT codec: bytes that are not a valid packet, with the MQTT 5 reason code
the receiver closes with. Raised by the decoders and the parser; the connection state machine
turns them into a DISCONNECT or CONNACK. No decoding here."""

from __future__ import annotations

from .packets import Packet, ReasonCode


class MQTTCodecError(Exception):
    """Bytes that are not a valid MQTT packet. `reason_code` is the MQTT 5 reason code the
    receiver closes with: MALFORMED_PACKET unless the spec calls the case a Protocol Error.
    `packets` holds the packets decoded from the same `feed` before the error."""

    def __init__(self, message: str, reason_code: int = ReasonCode.MALFORMED_PACKET) -> None:
        super().__init__(message)
        self.reason_code = int(reason_code)
        self.packets: list[Packet] = []


class PacketTooLarge(MQTTCodecError):
    """A packet declared a size above the parser's maximum (v5 §3.1.2.11.4, reason 0x95)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ReasonCode.PACKET_TOO_LARGE)


class UnsupportedProtocolVersion(MQTTCodecError):
    """CONNECT named a protocol name or level this broker does not speak. The server answers
    CONNACK 0x01 (3.x) or 0x84 (5.0) and closes [MQTT-3.1.2-2]."""

    def __init__(self, protocol_name: str, protocol_level: int) -> None:
        super().__init__(
            f"unsupported protocol {protocol_name!r} level {protocol_level}",
            ReasonCode.UNSUPPORTED_PROTOCOL_VERSION,
        )
        self.protocol_name = protocol_name
        self.protocol_level = protocol_level


class InvalidUTF8(MQTTCodecError):
    """A UTF-8 string field is ill-formed or contains U+0000 [MQTT-1.5.3-1], [MQTT-1.5.3-2]
    (v5 [MQTT-1.5.4-1], [MQTT-1.5.4-2])."""


def malformed(message: str) -> MQTTCodecError:
    return MQTTCodecError(message, ReasonCode.MALFORMED_PACKET)


def protocol_error(message: str) -> MQTTCodecError:
    return MQTTCodecError(message, ReasonCode.PROTOCOL_ERROR)
