"""The incremental MQTT parser: bytes in any chunking in, complete packets out. It frames
packets (fixed header, remaining length, size limit) and decodes every packet of a read in
one loop, PUBLISH inline; the per-type decoders are in `decoders.py`."""

from __future__ import annotations

from .decoders import DECODERS, FIXED_FLAGS, decode_publish
from .errors import MQTTCodecError, PacketTooLarge, malformed
from .packets import Packet, PacketType
from .wire import MAX_REMAINING_LENGTH, MQTT_3_1, MQTT_3_1_1


def _frame(data: bytes | bytearray, pos: int, end: int) -> tuple[int, int] | None:
    """(fixed header length, remaining length) of the packet at `pos`, None if the fixed
    header is not complete yet. The remaining length is at most 4 bytes (§2.2.3)."""
    value = 0
    shift = 0
    index = pos + 1
    while True:
        if index >= end:
            return None
        byte = data[index]
        index += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if byte == 0 and shift:
                raise malformed("remaining length not minimally encoded")
            return index - pos, value
        shift += 7
        if shift == 28:
            raise malformed("remaining length longer than 4 bytes [MQTT-2.2.3]")


class PacketParser:
    """Incremental decoder: feed it bytes in any chunking, get back complete packets.

    `version` is None until a CONNECT is decoded, then the CONNECT's protocol level; a
    client-side user sets it before feeding server packets. Until it is known, packets
    decode with the 3.1.1 layout. After `feed` raises, the parser refuses further input.
    Unconsumed input waits in a bytearray; a packet's bytes are gathered only once it is
    complete, so a slow trickle costs O(1) per chunk, and the size limit is enforced as soon
    as a fixed header arrives, before the body is buffered.
    """

    __slots__ = ("version", "max_packet_size", "_pending", "_need", "_failed")

    def __init__(self, max_packet_size: int = MAX_REMAINING_LENGTH) -> None:
        self.version: int | None = None
        self.max_packet_size = max_packet_size
        self._pending = bytearray()
        self._need = 0  # bytes _pending must hold before parsing is worth trying again
        self._failed = False

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as packets."""
        return len(self._pending)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Packet]:
        """All packets completed by `data`, in order. Raises MQTTCodecError (with the packets
        decoded before the bad one in `.packets`); the parser is unusable afterwards."""
        if self._failed:
            raise malformed("the parser already failed")
        pending = self._pending
        if pending:
            pending += data
            size = len(pending)
            if size < self._need:
                return []
            try:
                frame = _frame(pending, 0, size)
            except MQTTCodecError:
                self._failed = True
                raise
            if frame is None:
                self._need = size + 1
                return []
            total = frame[0] + frame[1]
            if total > self.max_packet_size:
                self._failed = True
                raise PacketTooLarge(
                    f"packet of {total} bytes exceeds the maximum of {self.max_packet_size}"
                )
            if size < total:
                self._need = total
                return []
            data = bytes(pending)
            pending.clear()
        elif type(data) is not bytes:
            data = bytes(data)
        return self._parse(data)  # type: ignore[arg-type]

    def _parse(self, data: bytes) -> list[Packet]:
        packets: list[Packet] = []
        pos = 0
        size = len(data)
        limit = self.max_packet_size
        version = self.version or MQTT_3_1_1
        decoders = DECODERS
        fixed_flags = FIXED_FLAGS
        try:
            while size - pos >= 2:
                first = data[pos]
                remaining = data[pos + 1]
                if remaining < 0x80:
                    start = pos + 2
                else:
                    frame = _frame(data, pos, size)
                    if frame is None:
                        self._need = size - pos + 1
                        break
                    start = pos + frame[0]
                    remaining = frame[1]
                end = start + remaining
                if end - pos > limit:
                    raise PacketTooLarge(
                        f"packet of {end - pos} bytes exceeds the maximum of {limit}"
                    )
                if end > size:
                    self._need = end - pos
                    break
                kind = first >> 4
                if kind == 3:
                    packets.append(decode_publish(data, start, end, first & 0x0F, version))
                else:
                    flags = first & 0x0F
                    if flags != fixed_flags[kind] and not (
                        version == MQTT_3_1 and flags == 0b1010 and fixed_flags[kind] == 0b0010
                    ):
                        if kind == 0:
                            raise malformed("packet type 0 is reserved")
                        raise malformed(
                            f"{PacketType(kind).name} with fixed-header flags {flags:#06b}"
                            " [MQTT-2.2.2-2]"
                        )
                    packet = decoders[kind](data, start, end, version)  # type: ignore[misc]
                    if kind == 1:
                        self.version = version = packet.protocol_level
                    packets.append(packet)
                pos = end
            else:
                self._need = 2
        except MQTTCodecError as exc:
            self._failed = True
            exc.packets = packets
            raise
        if pos < size:
            self._pending += memoryview(data)[pos:]
        return packets
