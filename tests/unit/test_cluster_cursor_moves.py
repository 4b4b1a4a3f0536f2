"""A reliable shard moved to another node by copying (a graceful leave, a drain), on two
in-process nodes with real loopback links: a durable subscription that followed the old
leader's pushes reads the shard again from its position in the new leader's log, so a message
the old leader stored and acknowledged, whose push had not arrived when the new leader's first
message did, still comes (once, in order)."""

from __future__ import annotations

import asyncio

from shardgate.core.message import Message
from shardgate.core.records import encode_message

from shardgate.cluster.membership import ShardAssignment
from shardgate.cluster.shard_reader import OwnerLogs, serve_read
from shardgate.cluster.state_rpc import StateRpc
from tests.unit.test_cluster_dataplane import Recorder, cluster, routes_seen, until  # noqa: F401 - fixture


async def test_a_cursor_on_the_new_leader_reads_what_the_old_one_stored_but_never_pushed(cluster):  # noqa: F811
    a, b = cluster["a"], cluster["b"]  # b owns ledger/0
    sub = a.broker.durable_subscription("orders-q")
    a.broker.add_filter(sub, "ledger/#")
    queue = Recorder("queue")
    a.broker.attach(sub, queue)
    await routes_seen(b, a, 1)
    for payload in (b"m0", b"m1"):
        await asyncio.wait_for(b.broker.publish(Message("ledger/x", payload, qos=1)), 5)  # type: ignore[arg-type]
    await until(lambda: len(queue.got) == 2)
    # b stores m2 (and acknowledges it); its push to a is still on the way when ...
    b_log = b.broker.streams["ledger"].shards[0].log
    assert b_log is not None
    b_log.append([(0, encode_message(Message("ledger/x", b"m2")))])
    await b_log.flush()
    # ... the shard moves to a, whose journal holds the copy its fetches made
    a_log = a.broker.streams["ledger"].shards[0].log
    assert a_log is not None
    a_log.append([(record.timestamp_ms, bytes(record.data)) for record in b_log.read(0, 10)])
    await a_log.flush()
    a.broker.swap_shard_log("ledger", 0, a_log)
    for node in (a, b):
        node.view.assignments[("ledger", 0)] = ShardAssignment("ledger", 0, "a", 2)
        node.view.changed()
    # a's first message of the shard is delivered before b's late push arrives (or never does)
    await asyncio.wait_for(a.broker.publish(Message("ledger/x", b"m3", qos=1)), 5)  # type: ignore[arg-type]
    await until(lambda: len(queue.got) >= 4)
    await asyncio.sleep(0.1)
    assert [(m.offset, m.payload) for m in queue.got] == [(0, b"m0"), (1, b"m1"), (2, b"m2"), (3, b"m3")]


async def test_a_cursor_on_the_old_leader_reads_what_the_new_one_pushed_before_its_view_moved(cluster):  # noqa: F811
    a, b = cluster["a"], cluster["b"]  # b owns ledger/0, and its queue follows its own log
    for node in (a, b):
        rpc = StateRpc(node.view)
        rpc.on_read = lambda request, node=node: serve_read(node.broker, node.plane, request)
        node.plane.add_service(rpc.handler())
        node.owner_reads.reads = OwnerLogs(rpc)
    sub = b.broker.durable_subscription("orders-q")
    b.broker.add_filter(sub, "ledger/#")
    queue = Recorder("queue")
    b.broker.attach(sub, queue)
    await routes_seen(a, b, 1)
    for payload in (b"m0", b"m1"):
        await asyncio.wait_for(b.broker.publish(Message("ledger/x", payload, qos=1)), 5)  # type: ignore[arg-type]
    assert [m.payload for m in queue.got] == [b"m0", b"m1"]
    queue.available = False  # its consumer is busy (or gone) for a while
    # the shard moves to a (a copy of b's log); a's view shows it first, and a's first message
    # is pushed to b while b still takes itself for the leader
    b_log, a_log = b.broker.streams["ledger"].shards[0].log, a.broker.streams["ledger"].shards[0].log
    assert b_log is not None and a_log is not None
    a_log.append([(record.timestamp_ms, bytes(record.data)) for record in b_log.read(0, 10)])
    await a_log.flush()
    a.broker.swap_shard_log("ledger", 0, a_log)
    a.view.assignments[("ledger", 0)] = ShardAssignment("ledger", 0, "a", 2)
    a.view.changed()
    await asyncio.wait_for(a.broker.publish(Message("ledger/x", b"m2", qos=1)), 5)  # type: ignore[arg-type]
    await asyncio.sleep(0.1)
    # the consumer has room again: b's own log ends before m2, so its cursor takes itself for
    # caught up (live) ...
    queue.available = True
    sub.wake()
    await asyncio.sleep(0.1)
    # ... then b's view shows a as the leader, and a's next message is pushed
    b.view.assignments[("ledger", 0)] = ShardAssignment("ledger", 0, "a", 2)
    b.view.changed()
    await asyncio.wait_for(a.broker.publish(Message("ledger/x", b"m3", qos=1)), 5)  # type: ignore[arg-type]
    await until(lambda: len(queue.got) >= 4)
    await asyncio.sleep(0.1)
    assert [(m.offset, m.payload) for m in queue.got] == [
        (0, b"m0"), (1, b"m1"), (2, b"m2"), (3, b"m3")]
