"""`record_topic` reads a journal record's topic without decoding the rest of it."""

from __future__ import annotations

import pytest
from shardgate.core.message import Message
from shardgate.core.records import (
    RecordFormatError,
    decode_message,
    encode_message,
    record_topic,
)


@pytest.mark.parametrize("topic", ["a/b", "ünï/cödé", "x" * 300])
def test_the_topic_read_alone_is_the_one_decode_finds(topic: str) -> None:
    data = encode_message(Message(topic, b"payload", 1, headers=[("k", "v")], producer_protocol="mqtt"))
    assert record_topic(data) == decode_message(data).topic == topic
    assert record_topic(memoryview(data)) == topic


@pytest.mark.parametrize(
    "data", [b"", b"\x02\x00", b"\x07" + bytes(20), encode_message(Message("abc", b""))[:15]],
    ids=["empty", "short-header", "unknown-version", "truncated-topic"])  # (the last holds the
    # time it was made: an id made from it would differ between xdist workers)
def test_a_malformed_record_is_a_record_format_error(data: bytes) -> None:
    with pytest.raises(RecordFormatError):
        record_topic(data)
