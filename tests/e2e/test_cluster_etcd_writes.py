"""The etcd client's named writes (`EtcdClient.create`, `put_at`, `write`, `delete_unchanged`,
`replace_unchanged`), the only transactions the cluster's modules make outside the control
plane, against a real etcd: each writes exactly when its condition holds, in one transaction."""

from __future__ import annotations

from shardgate.cluster.etcd import EtcdClient
from tests.e2e.cluster_fixtures import EtcdServer


async def test_named_writes_hold_their_conditions(etcd: EtcdServer) -> None:
    client = EtcdClient([etcd.url])
    await client.connect()
    try:
        # create: only where nothing is; a refused create reads what is there
        assert await client.create("/t/a", b"1") == (True, None)
        created, current = await client.create("/t/a", b"2")
        assert not created and current is not None and current.value == b"1"
        # put_at / replace_unchanged: only at the revision read
        stale = current.mod_revision
        assert await client.replace_unchanged("/t/a", stale, b"3")
        assert not await client.replace_unchanged("/t/a", stale, b"4")
        written, now = await client.put_at("/t/a", stale, b"5")
        assert not written and now is not None and now.value == b"3"
        assert (await client.put_at("/t/a", now.mod_revision, b"6"))[0]
        # write: puts and deletes together, conditionally or not
        revision = await client.write([("/t/b", b"x"), ("/t/c", b"y")], deletes=["/t/a"])
        assert revision is not None
        assert await client.get("/t/a") is None
        b = await client.get("/t/b")
        assert b is not None and b.mod_revision == revision
        assert await client.write([("/t/d", b"z")], deletes=["/t/c"], if_at=("/t/b", revision - 1)) is None
        assert await client.get("/t/c") is not None and await client.get("/t/d") is None
        assert await client.write([("/t/d", b"z")], deletes=["/t/c"], if_at=("/t/b", revision)) is not None
        assert await client.get("/t/c") is None and await client.get("/t/d") is not None
        # delete_unchanged: only at the revision read
        d = await client.get("/t/d")
        assert d is not None
        assert not await client.delete_unchanged("/t/d", d.mod_revision - 1)
        assert await client.delete_unchanged("/t/d", d.mod_revision)
        assert await client.get("/t/d") is None
    finally:
        await client.close()
