"""A durable cursor restored at start keeps its saved position unless its log lost records
past it in a crash. Found by the randomized fault run (seed 6): a restarted cluster node
restored its durable AMQP queue's cursors on shards other nodes own against their empty local
journals, went back to offset 0, and delivered again everything acknowledged."""

from __future__ import annotations

from pathlib import Path

from shardgate.core.broker import Broker
from shardgate.core.durable import encode_cursor_state
from shardgate.core.message import Message
from shardgate.core.streams import StreamConfig
from shardgate.storage.journal import JournalStorage


def journal_broker(directory: Path) -> Broker:
    return Broker(JournalStorage(directory), StreamConfig("default", mode="reliable"))


def test_a_cursor_restored_over_an_empty_log_keeps_its_position(tmp_path: Path) -> None:
    broker = journal_broker(tmp_path)  # this node never stored a record of the shard
    sub = broker.durable_subscription("amqp:/:q")
    broker.add_filter(sub, "x/#")
    sub.restore_cursor("default", 0, encode_cursor_state(500, [480, 490]))
    cursor = sub.cursors[("default", 0)]
    assert cursor.position == 500
    assert cursor.pending_redelivery == [480, 490]


async def test_a_cursor_restored_past_the_end_of_its_log_goes_back_to_the_end(tmp_path: Path) -> None:
    broker = journal_broker(tmp_path)
    for index in range(3):
        pending = broker.publish(Message("x/a", str(index).encode(), qos=1))
        if pending is not None:
            await pending
    end = broker.streams["default"].shards[0].log.next_offset
    sub = broker.durable_subscription("amqp:/:q")
    broker.add_filter(sub, "x/#")
    sub.restore_cursor("default", 0, encode_cursor_state(end + 100, [1, end + 50]))
    cursor = sub.cursors[("default", 0)]
    assert cursor.position == end
    assert cursor.pending_redelivery == [1]
