"""The owner check of a session claim whose holder is gone, against a real etcd (issue 26,
item 4 in a cluster): when the registry names no node for a session (its holder died and its
entry went with its lease), `ClusterNode.claim_session` judges the owner by the session's last
snapshot, and its transaction compares that snapshot's revision. A snapshot written between the
judgement and the claim (the dying holder's last one, naming alice) makes the claim look again
and refuse bob, instead of giving him alice's session.

The interleaving is made for real: the judgement the claim asks is wrapped so that, the first
time, another etcd client writes alice's snapshot right after it was read."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from aetcd import rpc

from shardgate.cluster import keys
from shardgate.cluster.control import ClaimRefused, ClusterNode
from shardgate.cluster.etcd import KeyValue
from shardgate.cluster.settings import ClusterSettings
from tests.e2e.cluster_fixtures import CLUSTER_SECRET, EtcdServer


def put_elsewhere(etcd: EtcdServer, key: str, value: bytes) -> None:
    """A write by another party (its own connection), while the claim waits for its answer."""
    with grpc.insecure_channel(f"127.0.0.1:{etcd.client_port}") as channel:
        rpc.KVStub(channel).Put(rpc.PutRequest(key=key.encode(), value=value), timeout=10)


def snapshot(owner: str) -> bytes:
    return json.dumps({"owner": owner}).encode()


def owner_is_not(username: str):  # type: ignore[no-untyped-def]
    def refuses(kv: KeyValue | None) -> bool:
        return kv is not None and json.loads(kv.value)["owner"] != username
    return refuses


async def joined_node(tmp_path: Path, etcd: EtcdServer) -> ClusterNode:
    settings = ClusterSettings(etcd=etcd.url, name="owners", lease_ttl_s=3, connect_timeout_s=5,
                               secret=CLUSTER_SECRET)
    node = ClusterNode(settings, "n2", tmp_path / "n2")
    await node.connect()
    await node.join("127.0.0.1:1", {})
    return node


async def test_a_snapshot_written_between_the_owner_check_and_the_claim_is_checked_again(
        tmp_path: Path, etcd: EtcdServer) -> None:
    node = await joined_node(tmp_path, etcd)
    try:
        state_key = node.settings.prefix.rstrip("/") + ".state/sessions/shared-id"
        judged: list[KeyValue | None] = []
        check = owner_is_not("bob")

        def racing(kv: KeyValue | None) -> bool:
            judged.append(kv)
            verdict = check(kv)
            if len(judged) == 1:  # no snapshot yet: bob may claim; then alice's lands
                put_elsewhere(etcd, state_key, snapshot("alice"))
            return verdict

        with pytest.raises(ClaimRefused, match="another user"):
            await node.claim_session("shared-id", also_read=[state_key], owner="bob",
                                     owned=True, refuse_other_user=True,
                                     vacant_refuses=(state_key, racing))
        assert judged[0] is None and judged[-1] is not None  # it looked again, and refused
        assert await node.client.get(node.key("sessions/shared-id")) is None  # nothing claimed
    finally:
        await node.stop()


async def test_a_vacant_session_is_claimed_by_its_owner_with_the_snapshot_read_in_the_claim(
        tmp_path: Path, etcd: EtcdServer) -> None:
    node = await joined_node(tmp_path, etcd)
    try:
        state_key = node.settings.prefix.rstrip("/") + ".state/sessions/alices"
        put_elsewhere(etcd, state_key, snapshot("alice"))
        with pytest.raises(ClaimRefused):
            await node.claim_session("alices", also_read=[state_key], owner="bob", owned=True,
                                     refuse_other_user=True,
                                     vacant_refuses=(state_key, owner_is_not("bob")))
        holder, reads = await node.claim_session(
            "alices", also_read=[state_key], owner="alice", owned=True, refuse_other_user=True,
            vacant_refuses=(state_key, owner_is_not("alice")))
        assert holder is None and json.loads(reads[0][0].value) == {"owner": "alice"}
        entry = await node.client.get(node.key("sessions/alices"))
        assert entry is not None and keys.SessionEntry.from_json(entry.value).owner == "alice"
    finally:
        await node.stop()
