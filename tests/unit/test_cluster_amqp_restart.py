"""A durable AMQP queue's home node restarting (SIGTERM, then start) in a cluster, on two
in-process nodes with real loopback links: the messages its consumers held unacknowledged on
shards another node owns come back once each, marked as handed out before (AMQP
`redelivered`), however the start's steps interleave with the owner's answers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from shardgate.core.durable import DurableSubscription, encode_cursor_state
from shardgate.core.message import Message

from shardgate.cluster.amqp_queues import SharedQueues
from shardgate.cluster.membership import ShardAssignment
from shardgate.cluster.session_cursors import CursorPlacer
from shardgate.cluster.shard_reader import OwnerLogs, serve_read
from shardgate.cluster.state_rpc import StateRpc
from tests.unit.test_cluster_dataplane import cluster, routes_seen, until  # noqa: F401 - fixture


class QueueStandIn:
    """The restored queue as its subscription's consumer sees it: keeps what it is handed
    with the flag `protocols.amqp.queues.Queue.deliver` would give it."""

    exclusive_owner = None
    auto_delete = False

    def __init__(self, subscription: DurableSubscription) -> None:
        self.subscription = subscription
        self.consumer_id = subscription.name
        self.available = True
        self.got: list[tuple[bytes, bool]] = []

    def deliver(self, message, subscription, filters):  # type: ignore[no-untyped-def]
        self.got.append((message.payload, subscription.handed_out_before(message)))


async def test_a_restarted_home_redelivers_what_its_queue_had_handed_out_once_and_flagged(cluster):  # noqa: F811
    a, b = cluster["a"], cluster["b"]
    rpcs = []
    for node in (a, b):
        rpc = StateRpc(node.view)
        rpc.on_read = lambda request, node=node: serve_read(node.broker, node.plane, request)
        node.plane.add_service(rpc.handler())
        node.owner_reads.reads = OwnerLogs(rpc)
        rpcs.append(rpc)
    moved = ShardAssignment("ledger", 0, "a", 2)  # a owns ledger/0; b (the home) keeps an empty journal of it
    for node in (a, b):
        node.view.assignments[("ledger", 0)] = moved
        node.view.changed()
    for payload in (b"m0", b"m1", b"m2"):
        await asyncio.wait_for(a.broker.publish(Message("ledger/x", payload, qos=1)), 5)  # type: ignore[arg-type]
    # b stopped with its queue having had m0..m2 (unacknowledged: one held by a consumer,
    # two waiting): saved at offset 3 with 0, 1, 2 unacknowledged. Restoring clamps the cursor
    # to b's empty log of the shard.
    saved = encode_cursor_state(3, [0, 1, 2])
    b.broker.placement = None
    b.broker.restored_cursors_wait = True
    sub = b.broker.durable_subscription("orders-q")
    b.broker.add_filter(sub, "ledger/#")
    sub.restore_cursor("ledger", 0, saved)
    queue = QueueStandIn(sub)
    b.broker.attach(sub, queue)
    b.broker.placement = b.plane
    b.view.changed()
    # the start's steps, in attach.py's order: the AMQP queues are installed ...
    b.view.documents = {}  # type: ignore[attr-defined] - etcd's documents: none
    node = SimpleNamespace(node_id="b", view=b.view, state_rpc=rpcs[1], document_listeners=[])
    vhost = SimpleNamespace(name="/", queues={"orders-q": queue}, on_queue_deleted=[], directory=None,
                            use_queue_directory=lambda: None)
    SharedQueues(node, b.broker).install(b.plane, SimpleNamespace(vhosts={"/": vhost}, on_reauthorize=[]))  # type: ignore[arg-type]
    # ... the node joins: its awaits let the owner answer reads meanwhile (the join's time
    # modelled by a fixed pause: nothing to wait on, the test is about what happens in it) ...
    await routes_seen(a, b, 1)
    await asyncio.sleep(0.3)
    # ... then the restored cursors replay from their saved floors
    placer = CursorPlacer(node, b.broker, b.plane, rpcs[1])  # type: ignore[arg-type]
    placer.replay_restored()
    await asyncio.wait_for(a.broker.publish(Message("ledger/x", b"m3", qos=1)), 5)  # type: ignore[arg-type]
    await until(lambda: (b"m3", False) in queue.got)
    assert sorted(queue.got) == [(b"m0", True), (b"m1", True), (b"m2", True), (b"m3", False)]
    for rpc in rpcs:
        await rpc.close()
