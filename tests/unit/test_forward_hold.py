"""Forwarded publishes held through a failover (`forwarding.HeldForwards`): a publish whose
shard's leader is gone is held by the forwarding node and sent, in order, to the next leader
the view names; refused (retryably) only after the hold's deadline; and past the high water
its publishers are held. Two in-process nodes on real loopback links (the fixtures of
`test_cluster_dataplane.py`); node b, owner of orders/2, stops as a killed process would."""

from __future__ import annotations

import asyncio

import pytest
from shardgate.core.errors import ShardUnavailable
from shardgate.core.message import Message
from shardgate.core.records import decode_to_message
from shardgate.core.resends import FORWARD_ID, RESENT_ID

from shardgate.cluster import forwarding
from shardgate.cluster.membership import ShardAssignment
from tests.unit import test_cluster_dataplane as dataplane
from tests.unit.test_cluster_dataplane import Node, topic_on, until

cluster = dataplane.cluster  # the fixture: nodes a and b


async def owner_gone(a: Node, b: Node) -> None:
    """b's process is gone: its port refuses, and a's link to it is found unreachable."""
    await b.plane.stop()
    await until(lambda: not a.plane.links["b"].reachable)


def move(node: Node, stream: str, shard: int, leader: str, epoch: int) -> None:
    node.view.assignments[(stream, shard)] = ShardAssignment(stream, shard, leader, epoch)
    node.view.changed()


async def test_publishes_for_a_dead_owner_are_held_then_stored_in_order_by_the_next_leader(cluster):
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 2, "orders")
    on_a = a.subscribe("orders/#")
    first = a.broker.publish(Message(topic, b"0", qos=1))
    await owner_gone(a, b)  # (the first may have been stored by b, or held: either way)
    pending = [a.broker.publish(Message(topic, str(i).encode(), qos=1)) for i in range(1, 6)]
    await asyncio.sleep(0.3)  # a few hold retries pass with no leader to take them
    assert not any(future.done() for future in pending), "held, not refused"  # type: ignore[union-attr]
    move(a, "orders", 2, "a", 2)  # the next leader is named: a itself
    await asyncio.wait_for(asyncio.gather(first, *pending), 5)  # type: ignore[arg-type]
    got = [int(m.payload) for m in on_a.got if m.payload != b"0"]
    assert got == [1, 2, 3, 4, 5], "sent on in the order they were published"
    assert a.plane.stats.forward_failures == 0
    assert a.plane.forwarding.held.count == 0 and not a.plane.forwarding.held.shards


async def test_held_publishes_are_refused_retryably_once_their_deadline_passes(cluster, monkeypatch):
    monkeypatch.setattr(forwarding, "FORWARD_HOLD_S", 0.4)
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 2, "orders")
    await owner_gone(a, b)
    started = asyncio.get_running_loop().time()
    future = a.broker.publish(Message(topic, b"nobody leads", qos=1))
    assert future is not None and not future.done()
    with pytest.raises(ShardUnavailable, match="unreachable"):
        await asyncio.wait_for(future, 5)
    assert asyncio.get_running_loop().time() - started >= 0.35
    assert a.plane.forwarding.held.count == 0


async def test_qos0_publishes_for_a_dead_owner_are_not_held(cluster):
    a, b = cluster["a"], cluster["b"]
    await owner_gone(a, b)
    future = a.broker.publish(Message(topic_on(a.broker, "orders", 2, "orders"), b"x"))
    assert future is not None and future.done()
    with pytest.raises(ShardUnavailable):
        future.result()
    assert a.plane.forwarding.held.count == 0


async def test_past_the_high_water_held_publishes_hold_their_publishers(cluster, monkeypatch):
    monkeypatch.setattr(forwarding, "HOLD_HIGH_WATER", 3)
    monkeypatch.setattr(forwarding, "HOLD_LOW_WATER", 1)
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 2, "orders")
    await owner_gone(a, b)
    pending = [a.broker.publish(Message(topic, str(i).encode(), qos=1)) for i in range(3)]
    assert a.broker.back_pressure.is_congested(a.plane.forwarding.held)
    move(a, "orders", 2, "a", 2)
    await asyncio.wait_for(asyncio.gather(*pending), 5)  # type: ignore[arg-type]
    assert not a.broker.back_pressure.is_congested(a.plane.forwarding.held)


async def test_past_the_bound_publishes_are_refused_not_held(cluster, monkeypatch):
    monkeypatch.setattr(forwarding, "MAX_HELD", 2)
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 2, "orders")
    await owner_gone(a, b)
    pending = [a.broker.publish(Message(topic, str(i).encode(), qos=1)) for i in range(3)]
    assert [future.done() for future in pending] == [False, False, True]  # type: ignore[union-attr]
    with pytest.raises(ShardUnavailable):
        pending[2].result()  # type: ignore[union-attr]


async def test_a_stopping_node_refuses_what_it_holds(cluster):
    a, b = cluster["a"], cluster["b"]
    await owner_gone(a, b)
    future = a.broker.publish(Message(topic_on(a.broker, "orders", 2, "orders"), b"x", qos=1))
    assert future is not None and not future.done()
    await a.plane.stop()
    with pytest.raises(ShardUnavailable, match="stopping"):
        await asyncio.wait_for(future, 5)



async def test_a_resent_publish_its_leader_holds_already_is_acknowledged_not_stored_again(cluster):
    """The answer to a forwarded publish was lost (its leader died after storing it, say): held
    and sent again, it is found by its identity in the log (`forward_ids.py`) and acknowledged
    at the offset it has; a resent one the leader does not hold is stored once."""
    a, b = cluster["a"], cluster["b"]
    topic = "ledger/x"
    first = Message(topic, b"stored before the failover", qos=1)
    await asyncio.wait_for(a.broker.publish(first), 5)  # type: ignore[arg-type]
    assert first.native_properties is not None and FORWARD_ID in first.native_properties
    log = b.broker.streams["ledger"].shards[0].log
    assert log is not None and log.next_offset == 1
    # a's link dropped the answer: held (marked as possibly stored) and sent again
    again = a.plane.forwarding.hold(first, None, ShardUnavailable("lost answer"))
    await asyncio.wait_for(again, 5)
    assert log.next_offset == 1, "not stored twice"
    assert b.plane.forwarding.resends.duplicates == 1
    # a resent publish its leader never stored is stored, once
    second = Message(topic, b"never reached the old leader", qos=1)
    second.stream, second.shard = "ledger", 0
    a.plane.forwarding.ids.tag(second)
    await asyncio.wait_for(a.plane.forwarding.hold(second, None, ShardUnavailable("x")), 5)
    assert log.next_offset == 2
    stored = [decode_to_message(record.data) for record in log.read(0, 10)]
    assert [m.payload for m in stored] == [b"stored before the failover", b"never reached the old leader"]
    assert all(m.native_properties is not None and RESENT_ID not in m.native_properties
               and FORWARD_ID in m.native_properties for m in stored)
    assert len({m.native_properties[FORWARD_ID] for m in stored}) == 2  # type: ignore[index]
