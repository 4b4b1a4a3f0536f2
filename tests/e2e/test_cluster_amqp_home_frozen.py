"""An AMQP consumer on one node of a queue whose home, another node, is frozen (SIGSTOP) past
its lease, with aiormq against `shardgate serve --cluster` processes and a real etcd.

A frozen node keeps its connections open and says nothing on them, so the gRPC stream that
links the consumer to the queue's home never ends by itself. The consumer must not wait on it
for good: once the home has left the cluster (its lease ran out), the consumer gets
basic.cancel, as for a home that died or left, and its channel stays open (the client can
consume again where the queue is served now).
"""

from __future__ import annotations

import signal

import aiormq

from tests.e2e.cluster_fixtures import ClusterNodeProcess, settled
from tests.e2e.test_cluster_amqp_queues import (  # noqa: F401 - the fixture
    _true,
    amqp_nodes,
    amqp_url,
    by_shard_owner,
    eventually,
    message_count,
    publish_all,
)


async def test_a_consumer_of_a_queue_whose_home_froze_past_its_lease_is_cancelled(
        amqp_nodes: list[ClusterNodeProcess]) -> None:  # noqa: F811 - the imported fixture
    home, other = by_shard_owner(amqp_nodes)
    url_home, url_other = amqp_url(home), amqp_url(other)
    setup = await aiormq.connect(url_home)
    channel = await setup.channel()
    await channel.queue_declare("frozen-home-q", durable=True)
    await channel.queue_bind("frozen-home-q", "amq.topic", routing_key="frozen-home.#")
    await setup.close()
    await publish_all(url_home, [("frozen-home.a", f"m{i}".encode()) for i in range(3)])
    assert await message_count(url_other, "frozen-home-q") == 3

    consumer = await aiormq.connect(url_other)
    consuming = await consumer.channel()
    await consuming.basic_qos(prefetch_count=1)
    got: list[aiormq.abc.DeliveredMessage] = []
    tag = (await consuming.basic_consume("frozen-home-q", got.append)).consumer_tag
    await eventually(lambda: _true(len(got) == 1))
    assert home.proc is not None
    home.proc.send_signal(signal.SIGSTOP)
    try:
        # the home leaves the cluster when its lease runs out (3 s)...
        await eventually(lambda: _true(settled(other, {other.node_id}) is not None), timeout=30)
        # ...and the consumer of its queue is cancelled, not left on a silent stream
        await eventually(lambda: _true(tag not in consuming.consumers), timeout=30)
        assert not consuming.is_closed
        assert [message.body for message in got] == [b"m0"]
    finally:
        home.proc.send_signal(signal.SIGCONT)
        await consumer.close()
