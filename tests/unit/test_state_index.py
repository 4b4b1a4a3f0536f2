"""The epoch-aware reads of `StateLog` and its keyed index (`shardgate/cluster/state_index.py`):
the newest record of the highest epoch up to the one asked for (never a zombie owner's later
record), the writer's latest within an epoch whatever the log order, and an indexed log that
reads the stream once and then only what was appended. A real broker over the journal, a
stand-in for the node's view of the placement."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from shardgate.core.broker import Broker
from shardgate.core.kept_state import INTERNAL_PRODUCER
from shardgate.core.message import Message, now_ms
from shardgate.storage.journal import JournalStorage

from shardgate.cluster.state_index import StateIndex, stamp, version_of
from shardgate.cluster.state_log import INTERNAL_STREAM, StateLog, state_topic


def _node() -> SimpleNamespace:
    view = SimpleNamespace(streams={}, leader=lambda name, index: SimpleNamespace(leader="n1"),
                           nodes=lambda: {"n1"})
    return SimpleNamespace(node_id="n1", view=view, state_rpc=None)


async def _put(log: StateLog, key: str, value: bytes, epoch: int | None = None) -> None:
    await asyncio.wait_for(log.put(key, value, epoch), 5)


@pytest.mark.parametrize("indexed", [False, True])
async def test_a_zombie_owners_later_record_is_never_read_for_a_later_epoch(tmp_path: Path, indexed: bool) -> None:
    log = StateLog(_node(), Broker(JournalStorage(tmp_path)), "queues", indexed=indexed)  # type: ignore[arg-type]
    await _put(log, "q", b"home 0", epoch=0)
    await _put(log, "q", b"home 1", epoch=1)  # taken over
    await _put(log, "q", b"zombie 0", epoch=0)  # the old home, resumed, writes once more
    assert await log.latest("q", 0, max_epoch=1) == b"home 1"
    assert await log.latest("q", 0, max_epoch=7) == b"home 1"
    assert await log.latest("q", 0, max_epoch=0) == b"zombie 0"
    assert await log.latest("other", 0, max_epoch=1) is None
    if not indexed:  # without an epoch: the newest in the log, as the sessions read
        assert await log.latest("q", 0) == b"zombie 0"


async def test_an_epoch_with_no_record_falls_back_to_the_highest_earlier_one(tmp_path: Path) -> None:
    # a taker that died before writing its epoch's first state: the next takes the one before
    log = StateLog(_node(), Broker(JournalStorage(tmp_path)), "queues", indexed=True)  # type: ignore[arg-type]
    await _put(log, "q", b"epoch 0", epoch=0)
    await _put(log, "q", b"epoch 2", epoch=2)
    assert await log.latest("q", 0, max_epoch=1) == b"epoch 0"
    assert await log.latest("q", 0, max_epoch=2) == b"epoch 2"


async def test_within_an_epoch_the_writers_latest_wins_whatever_the_log_order(tmp_path: Path) -> None:
    # a forwarded batch retried after a leader change can land after the next write
    broker = Broker(JournalStorage(tmp_path))
    log = StateLog(_node(), broker, "queues")  # type: ignore[arg-type]
    assert log.ensure()
    topic = state_topic("queues", "q")
    outcomes = broker.publish_many([
        Message(topic, b"written second", qos=1, headers=stamp(3, 8), producer_protocol=INTERNAL_PRODUCER),
        Message(topic, b"written first", qos=1, headers=stamp(3, 7), producer_protocol=INTERNAL_PRODUCER),
    ], counted=False)
    for outcome in outcomes:
        if isinstance(outcome, asyncio.Future):
            await asyncio.wait_for(outcome, 5)
    assert broker.streams[INTERNAL_STREAM].shards[0].next_offset == 2
    assert await log.latest("q", 0, max_epoch=3) == b"written second"


async def test_an_indexed_log_reads_the_stream_once_then_only_what_was_appended(tmp_path: Path) -> None:
    broker = Broker(JournalStorage(tmp_path))
    queues = StateLog(_node(), broker, "queues", indexed=True)  # type: ignore[arg-type]
    sessions = StateLog(_node(), broker, "sessions")  # type: ignore[arg-type]
    batch = [queues.put(f"q{key}", f"v{key}".encode(), 0) for key in range(50)]
    assert all(future is batch[0] for future in batch)  # one turn, one append
    await asyncio.wait_for(sessions.put("client", b"not a queue"), 5)
    await asyncio.wait_for(batch[0], 5)
    assert queues.index is not None
    assert await queues.latest("q7", 0, max_epoch=0) == b"v7"
    assert queues.index.records_read == 50  # its own kind only
    for key in range(49):  # a takeover of many queues: no more reading
        assert await queues.latest(f"q{key}", 0, max_epoch=0) == f"v{key}".encode()
    assert queues.index.records_read == 50
    await _put(queues, "q3", b"newer", epoch=0)
    assert await queues.latest("q3", 0, max_epoch=0) == b"newer"
    assert queues.index.records_read == 51


async def test_an_indexed_log_reads_an_older_part_once_when_asked_from_earlier(tmp_path: Path) -> None:
    log = StateLog(_node(), Broker(JournalStorage(tmp_path)), "queues", indexed=True)  # type: ignore[arg-type]
    await _put(log, "old", b"old value", epoch=0)
    written = now_ms()
    while now_ms() <= written:  # the next record is written in a later millisecond
        await asyncio.sleep(0.001)
    since = now_ms()
    await _put(log, "new", b"new value", epoch=0)
    assert await log.latest("new", since, max_epoch=0) == b"new value"
    assert await log.latest("old", since, max_epoch=0) is None  # written before `since`
    assert await log.latest("old", 0, max_epoch=0) == b"old value"
    assert log.index is not None
    read = log.index.records_read
    assert await log.latest("old", 0, max_epoch=0) == b"old value"
    assert log.index.records_read == read


def test_a_record_without_a_stamp_is_of_epoch_zero_and_entries_past_retention_go() -> None:
    assert version_of(Message("t", b"")) == (0, 0)
    assert version_of(Message("t", b"", headers=stamp(4, 99))) == (4, 99)
    assert version_of(Message("t", b"", headers=[("sg-state-epoch", "x")])) == (0, 0)
    index = StateIndex(None, None, INTERNAL_STREAM, "$internal/queues/", retention_ms=1_000)  # type: ignore[arg-type]
    index.observe(Message("$internal/queues/a%2Fb", b"kept", headers=stamp(1, 1)), 5)
    index.observe(Message("$internal/queues/gone", b"old", publish_time_ms=now_ms() - 5_000), 6)
    index.observe(Message("$internal/other/a%2Fb", b"another kind", headers=stamp(9, 1)), 7)
    index._prune()
    assert index.chosen("a/b", None) == (1, b"kept")
    assert index.chosen("gone", None) is None


async def test_a_node_that_does_not_lead_the_stream_reads_its_leader_through_the_shard_reader(
        tmp_path: Path) -> None:
    from shardgate.cluster.shard_reader import serve_read

    leader_broker = Broker(JournalStorage(tmp_path / "n1"))
    writer = StateLog(_node(), leader_broker, "queues")  # type: ignore[arg-type]
    await asyncio.wait_for(asyncio.gather(writer.put("q", b"home 1", 1), writer.put("r", b"r", 0)), 5)
    await _put(writer, "q", b"zombie 0", epoch=0)
    plane = SimpleNamespace(serves=lambda name, index: True,
                            remote=SimpleNamespace(routes_of=lambda node: set()))
    requests: list[dict[str, object]] = []

    async def read_shard(node_id: str, request: dict[str, object], timeout_s: float) -> object:
        assert node_id == "n1"
        requests.append(request)
        return await serve_read(leader_broker, plane, request)  # type: ignore[arg-type]

    reader = _node()
    reader.node_id = "n2"
    reader.view.nodes = lambda: {"n1", "n2"}
    reader.state_rpc = SimpleNamespace(read_shard=read_shard)
    here = Broker(JournalStorage(tmp_path / "n2"))
    log = StateLog(reader, here, "queues", indexed=True)  # type: ignore[arg-type]
    assert log.ensure()  # the stream is known here (a follower, or not a replica at all)
    assert await log.latest("q", 0, max_epoch=1) == b"home 1"
    assert requests[0]["filters"] == ["$internal/queues/#"]
    await _put(writer, "q", b"home 1 again", epoch=1)
    assert await log.latest("q", 0, max_epoch=1) == b"home 1 again"
    assert requests[-1]["from"] == 3  # only what was appended since
    assert log.index is not None and log.index.records_read == 4
