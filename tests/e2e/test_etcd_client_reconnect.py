"""The etcd client (`cluster/etcd.py`) when one call reconnects it while another is in flight,
against two real etcd servers: the call in flight must not end as a cancellation.

grpc.aio cancels every call of a channel it closes, and the caller sees CancelledError, the
exception a task's own cancellation raises, which no `except Exception` retry loop catches.
The node's watch health check ended so after an etcd restart, and with it the watch, and the
node's view of the cluster stayed stale for good (the chaos bench's hung rounds).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardgate.cluster import view_watch
from shardgate.cluster.control_store import ControlStore
from shardgate.cluster.etcd import EtcdClient, EtcdUnavailable
from shardgate.cluster.etcd_view import EtcdClusterView
from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import EtcdServer, running_etcd

PREFIX = "/shardgate/reconnect-test/"


@pytest.fixture
def two_etcds(tmp_path: Path) -> Iterator[tuple[EtcdServer, EtcdServer]]:
    with running_etcd(tmp_path / "a") as first, running_etcd(tmp_path / "b") as second:
        yield first, second


def freeze(server: EtcdServer) -> int:
    """SIGSTOP `server`, and wait until every thread of it has stopped (a signal reaches the
    threads of a process one by one: one still running could answer a call sent just after)."""
    assert server.proc is not None
    pid = server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: all(_state(task) in ("T", "t") for task in Path(f"/proc/{pid}/task").iterdir()),
             timeout=10)
    return pid


def _state(task: Path) -> str:
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "T"  # a thread that ended runs nothing


async def in_flight_on(client: EtcdClient, call: asyncio.Task[object] | None = None) -> None:
    """Wait until a unary call (`call`'s, when given) is on the client's channel (the
    channel's active calls: a watch stream's does not count)."""
    channel = client._channel
    deadline = time.monotonic() + 10
    while not any(type(active).__name__ == "UnaryUnaryCall"
                  for active in getattr(channel, "_active_calls", ())):
        assert call is None or not call.done(), call
        assert time.monotonic() < deadline, "no call reached the channel"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("kind", ["read", "write"])
async def test_a_call_in_flight_when_another_reconnects_the_client_is_not_cancelled(
        two_etcds: tuple[EtcdServer, EtcdServer], kind: str) -> None:
    first, second = two_etcds
    client = EtcdClient([first.url, second.url], timeout=30.0)
    await client.connect()
    assert client.endpoint == f"127.0.0.1:{first.client_port}"
    frozen = freeze(first)  # it takes the call and never answers
    try:
        if kind == "read":
            call: asyncio.Task[object] = asyncio.create_task(
                client.latest_modification(PREFIX))
        else:
            call = asyncio.create_task(client.put(PREFIX + "k", b"v"))
        await in_flight_on(client, call)
        await client.reconnect(client._channel)  # what a call that saw UNAVAILABLE does
        assert client.endpoint == f"127.0.0.1:{second.client_port}"
        if kind == "read":
            # a read is asked again on the new channel, and answered there
            assert await asyncio.wait_for(call, 20) == 0
        else:
            # a write may or may not have been applied: the caller is told etcd failed it
            with pytest.raises(EtcdUnavailable):
                await asyncio.wait_for(call, 20)
        # the task itself was never cancelled, and the client goes on answering
        await client.put(PREFIX + "after", b"1")
        assert await client.latest_modification(PREFIX) > 0
    finally:
        os.kill(frozen, signal.SIGCONT)
        await client.close()


async def test_a_cancelled_caller_is_still_cancelled(etcd: EtcdServer) -> None:
    """The client tells a closed channel from its caller's own cancellation: a cancelled
    call is cancelled, not turned into an etcd error."""
    client = EtcdClient([etcd.url], timeout=30.0)
    await client.connect()
    frozen = freeze(etcd)
    try:
        call = asyncio.create_task(client.latest_modification(PREFIX))
        await in_flight_on(client, call)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    finally:
        os.kill(frozen, signal.SIGCONT)
        await client.close()


async def test_the_view_watch_goes_on_when_the_client_reconnects_under_its_check(
        two_etcds: tuple[EtcdServer, EtcdServer], monkeypatch: pytest.MonkeyPatch) -> None:
    """The hung chaos rounds: the watch's health check, in flight when another caller's
    reconnect closed the channel, ended the watch with it, without a word; the node never
    saw another change (a restarted peer's new address, say) and the cluster never settled."""
    monkeypatch.setattr(view_watch, "WATCH_CHECK_S", 0.05)
    first, second = two_etcds
    client = EtcdClient([first.url, second.url], timeout=30.0)
    await client.connect()
    store = ControlStore(client, PREFIX)
    view = EtcdClusterView("n1")
    watch = view_watch.ViewWatch(store, view, "n1", running=lambda: True,
                                 pending_writes=lambda: 0, wake=lambda: None)
    kvs, revision = await store.read_all()
    view.load(PREFIX, kvs, revision)
    running = asyncio.create_task(watch.run(revision))
    frozen = freeze(first)
    try:
        await in_flight_on(client)  # the health check's read, which the frozen etcd holds
        await client.reconnect(client._channel)
        written = await client.put(PREFIX + "schemas/probe", b"{}")
        deadline = time.monotonic() + 20
        while view.revision < written:
            assert not running.done(), "the watch ended"
            assert time.monotonic() < deadline, "the view never saw the write"
            await asyncio.sleep(0.02)
    finally:
        os.kill(frozen, signal.SIGCONT)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await client.close()
