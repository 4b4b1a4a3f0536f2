"""`StateLog`, the keyed internal state of a cluster kept in the replicated stream
`_internal.state`: made at its first write, a turn's puts in one append (a key once, taken when
written), the newest value of a key read back, clients still refused on `$internal/`. A real
broker over the journal, a stand-in for the node's view of the placement."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from shardgate.core.broker import Broker
from shardgate.core.errors import PublishRejected
from shardgate.core.message import Message, now_ms
from shardgate.storage.journal import JournalStorage

from shardgate.cluster.journal_search import ShardUnreadable
from shardgate.cluster.state_log import INTERNAL_STREAM, StateLog, state_topic


def _node(placed: bool = True) -> SimpleNamespace:
    view = SimpleNamespace(
        placed=placed, streams={},
        leader=lambda name, index: SimpleNamespace(leader="n1") if view.placed else None,
        nodes=lambda: {"n1"})
    return SimpleNamespace(node_id="n1", view=view, state_rpc=None)


def test_a_key_becomes_a_topic_of_three_levels_whatever_it_holds() -> None:
    assert state_topic("mqtt-sessions", "a/b+#c") == "$internal/mqtt-sessions/a%2Fb%2B%23c"


async def test_puts_of_one_turn_are_one_batch_and_the_newest_value_is_read_back(tmp_path: Path) -> None:
    broker = Broker(JournalStorage(tmp_path))
    log = StateLog(_node(), broker, "mqtt-sessions")  # type: ignore[arg-type]
    assert INTERNAL_STREAM not in broker.streams  # nothing until the first write
    since = now_ms()
    values = iter([b"second"])
    first = log.put("client/1", b"first")
    again = log.put("client/1", lambda: next(values))  # a key once per turn: the last put
    other = log.put("client-2", b"other")
    assert first is again is other
    await asyncio.wait_for(first, 5)
    shard = broker.streams[INTERNAL_STREAM].shards[0]
    assert shard.next_offset == 2 and log.written == 2
    assert await log.latest("client/1", since) == b"second"
    assert await log.latest("client-2", since) == b"other"
    assert await log.latest("client-3", since) is None
    newer = log.put("client/1", b"third")
    assert newer is not first
    await asyncio.wait_for(newer, 5)
    assert await log.latest("client/1", since) == b"third"


async def test_nothing_written_means_nothing_to_read(tmp_path: Path) -> None:
    log = StateLog(_node(), Broker(JournalStorage(tmp_path)), "mqtt-sessions")  # type: ignore[arg-type]
    assert await log.latest("anyone", 0) is None


async def test_a_stream_made_elsewhere_and_not_yet_here_cannot_be_read_yet(tmp_path: Path) -> None:
    node = _node()
    node.view.streams[INTERNAL_STREAM] = {"mode": "reliable"}
    log = StateLog(node, Broker(JournalStorage(tmp_path)), "mqtt-sessions")  # type: ignore[arg-type]
    with pytest.raises(ShardUnreadable):
        await log.latest("anyone", 0)


async def test_a_batch_waits_for_the_shard_to_be_placed(tmp_path: Path) -> None:
    node = _node(placed=False)
    broker = Broker(JournalStorage(tmp_path))
    log = StateLog(node, broker, "mqtt-sessions")  # type: ignore[arg-type]
    batch = log.put("c", b"v")
    await asyncio.sleep(0.2)
    assert not batch.done() and broker.streams[INTERNAL_STREAM].shards[0].next_offset == 0
    node.view.placed = True
    await asyncio.wait_for(batch, 5)
    assert broker.streams[INTERNAL_STREAM].shards[0].next_offset == 1


async def test_a_client_still_cannot_publish_on_internal_topics(tmp_path: Path) -> None:
    broker = Broker(JournalStorage(tmp_path))
    log = StateLog(_node(), broker, "mqtt-sessions")  # type: ignore[arg-type]
    await asyncio.wait_for(log.put("c", b"v"), 5)
    with pytest.raises(PublishRejected):
        broker.publish(Message(state_topic("mqtt-sessions", "c"), b"forged", producer_protocol="mqtt"))
