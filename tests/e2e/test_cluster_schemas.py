"""The schema registry of a cluster (issue 29): a schema registered on one node checks publishes
on every node (MQTT 5 PUBACK 0x99 on the other node too), a version registered on the other
node comes back to the first, and a node that joins later gets them all."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

from shardgate.client import Client
from shardgate.protocols.mqtt import packets as p

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess
from tests.mqtt_clients import RawClient

STREAMS = '[[streams]]\nname = "sensors"\nroutes = ["sensors/#"]\npartitions = 2\n'
REQUIRED = {"type": "object", "properties": {"device": {"type": "string"},
                                              "temp": {"type": "number"}},
            "required": ["device", "temp"]}
WIDENED = {"type": "object", "properties": {"device": {"type": "string"},
                                             "temp": {"type": "number"},
                                             "site": {"type": "string"}},
           "required": ["device", "temp"]}


def versions_on(node: ClusterNodeProcess) -> list[int]:
    async def read() -> list[int]:
        async with Client(node.grpc_url) as client:
            return [info.version for info in await client.admin.schemas("sensors")]

    return asyncio.run(read())


def register(node: ClusterNodeProcess, schema: dict[str, object]) -> int:
    async def call() -> int:
        async with Client(node.grpc_url) as client:
            return (await client.admin.register_schema("sensors", schema)).version

    return asyncio.run(call())


def pubacks(node: ClusterNodeProcess, payloads: list[bytes]) -> list[int]:
    client = RawClient(node.mqtt_port, version=5)
    client.connect(f"schema-check-{node.node_id}")
    codes = []
    for index, payload in enumerate(payloads, start=1):
        client.send(p.Publish(f"sensors/d{index}", payload, 1, packet_id=index))
        ack = client.receive()
        assert isinstance(ack, p.Puback)
        codes.append(ack.reason_code)
    client.close()
    return codes


def test_a_schema_registered_on_one_node_checks_publishes_on_every_node(
    cluster: Callable[..., list[ClusterNodeProcess]],
) -> None:
    n1, n2 = cluster(2, extra_config=STREAMS)
    assert register(n1, REQUIRED) == 1
    wait_for(lambda: versions_on(n2) == [1], timeout=30)
    good, bad = b'{"device": "d1", "temp": 21.5}', b'{"device": "d1", "temp": "hot"}'
    assert pubacks(n2, [good, bad]) == [0, 0x99]
    assert pubacks(n1, [bad]) == [0x99]
    # a version registered on n2 reaches n1, and both check against it
    assert register(n2, WIDENED) == 2
    wait_for(lambda: versions_on(n1) == [1, 2], timeout=30)
    widened_bad = b'{"device": "d1", "temp": 3, "site": 7}'
    assert pubacks(n1, [widened_bad]) == [0x99]
    # a node joining later gets every version
    (n3,) = cluster(1, first=3, extra_config=STREAMS)
    wait_for(lambda: versions_on(n3) == [1, 2], timeout=30)
    assert pubacks(n3, [good, widened_bad]) == [0, 0x99]


def test_registrations_on_two_nodes_at_once_are_ordered_none_lost(
    cluster: Callable[..., list[ClusterNodeProcess]],
) -> None:
    """Two nodes register a version of one stream at the same moment, several times: etcd
    orders them (compare-and-set), so every registration gets its own version number, each
    checked against the one before it, and both nodes end with every version."""
    n1, n2 = cluster(2, extra_config=STREAMS)

    def variant(name: str) -> dict[str, object]:
        return {"type": "object", "properties": {"device": {"type": "string"},
                                                 name: {"type": "number"}},
                "required": ["device"]}

    async def at_once(round_: int) -> list[int]:
        async with Client(n1.grpc_url) as c1, Client(n2.grpc_url) as c2:
            infos = await asyncio.gather(
                c1.admin.register_schema("sensors", variant(f"a{round_}")),
                c2.admin.register_schema("sensors", variant(f"b{round_}")))
            return [info.version for info in infos]

    numbers = [number for round_ in range(4) for number in asyncio.run(at_once(round_))]
    assert sorted(numbers) == list(range(1, 9)), numbers
    wait_for(lambda: versions_on(n1) == versions_on(n2) == list(range(1, 9)), timeout=30)

    async def fields() -> set[str]:
        async with Client(n2.grpc_url) as client:
            return {name for info in await client.admin.schemas("sensors")
                    for name in json.loads(info.definition)["properties"]} - {"device"}

    assert asyncio.run(fields()) == {f"{side}{round_}" for side in "ab" for round_ in range(4)}


def test_a_configured_schema_file_is_registered_after_the_versions_etcd_holds(
    cluster: Callable[..., list[ClusterNodeProcess]], tmp_path: Path,
) -> None:
    """A node starting with `schema_file` registers it through the same compare-and-set as
    the gRPC Admin service, once joined: after the version another node registered, not
    over it (before, etcd's versions replaced the file's at the join, which was lost)."""
    (n1,) = cluster(1, extra_config=STREAMS)
    assert register(n1, REQUIRED) == 1
    schema_file = tmp_path / "widened.json"
    schema_file.write_text(json.dumps(WIDENED))
    (n2,) = cluster(1, first=2, extra_config=STREAMS + f'schema_file = "{schema_file}"\n')
    wait_for(lambda: versions_on(n2) == [1, 2], timeout=30)
    wait_for(lambda: versions_on(n1) == [1, 2], timeout=30)
    assert pubacks(n1, [b'{"device": "d1", "temp": 3, "site": 7}']) == [0x99]
