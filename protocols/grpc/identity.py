"""A gRPC producer's identity (`ProducerIdentity` in `proto/shardgate.proto`): given to each
message it publishes as a record property, so that what it sends again is stored once
(`core/resends.py`)."""

from __future__ import annotations

import grpc

from ...core.message import Message
from ...core.resends import PRODUCER_ID, PRODUCER_RESENT
from ...proto import shardgate_pb2 as pb
from .convert import Refusal

# The longest a producer may say its first send of a message was ago (`first_sent_ms_ago`).
MAX_RESEND_AGE_MS = 300_000
MAX_PRODUCER_ID_BYTES = 64


class Identity:
    """A request's (or a batch's) producer identity (`ProducerIdentity` in the `.proto`), read
    and checked once: what `identify` gives each of its messages."""

    __slots__ = ("name", "producer_id", "sequence", "shift_ms")

    def __init__(self, identity: pb.ProducerIdentity, count: int = 1) -> None:
        """Raises `Refusal` for a malformed identity (of `count` messages)."""
        producer_id = identity.producer_id
        if not 0 < len(producer_id) <= MAX_PRODUCER_ID_BYTES:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"identity.producer_id must be 1 to {MAX_PRODUCER_ID_BYTES} bytes, "
                          f"not {len(producer_id)}")
        self.sequence = identity.sequence
        if self.sequence + max(count - 1, 0) >= 1 << 64:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "identity.sequence is out of range")
        self.producer_id = producer_id
        # a resent one is marked so (its first copy is looked for before storing,
        # `core/resends.py`) and dated from its first send, so that the look-up reaches it
        resent = identity.resent
        self.name = PRODUCER_RESENT if resent else PRODUCER_ID
        self.shift_ms = min(identity.first_sent_ms_ago, MAX_RESEND_AGE_MS) if resent else 0


def identify(message: Message, identity: Identity, index: int) -> None:
    """Give `message` the `index`-th identity of `identity`, stored with it as a record
    property: the producer id, then the sequence number 8 bytes big-endian."""
    message.native_properties = {
        identity.name: identity.producer_id + (identity.sequence + index).to_bytes(8, "big")}
    if identity.shift_ms:
        message.publish_time_ms -= identity.shift_ms
