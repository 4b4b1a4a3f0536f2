"""The replicated state of a durable AMQP queue (`shardgate/cluster/queue_state.py`): its byte
form, its key in the internal state stream, and which node takes a queue over (which of
several records a taker resumes from: `test_state_index.py`)."""

from __future__ import annotations

import zlib

import pytest

from shardgate.cluster.amqp_queue_replicas import queue_name_of
from shardgate.cluster.amqp_queues import queue_key
from shardgate.cluster.queue_state import (
    CursorEntry,
    QueueState,
    QueueStateError,
    decode_state,
    encode_state,
    record_fields,
    state_key,
    taker,
)


def state(epoch: int = 0, seq: int = 1, incarnation: str = "i1", unacked: list[int] | None = None) -> QueueState:
    return QueueState(
        "/", "orders", incarnation, epoch, seq,
        {"auto_delete": False, "arguments": {"x-max-length": 10}, "writer": "alice",
         "bindings": [["amq.topic", "orders.#", []]]},
        [CursorEntry("default", 0, 120, [100, 101, 102, 110] if unacked is None else unacked),
         CursorEntry("survive", 3, 7, [])],
        1_700_000_000_000,
    )


def test_a_queue_state_reads_back_as_written() -> None:
    written = state(epoch=2, seq=99)
    assert decode_state(encode_state(written)) == written


def test_a_large_backlog_of_consecutive_unacknowledged_offsets_stays_small() -> None:
    backlog = list(range(1_000_000, 1_100_000))
    payload = encode_state(state(unacked=backlog))
    assert len(payload) < 4_000  # 100,000 offsets as differences of 1, compressed
    assert decode_state(payload).cursors[0].unacked == backlog


@pytest.mark.parametrize("payload", [b"", b"not zlib", zlib.compress(b"[1, 2]"),
                                     zlib.compress(b'{"format": 99}'),
                                     zlib.compress(b'{"format": 1, "vhost": "/"}'),
                                     zlib.compress(b'{"format": 1, "vhost": "/", "name": "q", "epoch": 0,'
                                                   b' "seq": 1, "cursors": [["s", 0]]}')])
def test_an_unreadable_state_is_refused_with_a_clear_error(payload: bytes) -> None:
    with pytest.raises(QueueStateError):
        decode_state(payload)


def test_every_node_picks_the_same_taker_among_the_live_nodes() -> None:
    key = queue_key("/", "orders")
    live = ["n1", "n2", "n3"]
    chosen = taker(key, live)
    assert chosen in live
    assert taker(key, list(reversed(live))) == chosen
    # without it, another: rendezvous hashing moves only the queues the node had
    rest = [node for node in live if node != chosen]
    assert taker(key, rest) in rest
    assert taker(key, []) is None


def test_queues_spread_over_the_takers() -> None:
    chosen = {taker(queue_key("/", f"q{index}"), ["n1", "n2", "n3"]) for index in range(50)}
    assert chosen == {"n1", "n2", "n3"}


def test_a_record_written_before_takeovers_existed_has_incarnation_and_epoch_zero() -> None:
    assert record_fields({"node": "n1", "durable": True}) == ("", 0)
    assert record_fields({"node": "n1", "incarnation": "ab", "epoch": 3}) == ("ab", 3)


def test_a_queue_records_key_names_its_vhost_and_queue_whatever_they_hold() -> None:
    for vhost, name in [("/", "orders"), ("a/b", "q/1 %x"), ("", "q")]:
        assert queue_name_of(queue_key(vhost, name)) == (vhost, name)
    assert queue_name_of("amqp/%2F/exchanges/x") is None
    assert queue_name_of("streams/default") is None
    # one state key per vhost, queue and incarnation, whatever they hold
    assert state_key("a/b", "q", "i1") != state_key("a", "b/q", "i1")
    assert state_key("/", "q", "i1") != state_key("/", "q", "i2")
