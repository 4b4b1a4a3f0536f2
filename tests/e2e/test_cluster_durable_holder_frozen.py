"""A gRPC consumer relayed to the node holding its durable subscription, when that node is
frozen (SIGSTOP) past its lease, with the gRPC SDK against `shardgate serve --cluster`
processes and a real etcd.

A frozen node keeps its connections open and says nothing on them, so the relayed stream
(`durable_consumers.py`) never ends by itself. Once the holder has left the cluster (its lease
ran out), the stream ends with UNAVAILABLE, as for a holder that died, and the SDK subscribes
again on its own node, which takes the subscription over: a Failover standby there becomes
the active consumer and gets what is published next.
"""

from __future__ import annotations

import asyncio
import signal

from shardgate.client import Client

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import EtcdServer, topics_of
from tests.e2e.test_cluster_state_durables import Cluster, held_by, take
from tests.e2e.test_cluster_state_sessions import spread_stream


def test_a_standby_relayed_to_a_holder_frozen_past_its_lease_takes_over_on_its_own_node(
        cluster: Cluster, etcd: EtcdServer) -> None:
    n1, n2 = cluster(2)
    spread_stream([n1, n2], replicas=1)
    on_n2 = sorted(topics_of(n2.status(), "away", "away", owner="n2"))
    assert n1.proc is not None

    async def scenario() -> None:
        async with Client(n1.grpc_url) as first, Client(n2.grpc_url) as second:
            active = first.consumer("frozen-ledger", ["away/#"], type="failover", durable=True,
                                    reconnect=False)
            await active.subscribe()
            await asyncio.to_thread(wait_for, lambda: held_by(etcd, "frozen-ledger") == "n1",
                                    timeout=20)
            standby = second.consumer("frozen-ledger", ["away/#"], type="failover", durable=True)
            await standby.subscribe()
            assert not standby.active
            n1.proc.send_signal(signal.SIGSTOP)
            try:
                # n1's lease runs out (3 s): the relayed stream ends, and the standby
                # subscribes again on n2, which takes the subscription over
                await standby.wait_active(timeout=30)
                producer = second.producer()
                for topic in on_n2:
                    await producer.send(topic, f"after-{topic}".encode())
                got = await take(standby, len(on_n2))
                assert got == {topic: [f"after-{topic}".encode()] for topic in on_n2}
                await standby.close()
            finally:
                n1.proc.send_signal(signal.SIGCONT)

    asyncio.run(scenario())
