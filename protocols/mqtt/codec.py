"""Sans-IO MQTT codec: bytes to packets and packets to bytes, for MQTT 3.1 (protocol level 3,
name "MQIsdp"), 3.1.1 (level 4) and 5.0 (level 5). This module is the codec's public face;
the work is done in small modules beside it:

- `errors.py`: `MQTTCodecError` and its kinds, carrying the MQTT 5 reason code to close with;
- `wire.py`: protocol levels, size limits and the primitive data types (§1.5);
- `properties.py`: where each MQTT 5 property may appear, its type and range, and the
  property block reader and writers;
- `decoders.py`: one decoder per packet type;
- `parser.py`: `PacketParser`, which frames packets in any chunking of the input and decodes
  every packet of a read in one loop;
- `encoders.py`: `encode(packet, version)` and the hot-path `encode_publish(...)`.

Decoding enforces the wire format: fixed-header flags, lengths, strict UTF-8, which
properties each packet may carry, reserved bits, non-zero packet identifiers. It does not
judge meaning (topic wildcards, session state, what a client may send when); that is the
connection state machine's work. No sockets, no clocks, no logging here.

Spec references: MQTT 3.1.1 (OASIS, 2014) and MQTT 5.0 (OASIS, 2019); statement numbers such
as [MQTT-2.2.2-2] are 3.1.1's unless marked v5.
"""

from __future__ import annotations

from .encoders import encode, encode_publish
from .errors import InvalidUTF8, MQTTCodecError, PacketTooLarge, UnsupportedProtocolVersion
from .parser import PacketParser
from .wire import MAX_PACKET_SIZE, MAX_REMAINING_LENGTH, MQTT_3_1, MQTT_3_1_1, MQTT_5

__all__ = [
    "MAX_PACKET_SIZE",
    "MAX_REMAINING_LENGTH",
    "MQTT_3_1",
    "MQTT_3_1_1",
    "MQTT_5",
    "InvalidUTF8",
    "MQTTCodecError",
    "PacketParser",
    "PacketTooLarge",
    "UnsupportedProtocolVersion",
    "encode",
    "encode_publish",
]
