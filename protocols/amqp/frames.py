"""AMQP 0-9-1 framing shared by the connection's modules: the protocol header, frame layout
(§4.2.3: type, channel, size, payload, 0xCE), the connection's states and the `Link` its bytes
go to. pamqp encodes and decodes the methods and content headers; this holds what the hot path
packs and unpacks by hand."""

from __future__ import annotations

import struct
from enum import Enum
from typing import Any, Protocol, TypeVar

from pamqp import commands, constants
from pamqp import frame as pframe

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"  # AMQP 0-9-1 §4.2.2
FRAME_MIN_SIZE = constants.FRAME_MIN_SIZE  # 4096, §4.2.3
FRAME_HEADER = struct.Struct(">BHI")
CONTENT_HEADER_FRAME = struct.Struct(">BHIHHQ")  # frame header + class, weight, body size
FRAME_END = b"\xce"
METHOD_INDEX = struct.Struct(">I")
HEARTBEAT_FRAME = pframe.marshal(pframe.heartbeat.Heartbeat(), 0)


class Link(Protocol):
    """Where a connection's bytes go (the socket adapter)."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class State(Enum):
    AWAIT_HEADER = "await-header"
    AWAIT_START_OK = "await-start-ok"
    AWAIT_TUNE_OK = "await-tune-ok"
    AWAIT_OPEN = "await-open"
    OPEN = "open"
    CLOSING = "closing"  # we sent connection.close, waiting for close-ok
    CLOSED = "closed"


# The states the per-frame path compares with, as plain names: on CPython 3.11 reading a
# member off its Enum class costs about as much as a function call, several times a frame.
OPEN, CLOSING, CLOSED = State.OPEN, State.CLOSING, State.CLOSED


# Methods that read a queue's contents; they wait for this connection's publishes to land.
READS_QUEUE = frozenset(
    m.index for m in (
        commands.Basic.Get, commands.Queue.Declare, commands.Queue.Purge, commands.Queue.Delete,
    )
)


M = TypeVar("M", bound=commands.base.Frame)
_UNCHECKED: dict[type[Any], type[Any]] = {}


def unchecked(method: type[M], *args: Any) -> M:
    """The server's reply `method(*args)` without pamqp's client-side check of queue and
    exchange names (only letters, digits and `-_.:@#,/+ `): a broker takes any short string
    as a name, as RabbitMQ does, so a queue named `bad name!` must get its declare-ok."""
    cls = _UNCHECKED.get(method)
    if cls is None:
        # No __slots__ of its own: marshalling walks the method's fields (`self.__slots__`).
        cls = _UNCHECKED[method] = type(method.__name__, (method,), {"validate": _no_check})
    frame: M = cls(*args)
    return frame


def _no_check(self: commands.base.Frame) -> None:
    """A reply's fields are the server's own (see `unchecked`)."""


def frame_bytes(frame_type: int, channel: int, payload: bytes) -> bytes:
    return FRAME_HEADER.pack(frame_type, channel, len(payload)) + payload + FRAME_END


def method_ids(method: type[commands.base.Frame] | commands.base.Frame | None) -> tuple[int, int]:
    """(class id, method id) of a method, for the close frames that name what failed."""
    if method is None:
        return 0, 0
    return method.index >> 16, method.index & 0xFFFF


def _erlang_binary(data: bytes) -> str:
    """`data` as Erlang's ~p prints a binary: <<"text">> when printable, else <<0,60,...>>."""
    if data and all(32 <= b < 127 for b in data):
        return '<<"' + data.decode().replace("\\", "\\\\").replace('"', '\\"') + '">>'
    return "<<" + ",".join(str(b) for b in data) + ">>"


def frame_error_text(frame_type: int, payload: bytes, error: str) -> str:
    """rabbit_reader's 501 text: the frame type, its payload (up to 16 octets) and the error
    as an Erlang term, e.g. "type 1, all octets = <<0,60,0,40>>: {invalid_frame_end_marker,0}"."""
    which = "all" if len(payload) <= 16 else "first 16"
    return f"type {frame_type}, {which} octets = {_erlang_binary(payload[:16])}: {error}"


EXPECTED_METHOD = "expected method frame, got non method frame instead"
EXPECTED_HEADER = "expected content header for class 60, got non content header frame instead"
EXPECTED_BODY = "expected content body, got non content body frame instead"
