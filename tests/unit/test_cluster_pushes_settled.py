"""`DataPlane.pushes_settled`: a node that changed its routes learns when every push a peer
chose it for under the older routes has arrived, on two in-process nodes with real loopback
links. A peer's pushes travel on its own link, not the one its answer to the route change
comes on, so the answer alone says nothing about them (a `$share` stand-in leaving its groups
waits for this before it hands over what it took)."""

from __future__ import annotations

import asyncio

import pytest
from shardgate.core.message import Message

from shardgate.cluster import route_sync
from tests.unit.test_cluster_dataplane import cluster, routes_seen, topic_on, until  # noqa: F401 - fixture


async def test_pushes_sent_before_the_peer_applied_new_routes_arrive_before_it_is_settled(
        cluster, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(route_sync, "ROUTE_WAIT_S", 30.0)  # the bound for a dead peer: not reached here
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 0, "orders")  # a owns orders/0: it pushes to b
    got = b.subscribe("orders/#")
    b.subscribe("elsewhere/#", name="leaving")
    await routes_seen(a, b, 2)
    # a's pushes to b wait in its link's queue (its connection to b is not writable)
    connection = a.plane.links["b"]._connection
    assert connection is not None
    connection.pause_writing()
    payloads = [f"m{index}".encode() for index in range(5)]
    for payload in payloads:
        assert a.broker.publish(Message(topic, payload)) is None
    # b's routes change; a applies the change and answers it on b's link to a
    b.broker.remove_subscription("leaving")
    routes = b.broker.routes_ready()
    settled = b.plane.pushes_settled()
    assert routes is not None and settled is not None
    await asyncio.wait_for(routes, 5)
    await routes_seen(a, b, 1)
    assert not settled.done()  # a's pushes from before are still on their way
    assert got.got == []
    connection.resume_writing()
    await asyncio.wait_for(settled, 5)
    assert [message.payload for message in got.got] == payloads
    assert b.plane.pushes_settled() is None  # nothing changed since


async def test_without_a_route_change_pushes_are_settled_at_once(cluster) -> None:  # noqa: F811
    a, b = cluster["a"], cluster["b"]
    b.subscribe("orders/#")
    await routes_seen(a, b, 1)
    settled = b.plane.pushes_settled()
    if settled is not None:  # the subscription's own update: a says so behind its pushes
        await asyncio.wait_for(settled, 5)
    assert b.plane.pushes_settled() is None


async def test_pushes_flushed_waits_for_pushes_on_their_way_although_no_route_changed(
        cluster) -> None:  # noqa: F811
    """A session handed over from b while another session there holds the same filter: b's
    routes stay as they were, yet a's pushes chosen for it before a knew its new node may still
    be on their way (issue 27, bug 3: the stand-in left before one arrived)."""
    a, b = cluster["a"], cluster["b"]
    topic = topic_on(a.broker, "orders", 0, "orders")
    got = b.subscribe("orders/#")
    await routes_seen(a, b, 1)
    settled = b.plane.pushes_settled()
    if settled is not None:
        await asyncio.wait_for(settled, 5)
    connection = a.plane.links["b"]._connection
    assert connection is not None
    connection.pause_writing()
    payloads = [f"m{index}".encode() for index in range(5)]
    for payload in payloads:
        assert a.broker.publish(Message(topic, payload)) is None
    assert b.plane.pushes_settled() is None  # no route changed: says nothing of the pushes
    flushed = b.plane.pushes_flushed(30.0)
    assert flushed is not None
    sync = b.plane.route_sync
    # a applied b's (empty) update and answered it
    await until(lambda: b.plane.links["a"].routes_answered >= sync.generation)
    assert not flushed.done()
    assert got.got == []
    connection.resume_writing()
    await asyncio.wait_for(flushed, 5)
    assert [message.payload for message in got.got] == payloads
