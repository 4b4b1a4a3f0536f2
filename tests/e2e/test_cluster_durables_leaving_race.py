"""A durable gRPC subscription whose node stops gracefully (SIGTERM) while its consumer
subscribes again on a third node at once, as soon as its stream ends, with messages still
being published: the consumer goes on from where it was, nothing lost, nothing it had
acknowledged (and the holder had taken) sent again; only what was in flight may come again
(at least once). And the subscription is the new node's afterwards: the leaving node's last
checkpoint does not name it again in etcd. The counterpart of
`test_cluster_sessions_leaving_race.py` for durable subscriptions: there a leaving node pushed
its offline sessions to a third node, racing their clients; a durable subscription is only
ever pulled, by its consumer's node from the holder (`ReleaseDurable`, which the holder
answers by giving it up at once), so that race has no counterpart here, and these tests guard
the moves that remain. Real etcd, three `shardgate serve` nodes, the gRPC SDK."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from shardgate.client import Client

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    EtcdServer,
    eventually,
    protocol_node,
    settled_nodes,
    wait_settled,
)
from tests.e2e.test_cluster_state_sessions import etcd_get

# Replicated shards, as a cluster has them by default (3 replicas, 2 in sync): a publish its
# shard's leader appended is stored once even when a node leaves before it is committed (a
# forwarded one is held and sent to the next leader, which finds it; one on the leader's node
# waits for its replicas), so the consumer gets nothing twice.
WORK = '[[streams]]\nname = "work"\nmode = "reliable"\npartitions = 3\nroutes = ["work/#"]\n'
KEY = "/shardgate/test.state/durables/ledger"
BEFORE = 20  # acknowledged on the leaving node, and known there to be: never sent again
DURING = 60  # published while the leaving node stops and the consumer moves


async def _true(value: bool) -> bool:
    return value


def test_a_durable_subscription_resumed_elsewhere_while_its_node_stops_loses_and_repeats_nothing(
        etcd: EtcdServer, tmp_path: Path) -> None:
    nodes = [protocol_node(tmp_path, name, etcd.url, WORK).start() for name in ("n1", "n2", "n3")]
    with settled_nodes(nodes) as (n1, n2, n3):

        async def scenario() -> None:
            async with Client(n1.grpc_url) as publishing, Client(n2.grpc_url) as leaving, \
                    Client(n3.grpc_url) as staying:
                producer = publishing.producer("producer")
                consumer = leaving.consumer("ledger", ["work/#"], durable=True, reconnect=False)
                await consumer.subscribe()
                for index in range(BEFORE):
                    await producer.publish(f"work/{index % 7}", f"before-{index}")
                before = set()
                for _ in range(BEFORE):
                    message = await consumer.receive(20)
                    before.add(message.text())
                    message.ack()
                assert before == {f"before-{index}" for index in range(BEFORE)}

                async def all_acknowledged() -> bool:
                    info = await leaving.admin.describe_subscription("ledger")
                    return bool(info.consumers) and all(c.unacked == 0 for c in info.consumers)

                await eventually(all_acknowledged)  # n2 holds every ack of these

                sent: list[str] = []

                async def publish_during() -> None:
                    for index in range(DURING):
                        await producer.publish(f"work/{index % 7}", f"during-{index}")
                        sent.append(f"during-{index}")

                publishing_task = asyncio.ensure_future(publish_during())
                on_leaving: list[str] = []
                while len(on_leaving) < 5:  # consumed on n2, acknowledged or not yet
                    message = await consumer.receive(20)
                    on_leaving.append(message.text())
                    message.ack()
                assert n2.proc is not None
                n2.proc.send_signal(signal.SIGTERM)
                try:
                    while True:  # until n2 ends the stream; then at once on n3
                        message = await consumer.receive(30)
                        on_leaving.append(message.text())
                        message.ack()
                except Exception:  # noqa: BLE001 - the stream ends, however it says so
                    pass
                resumed = staying.consumer("ledger", ["work/#"], durable=True)
                await resumed.subscribe()
                await asyncio.wait_for(publishing_task, 120)
                on_staying: list[str] = []
                missing = set(sent) - set(on_leaving)
                while missing - set(on_staying):
                    message = await resumed.receive(30)
                    on_staying.append(message.text())
                    message.ack()
                await producer.publish("work/last", "last")
                while True:
                    message = await resumed.receive(30)
                    on_staying.append(message.text())
                    message.ack()
                    if message.text() == "last":
                        break
                with_no_loss = set(on_leaving) | set(on_staying)
                assert set(sent) <= with_no_loss, f"lost: {sorted(set(sent) - with_no_loss)}"
                again = [text for text in on_staying if text.startswith("before-")]
                assert not again, f"acknowledged on n2 before it stopped, and sent again: {again}"
                # what n3 sends twice itself, or what n2 had not had acknowledged, may come again;
                # nothing else does
                repeated = {text for text in on_staying if on_staying.count(text) > 1}
                assert not repeated, f"sent twice on n3: {sorted(repeated)}"
                await resumed.close()

        asyncio.run(scenario())
        assert n2.proc is not None and n2.proc.wait(30) == 0
        wait_settled([n1, n3])
        # etcd names the node that holds it: a consumer coming to n1 later takes it from there
        wait_for(lambda: (etcd_get(etcd, KEY) or {}).get("node") == "n3", timeout=20)


def test_a_shared_subscription_consumed_on_two_nodes_moves_whole_when_its_holder_stops(
        etcd: EtcdServer, tmp_path: Path) -> None:
    """Shared, with a consumer on n2 (its holder) and one on n3 (relayed to n2): n2 stops, its
    consumer comes to n3 at once while the one on n3 still is, or was just, relayed to n2 (the
    relay ends; the SDK subscribes again on n3). Every message reaches one of them, nothing
    acknowledged on n2 comes again, and etcd names n3 afterwards (n2's last checkpoint, written
    as it stops, does not name n2 again after n3 took the subscription over)."""
    nodes = [protocol_node(tmp_path, name, etcd.url, WORK).start() for name in ("n1", "n2", "n3")]
    with settled_nodes(nodes) as (n1, n2, n3):

        async def scenario() -> None:
            async with Client(n1.grpc_url) as publishing, Client(n2.grpc_url) as leaving, \
                    Client(n3.grpc_url) as staying:
                producer = publishing.producer("producer")
                here = leaving.consumer("ledger", ["work/#"], type="shared", durable=True,
                                        reconnect=False, name="a")
                await here.subscribe()
                wait_for(lambda: (etcd_get(etcd, KEY) or {}).get("node") == "n2", timeout=20)
                there = staying.consumer("ledger", ["work/#"], type="shared", durable=True, name="b")
                await there.subscribe()
                for index in range(BEFORE):
                    await producer.publish(f"work/{index % 7}", f"before-{index}")
                received: list[str] = []

                async def drain(consumer, until: asyncio.Event) -> None:
                    while not until.is_set():
                        try:
                            message = await consumer.receive(0.5)
                        except TimeoutError:
                            continue
                        received.append(message.text())
                        message.ack()

                stop_there = asyncio.Event()
                draining_there = asyncio.ensure_future(drain(there, stop_there))
                # `here` takes its share of the first messages
                while len({text for text in received if text.startswith("before-")}) < BEFORE:
                    try:
                        message = await here.receive(0.5)
                    except TimeoutError:
                        continue
                    received.append(message.text())
                    message.ack()

                async def all_acknowledged() -> bool:
                    info = await leaving.admin.describe_subscription("ledger")
                    return len(info.consumers) == 2 and all(c.unacked == 0 for c in info.consumers)

                await eventually(all_acknowledged)  # n2 holds every ack of these
                sent: list[str] = []

                async def publish_during() -> None:
                    for index in range(DURING):
                        await producer.publish(f"work/{index % 7}", f"during-{index}")
                        sent.append(f"during-{index}")

                publishing_task = asyncio.ensure_future(publish_during())
                await eventually(lambda: _true(len(sent) >= 5))
                assert n2.proc is not None
                n2.proc.send_signal(signal.SIGTERM)
                try:
                    while True:  # until n2 ends the stream; then at once on n3
                        message = await here.receive(30)
                        received.append(message.text())
                        message.ack()
                except Exception:  # noqa: BLE001 - the stream ends, however it says so
                    pass
                moved = staying.consumer("ledger", ["work/#"], type="shared", durable=True, name="a")
                await moved.subscribe()
                stop_moved = asyncio.Event()
                draining_moved = asyncio.ensure_future(drain(moved, stop_moved))
                await asyncio.wait_for(publishing_task, 120)
                await producer.publish("work/last", "last")
                await eventually(lambda: _true("last" in received and set(sent) <= set(received)),
                                 timeout=60)
                stop_there.set()
                stop_moved.set()
                await asyncio.gather(draining_there, draining_moved)
                again = [text for text in received if text.startswith("before-")
                         and received.count(text) > 1]
                assert not again, f"acknowledged on n2 before it stopped, and sent again: {again}"
                await moved.close()
                await there.close()

        asyncio.run(scenario())
        assert n2.proc is not None and n2.proc.wait(30) == 0
        wait_settled([n1, n3])
        wait_for(lambda: (etcd_get(etcd, KEY) or {}).get("node") == "n3", timeout=20)
