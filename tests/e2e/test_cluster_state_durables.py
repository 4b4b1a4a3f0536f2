"""Durable subscriptions shared by the nodes of a cluster, with the gRPC SDK against a real etcd
and `shardgate serve --cluster` processes: a durable subscription consumed on one node is
consumed later on another from where it stopped, with what was published meanwhile; consumers
on several nodes share one cursor on the node that holds it (Shared, Failover, Exclusive).

The tests that neither stop a node nor change its users or streams share one pair of nodes
(`pair`: one start for the module), each with subscription names and topics of its own."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator

import pytest
from shardgate.client import Client, FailedPrecondition, NotFound, SubscriptionType, Unauthenticated
from shardgate.core.message import now_ms

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    EtcdServer,
    ready_shared,
    shared_cluster,
    topics_of,
)
from tests.e2e.test_cluster_state_sessions import TOPICS, etcd_get, spread_stream

Cluster = Callable[..., list[ClusterNodeProcess]]


@pytest.fixture(scope="module")
def module_pair(module_etcd: EtcdServer, tmp_path_factory: pytest.TempPathFactory,
                ) -> Iterator[list[ClusterNodeProcess]]:
    directory = tmp_path_factory.mktemp("durables")
    with shared_cluster([ClusterNodeProcess(directory / name, name, module_etcd.url)
                         for name in ("n1", "n2")]) as nodes:
        yield nodes


@pytest.fixture
def pair(module_pair: list[ClusterNodeProcess]) -> list[ClusterNodeProcess]:
    """Two nodes (as `cluster(2)` starts them) shared by the module's tests that leave them as
    they found them."""
    return ready_shared(module_pair)


async def take(consumer, count: int, *, ack: int | None = None, timeout: float = 30) -> dict[str, list[bytes]]:
    """`count` messages by topic; only the first `ack` (all by default) are acknowledged."""
    got: dict[str, list[bytes]] = defaultdict(list)
    seen = 0

    async def run() -> None:
        nonlocal seen
        async for message in consumer:
            got[message.topic].append(message.payload)
            if ack is None or seen < ack:
                message.ack()
            seen += 1
            if seen == count:
                return

    await asyncio.wait_for(run(), timeout)
    return got


async def publish(url: str, tag: str) -> dict[str, list[bytes]]:
    sent: dict[str, list[bytes]] = defaultdict(list)
    async with Client(url) as client:
        producer = client.producer()
        for sequence in range(3):
            for topic in TOPICS:
                payload = f"{tag}-{topic}-{sequence}".encode()
                await producer.send(topic, payload)
                sent[topic].append(payload)
    return sent


def test_a_durable_subscription_moves_to_the_node_its_consumer_comes_back_to(
        cluster: Cluster, etcd: EtcdServer) -> None:
    n1, n2, n3 = cluster(3)
    spread_stream([n1, n2, n3])

    async def scenario() -> None:
        async with Client(n1.grpc_url) as client:
            consumer = client.consumer("billing", ["away/#"], durable=True, reconnect=False)
            await consumer.subscribe()
            first = await publish(n3.grpc_url, "first")
            # everything delivered, one message of each topic left unacknowledged
            got = await take(consumer, sum(map(len, first.values())), ack=len(TOPICS) * 2)
            assert got == first
            await consumer.close()
        wait_for(lambda: (etcd_get(etcd, "/shardgate/test.state/durables/billing") or {}).get("node") == "n1",
                 timeout=20)
        later = await publish(n3.grpc_url, "later")

        async with Client(n2.grpc_url) as client:
            consumer = client.consumer("billing", ["away/#"], durable=True, reconnect=False)
            await consumer.subscribe()
            # the unacknowledged ones come again, then what was published while nobody consumed
            acked = 2 * len(TOPICS)
            unacked_count = sum(map(len, first.values())) - acked
            again = await take(consumer, unacked_count + sum(map(len, later.values())))
            assert sum(map(len, again.values())) == unacked_count + sum(map(len, later.values()))
            for topic in TOPICS:
                assert again[topic][-len(later[topic]):] == later[topic]  # in order per topic
                assert set(again[topic][:-len(later[topic])]) <= set(first[topic])
            live = await publish(n1.grpc_url, "live")
            assert await take(consumer, sum(map(len, live.values()))) == live
            info = await client.admin.describe_subscription("billing")
            assert info.durable
            await consumer.close()
        wait_for(lambda: (etcd_get(etcd, "/shardgate/test.state/durables/billing") or {}).get("node") == "n2",
                 timeout=20)

    asyncio.run(scenario())


def test_an_exclusive_subscription_refuses_a_consumer_on_another_node(
        pair: list[ClusterNodeProcess], module_etcd: EtcdServer) -> None:
    n1, n2 = pair
    etcd = module_etcd

    async def scenario() -> None:
        async with Client(n1.grpc_url) as first, Client(n2.grpc_url) as second:
            holder = first.consumer("audit", ["audit/#"], durable=True, reconnect=False)
            await holder.subscribe()
            wait_for(lambda: held_by(etcd, "audit") == "n1", timeout=20)
            elsewhere = second.consumer("audit", ["audit/#"], durable=True, reconnect=False)
            with pytest.raises(FailedPrecondition, match="exclusive and already has a consumer"):
                await elsewhere.subscribe()
            await first.producer().send("audit/x", b"still here")
            assert await take(holder, 1) == {"audit/x": [b"still here"]}
            await holder.close()

    asyncio.run(scenario())


def held_by(etcd: EtcdServer, name: str) -> str | None:
    """The node etcd names as the holder of durable subscription `name`."""
    return (etcd_get(etcd, f"/shardgate/test.state/durables/{name}") or {}).get("node")


async def take_from(consumers: list, count: int, timeout: float = 30) -> list[list[bytes]]:
    """`count` messages across `consumers` (acknowledged); what each one got, in order."""
    got: list[list[bytes]] = [[] for _ in consumers]
    done = asyncio.Event()

    async def drain(index: int, consumer) -> None:
        async for message in consumer:
            got[index].append(message.payload)
            message.ack()
            if sum(map(len, got)) >= count:
                done.set()

    tasks = [asyncio.ensure_future(drain(index, consumer)) for index, consumer in enumerate(consumers)]
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return got


def test_a_shared_subscription_spreads_over_consumers_on_two_nodes(
        pair: list[ClusterNodeProcess], module_etcd: EtcdServer) -> None:
    """Consumers of one Shared durable subscription on n1 and on n2: every message reaches one
    of them, once, and both get some; acks from n2 move the one cursor (nothing comes again
    when the n1 consumer leaves)."""
    n1, n2 = pair
    etcd = module_etcd

    async def scenario() -> None:
        async with Client(n1.grpc_url) as first, Client(n2.grpc_url) as second:
            here = first.consumer("work", ["work/#"], type="shared", durable=True, reconnect=False, name="a")
            await here.subscribe()
            wait_for(lambda: held_by(etcd, "work") == "n1", timeout=20)
            there = second.consumer("work", ["work/#"], type="shared", durable=True, reconnect=False, name="b")
            await there.subscribe()
            info = await first.admin.describe_subscription("work")  # on its holder
            assert len(info.consumers) == 2
            producer = second.producer()
            sent = [f"job-{number}".encode() for number in range(40)]
            for payload in sent:
                await producer.send(f"work/{payload.decode()}", payload)
            got = await take_from([here, there], len(sent))
            assert sorted(got[0] + got[1]) == sorted(sent)  # each once
            assert got[0] and got[1]  # spread over both nodes
            await here.close()
            await producer.send("work/after", b"after")
            assert await take(there, 1) == {"work/after": [b"after"]}  # nothing acked came again
            await there.close()

    asyncio.run(scenario())


def test_a_failover_standby_on_another_node_takes_over_when_the_active_consumer_closes(
        pair: list[ClusterNodeProcess], module_etcd: EtcdServer) -> None:
    """The active consumer on n1 leaves with messages it did not acknowledge: the standby on n2
    becomes active and gets those again, then the rest; what n1 acknowledged never comes back."""
    n1, n2 = pair
    etcd = module_etcd

    async def scenario() -> None:
        async with Client(n1.grpc_url) as first, Client(n2.grpc_url) as second:
            active = first.consumer("orders", ["orders/#"], type="failover", durable=True, reconnect=False)
            await active.subscribe()
            assert active.active
            wait_for(lambda: held_by(etcd, "orders") == "n1", timeout=20)
            standby = second.consumer("orders", ["orders/#"], type="failover", durable=True, reconnect=False)
            await standby.subscribe()
            assert not standby.active
            producer = second.producer()
            sent = [f"order-{number}".encode() for number in range(10)]
            for payload in sent:
                await producer.send("orders/eu", payload)
            got = await take(active, len(sent), ack=6)
            assert got == {"orders/eu": sent}  # all to the active consumer, in order
            await active.close()
            await standby.wait_active(timeout=20)
            later = [f"order-{number}".encode() for number in range(10, 14)]
            for payload in later:
                await producer.send("orders/eu", payload)
            again = await take(standby, 4 + len(later))
            assert again == {"orders/eu": sent[6:] + later}
            await standby.close()

    asyncio.run(scenario())


def test_a_failover_standby_on_another_node_takes_over_when_the_active_node_is_killed(
        cluster: Cluster, etcd: EtcdServer) -> None:
    """n1 holds the subscription and its active consumer; n2's consumer is the standby. n1 is
    SIGKILLed: n2's consumer becomes the active one, resuming from the last acknowledged
    position (checkpointed while a consumer elsewhere was attached), and gets what is published
    next: nothing acknowledged twice, nothing lost. (One copy per shard: n2's shards take
    publishes while n1 is down, which a shard replicated on two nodes with both needed in
    sync does not.)"""
    n1, n2 = cluster(2)
    spread_stream([n1, n2], replicas=1)
    topics = topics_of(n2.status(), "away", "away")
    on_n2 = set(topics_of(n2.status(), "away", "away", owner="n2"))

    async def scenario() -> None:
        async with Client(n1.grpc_url) as first, Client(n2.grpc_url) as second:
            active = first.consumer("ledger", ["away/#"], type="failover", durable=True, reconnect=False)
            await active.subscribe()
            wait_for(lambda: held_by(etcd, "ledger") == "n1", timeout=20)
            standby = second.consumer("ledger", ["away/#"], type="failover", durable=True)
            await standby.subscribe()
            assert not standby.active
            producer = second.producer()
            before = [(topic, f"before-{topic}".encode()) for topic in topics]
            for topic, payload in before:
                await producer.send(topic, payload)
            # Failover is per shard (as Pulsar's over partitions): each shard of the stream has
            # one active consumer, so the standby already has some of them
            got = await take_from([active, standby], len(before))
            assert sorted(got[0] + got[1]) == sorted(payload for _, payload in before)
            acked_ms = now_ms()

            def checkpointed() -> bool:
                state = etcd_get(etcd, "/shardgate/test.state/durables/ledger") or {}
                return (state.get("taken_ms", 0) >= acked_ms and not state.get("messages")
                        and all(not cursor[3] for cursor in state.get("cursors", [])))
            # (in a thread: the SDK sends the acks from this loop meanwhile)
            await asyncio.to_thread(wait_for, checkpointed, timeout=20)
            n1.kill()
            await standby.wait_active(timeout=30)
            after = [(topic, f"after-{topic}".encode()) for topic in sorted(on_n2)]
            for topic, payload in after:
                await producer.send(topic, payload)  # n2's shards: served while n1 is down
            again = await take(standby, len(after))
            assert again == {topic: [payload] for topic, payload in after}
            await producer.send(sorted(on_n2)[0], b"marker")
            assert await take(standby, 1) == {sorted(on_n2)[0]: [b"marker"]}
            await standby.close()

    asyncio.run(scenario())


def test_a_failover_standby_on_another_node_takes_over_when_the_active_node_leaves(
        cluster: Cluster, etcd: EtcdServer) -> None:
    """n1 holds the subscription and its active consumer, which has messages it did not
    acknowledge, when n1 stops with SIGTERM: the standby on n2 becomes active and gets exactly
    those again, then what is published next."""
    n1, n2 = cluster(2)
    spread_stream([n1, n2])
    on_n2 = sorted(topics_of(n2.status(), "away", "away", owner="n2", per_shard=2))

    async def scenario() -> None:
        async with Client(n1.grpc_url) as first, Client(n2.grpc_url) as second:
            active = first.consumer("leaving", ["away/#"], type="failover", durable=True, reconnect=False)
            await active.subscribe()
            wait_for(lambda: held_by(etcd, "leaving") == "n1", timeout=20)
            standby = second.consumer("leaving", ["away/#"], type="failover", durable=True)
            await standby.subscribe()
            producer = second.producer()
            before = [(topic, f"before-{topic}".encode()) for topic in on_n2]
            for topic, payload in before:
                await producer.send(topic, payload)
            # each consumer has some shards (Failover is per shard); nobody acknowledges
            got: list[list[bytes]] = [[], []]

            async def hold(index: int, consumer) -> None:
                async for message in consumer:
                    got[index].append(message.payload)

            holders = [asyncio.ensure_future(hold(index, consumer))
                       for index, consumer in enumerate([active, standby])]
            await asyncio.to_thread(wait_for, lambda: len(got[0]) + len(got[1]) == len(before), timeout=30)
            for task in holders:
                task.cancel()
            # Failover gives shard s to consumer s % 2: n1's has some unless n2 owns odd ones only
            assert got[0] or all(zlib.crc32(topic.encode()) % 6 % 2 for topic in on_n2)
            assert await asyncio.to_thread(n1.terminate) == 0
            await standby.wait_active(timeout=30)
            # everything unacknowledged comes (again) to n2's consumer, then the next message
            again = await take(standby, len(before))
            assert sorted(payload for payloads in again.values() for payload in payloads) == \
                sorted(payload for _, payload in before)
            await producer.send(on_n2[0], b"next")
            assert await take(standby, 1) == {on_n2[0]: [b"next"]}
            await standby.close()

    asyncio.run(scenario())


def test_consumers_defining_a_subscription_on_two_nodes_at_once_share_one(
        pair: list[ClusterNodeProcess], module_etcd: EtcdServer) -> None:
    """Two consumers create the same new Shared subscription at the same moment on n1 and n2:
    one node holds it (a create-if-absent claim in etcd), the other relays to it, so each
    message is delivered once, not once per node."""
    n1, n2 = pair
    etcd = module_etcd

    async def scenario() -> None:
        async with Client(n1.grpc_url) as first, Client(n2.grpc_url) as second:
            consumers = [client.consumer("race", ["race/#"], type="shared", durable=True, reconnect=False)
                         for client in (first, second)]
            await asyncio.gather(*(consumer.subscribe() for consumer in consumers))
            assert held_by(etcd, "race") in {"n1", "n2"}
            producer = first.producer()
            sent = [f"r-{number}".encode() for number in range(20)]
            for payload in sent:
                await producer.send(f"race/{payload.decode()}", payload)
            got = await take_from(consumers, len(sent))
            await producer.send("race/last", b"last")
            got_last = await take_from(consumers, 1)
            assert sorted(got[0] + got[1]) == sorted(sent)
            assert got_last[0] + got_last[1] == [b"last"]  # nothing of `sent` came twice
            for consumer in consumers:
                await consumer.close()

    asyncio.run(scenario())


def test_an_authenticated_consumer_is_relayed_to_the_holder(cluster: Cluster, etcd: EtcdServer) -> None:
    """Once a user exists: alice, authenticated on n2, is served through n1 (which holds her
    subscription; the holder authorizes her by name, its cluster port checks no password), and
    a wrong password is refused on n2 before anything is relayed."""
    n1, n2 = cluster(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    added = subprocess.run(
        [sys.executable, "-m", "shardgate", "users", "add", "alice", "--password", "s3cret",
         "--data-dir", str(n1.data_dir)], capture_output=True, text=True, timeout=60, env=env)
    assert added.returncode == 0, added.stderr

    async def known_on_n2() -> bool:
        # a node that has not yet seen the first user still serves anyone (no users: open), so
        # what shows n2 knows alice is a wrong password refused, then the right one accepted
        async with Client(n2.grpc_url, username="alice", password="not-hers") as client:
            try:
                await client.producer().send("alice/probe", b"probe")
                return False
            except Unauthenticated:
                pass
        async with Client(n2.grpc_url, username="alice", password="s3cret") as client:
            try:
                await client.producer().send("alice/probe", b"probe")
            except Unauthenticated:
                return False
        return True
    wait_for(lambda: asyncio.run(known_on_n2()), timeout=20)

    async def scenario() -> None:
        async with Client(n1.grpc_url, username="alice", password="s3cret") as first, \
                Client(n2.grpc_url, username="alice", password="s3cret") as second:
            here = first.consumer("alices", ["alice/#"], type="shared", durable=True, reconnect=False)
            await here.subscribe()
            there = second.consumer("alices", ["alice/#"], type="shared", durable=True, reconnect=False)
            await there.subscribe()
            sent = [f"a-{number}".encode() for number in range(10)]
            producer = second.producer()
            for payload in sent:
                await producer.send(f"alice/{payload.decode()}", payload)
            got = await take_from([here, there], len(sent))
            assert sorted(got[0] + got[1]) == sorted(sent) and got[1]
            async with Client(n2.grpc_url, username="alice", password="wrong") as intruder:
                with pytest.raises(Unauthenticated):
                    await intruder.consumer("alices", ["alice/#"], type="shared", durable=True,
                                            reconnect=False).subscribe()
            for consumer in (here, there):
                await consumer.close()

    asyncio.run(scenario())


def test_a_shared_subscription_keeps_what_is_published_while_no_consumer_is_attached(
        cluster: Cluster, etcd: EtcdServer) -> None:
    """The subscription is held by n1, its topic's shard is owned by n2: what is published while
    its consumers are away reaches them when one comes back to n1 (the owner pushes to n1 for
    the durable subscription, consumers or not)."""
    n1, n2 = cluster(2)
    spread_stream([n1, n2])
    topic = topics_of(n2.status(), "away", "away", owner="n2")[0]

    async def scenario() -> None:
        async with Client(n1.grpc_url) as first:
            consumer = first.consumer("backlog", ["away/#"], type="shared", durable=True, reconnect=False)
            await consumer.subscribe()
            await consumer.close()
            producer = first.producer()
            sent = [f"while-away-{number}".encode() for number in range(50)]
            for payload in sent:
                await producer.send(topic, payload)
            back = first.consumer("backlog", ["away/#"], type="shared", durable=True, reconnect=False)
            await back.subscribe()
            assert await take(back, len(sent)) == {topic: sent}
            await back.close()

    asyncio.run(scenario())


async def drain_exactly_once(consumers: list, sent: list[bytes], timeout: float = 60) -> None:
    """Drain `consumers` until every payload of `sent` came, then a little longer: each came
    once (an ack per message)."""
    got: list[bytes] = []
    done = asyncio.Event()
    wanted = len(sent)

    async def drain(consumer) -> None:
        async for message in consumer:
            got.append(message.payload)
            message.ack()
            if len(got) >= wanted:
                done.set()

    tasks = [asyncio.ensure_future(drain(consumer)) for consumer in consumers]
    try:
        try:
            await asyncio.wait_for(done.wait(), timeout)
        except TimeoutError:
            pytest.fail(f"{len(got)} of {wanted} messages came (distinct: {len(set(got))})")
        # Anything delivered twice would come right after the last one.
        await asyncio.sleep(0.5)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert len(got) == len(set(got)) == wanted
    assert set(got) == set(sent)


async def publish_fast(producer, topic: str, count: int, tag: str) -> list[bytes]:
    sent = [f"{tag}-{number}".encode() for number in range(count)]
    await asyncio.gather(*(producer.send_nowait(topic, payload) for payload in sent))
    return sent


@pytest.mark.parametrize("owner", ["n2", "n1"])
def test_messages_published_while_shared_consumers_are_out_of_credit_all_come_once(
        cluster: Cluster, etcd: EtcdServer, owner: str) -> None:
    """The subscription is held by n1; its topic's shard is owned by n2 (pushed to n1 over the
    cluster port, where n1 keeps a window of 10,000) or by n1 itself. Its two consumers take
    their small credit windows and stop; 15,000 messages are published meanwhile, more than
    the pushes' window and a consumer's queue hold: when the consumers read again, every one
    comes, once (n1 reads what slid out of its window from n2's journal)."""
    n1, n2 = cluster(2)
    spread_stream([n1, n2])
    topic = topics_of(n2.status(), "away", "away", owner=owner)[0]

    async def scenario() -> None:
        async with Client(n1.grpc_url) as first, Client(n2.grpc_url) as second:
            consumers = [first.consumer("flood", ["away/#"], type="shared", durable=True,
                                        reconnect=False, credit=10, name=name) for name in "ab"]
            for consumer in consumers:
                await consumer.subscribe()
            wait_for(lambda: held_by(etcd, "flood") == "n1", timeout=20)
            sent = await publish_fast(second.producer(), topic, 15_000, "flood")
            await drain_exactly_once(consumers, sent)
            for consumer in consumers:
                await consumer.close()

    asyncio.run(scenario())


def test_a_durable_subscription_is_described_and_deleted_on_any_node(cluster: Cluster, etcd: EtcdServer) -> None:
    """`describe_subscription` on a node that does not hold the subscription answers as its
    holder does: both consumers (one relayed from the other node), the type and the filters;
    with its holder SIGKILLed, from the last checkpoint (no consumer); a name nobody holds is
    NOT_FOUND on every node. `delete_subscription` on a node that does not hold it deletes it
    on its holder (whose consumer's stream ends), or in etcd when the holder is down."""
    n1, n2 = cluster(2)

    async def scenario() -> None:
        async with Client(n1.grpc_url) as first, Client(n2.grpc_url) as second:
            doomed = first.consumer("doomed", ["doomed/#"], durable=True, reconnect=False)
            await doomed.subscribe()
            wait_for(lambda: held_by(etcd, "doomed") == "n1", timeout=20)
            await second.admin.delete_subscription("doomed")
            with pytest.raises(NotFound):
                await first.admin.describe_subscription("doomed")
            with pytest.raises(BaseException) as ended:  # its stream ends (not a timeout)
                await doomed.receive(timeout=20)
            assert not isinstance(ended.value, TimeoutError), ended.value
            with pytest.raises(NotFound):
                await second.admin.delete_subscription("doomed")

            here = first.consumer("audit", ["audit/#"], type="shared", durable=True, reconnect=False, name="a")
            await here.subscribe()
            wait_for(lambda: held_by(etcd, "audit") == "n1", timeout=20)
            there = second.consumer("audit", ["audit/#"], type="shared", durable=True, reconnect=False, name="b")
            await there.subscribe()
            on_holder = await first.admin.describe_subscription("audit")
            elsewhere = await second.admin.describe_subscription("audit")
            assert elsewhere == on_holder
            assert elsewhere.durable and elsewhere.type == SubscriptionType.SHARED
            assert elsewhere.topic_filters == ["audit/#"] and len(elsewhere.consumers) == 2
            await here.close()
            await there.close()
            await asyncio.to_thread(
                wait_for, lambda: asyncio.run(described_consumers(n2.grpc_url, "audit")) == 0, timeout=20)
            n1.kill()
            checkpoint = await second.admin.describe_subscription("audit")
            assert (checkpoint.name, checkpoint.type, checkpoint.durable, checkpoint.topic_filters,
                    checkpoint.consumers) == ("audit", SubscriptionType.SHARED, True, ["audit/#"], [])
            with pytest.raises(NotFound):
                await second.admin.describe_subscription("nobody-holds-this")
            # once n2 knows n1 is gone (its lease ended), the record in etcd is deleted
            await asyncio.to_thread(wait_for, lambda: {e["node_id"] for e in n2.status()["nodes"]} == {"n2"},
                                    timeout=30)
            await second.admin.delete_subscription("audit")
            assert held_by(etcd, "audit") is None
            with pytest.raises(NotFound):
                await second.admin.describe_subscription("audit")

    asyncio.run(scenario())


async def described_consumers(url: str, name: str) -> int:
    async with Client(url) as client:
        return len((await client.admin.describe_subscription(name)).consumers)
