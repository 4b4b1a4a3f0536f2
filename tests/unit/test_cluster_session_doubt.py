"""A node whose takeover of an MQTT session failed after it claimed the session never tells
a peer there is no such session.

A CONNECT with clean start 0 claims the session in the registry (etcd then names this node),
and when its last holder is gone, reads the QoS 2 state that holder replicated on the internal
state stream. When that stream cannot be read yet (its new leader has not settled after a
failover), the CONNECT is refused, to be tried again, and the client resumes elsewhere. That
node asks this one, which the registry names, to release the session: answering "no session"
gave the client a new, empty session, and every message its subscriptions held was lost (the
chaos bench at 3 replicas: "its session was gone at a resume"). It answers "in doubt" (the
asking node waits and asks again) and brings the session here in the background once the
state can be read, then hands it over as any holder does.

`SessionHandover` with stand-ins for what it calls: the registry claim, the snapshot read, the
internal state stream, and the adoption."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from shardgate.cluster import sessions as sessions_module
from shardgate.cluster.journal_search import ShardUnreadable
from shardgate.cluster.sessions import SessionHandover, SessionUnavailable


class Node:
    node_id = "n2"

    def __init__(self) -> None:
        self.view = SimpleNamespace(nodes=lambda: {"n2": None, "n3": None})
        self.claims = 0

    async def claim_session(self, client_id: str, **_kwargs: Any) -> tuple[str | None, list[Any]]:
        self.claims += 1
        # the registry named nobody (its holder left with its lease), then this node
        return (None if self.claims == 1 else "n2"), [[b"snapshot"]]


class StateLog:
    """The internal state stream: unreadable until `settled`."""

    def __init__(self) -> None:
        self.settled = False

    async def latest(self, client_id: str, since_ms: int) -> bytes | None:
        if not self.settled:
            raise ShardUnreadable("_internal.state/0: its new leader has not settled yet")
        return None


class Releaser:
    async def release(self, request: dict[str, Any]) -> dict[str, Any]:
        client_id = request["client_id"]
        return {"state": f"{client_id} as held here"} if client_id in held else {"state": None}


held: set[str] = set()


def handover() -> SessionHandover:
    made = SessionHandover.__new__(SessionHandover)
    made.node = Node()  # type: ignore[assignment]
    made.service = SimpleNamespace(  # type: ignore[assignment]
        sessions={}, settings=SimpleNamespace(session_takeover_by_other_user="allow"))
    made.snapshots = SimpleNamespace(  # type: ignore[assignment]
        key=lambda client_id: f"sessions/{client_id}",
        read=lambda client_id, kv: SimpleNamespace(taken_ms=1, client_id=client_id))
    made.state_log = StateLog()  # type: ignore[assignment]
    made.releaser = Releaser()  # type: ignore[assignment]
    made.resumed_from_log = 0
    made._adopting = {}
    made._in_doubt = {}
    made._settling = {}
    made._collecting = set()

    async def adopt(client_id: str, clean_start: bool, state: Any, stood_in: bool = False) -> None:
        made.service.sessions[client_id] = state
        held.add(client_id)

    made._adopt_taken = adopt  # type: ignore[method-assign]
    return made


async def test_a_refused_takeover_answers_in_doubt_then_brings_the_session_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sessions_module, "SETTLE_DOUBT_S", 10.0)
    held.clear()
    node = handover()
    with pytest.raises(SessionUnavailable, match="has not settled yet"):
        await node._take("c", False, None, owned=True)
    # a peer where the client resumes asks for it: not "no session"
    assert await node._release({"client_id": "c", "to": "n3"}) == {"in_doubt": True}
    node.state_log.settled = True  # type: ignore[attr-defined]
    deadline = asyncio.get_running_loop().time() + 5
    while "c" not in node.service.sessions:
        assert asyncio.get_running_loop().time() < deadline, "the session was not brought here"
        await asyncio.sleep(0.05)
    # here now: handed over to the peer as a holder does
    assert await node._release({"client_id": "c", "to": "n3"}) == {"state": "c as held here"}
    for task in list(node._settling.values()):
        task.cancel()
