"""The session registry's claims (`cluster/session_registry.py`) decided from the cached view,
against an in-process store that answers as etcd would: a claim compares on the claim it
knows, and one that loses is made again on top of the winner's. (The transaction itself is
`test_control_store.py`'s, on a real etcd.)"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from shardgate.cluster import keys
from shardgate.cluster.control_store import ClaimOutcome
from shardgate.cluster.etcd import EtcdError, KeyValue
from shardgate.cluster.etcd_view import EtcdClusterView
from shardgate.cluster.session_registry import ClaimRefused, SessionMovedOn, SessionRegistry

KEY = "/shardgate/t/sessions/c"


class OneKeyStore:
    """One registry entry kept as etcd keeps it: a value and its modification revision."""

    def __init__(self) -> None:
        self.revision = 10
        self.entry: keys.SessionEntry | None = None
        self.entry_revision = 0
        self.claims = 0

    def other_node_claims(self, node: str, owner: str | None = None) -> None:
        self.revision += 1
        self.entry, self.entry_revision = keys.SessionEntry(node, owner, owner is not None), self.revision

    async def get(self, full_key: str) -> KeyValue | None:
        return None

    async def claim_session(self, client_id: str, entry: keys.SessionEntry, lease: int, *,
                            known_revision: int, also_read: Sequence[str] = (),
                            snapshot: tuple[str, int] | None = None) -> ClaimOutcome:
        self.claims += 1
        self.revision += 1
        if known_revision != self.entry_revision:
            current = None if self.entry is None else KeyValue(
                KEY, self.entry.to_json(), 1, self.entry_revision, 0)
            return ClaimOutcome(False, self.revision, [], current)
        self.entry, self.entry_revision = entry, self.revision
        return ClaimOutcome(True, self.revision, [[] for _ in also_read])


class Writes:
    def run_later(self, write: object) -> None:
        raise AssertionError("not used here")


def registry(store: OneKeyStore, node: str = "n1") -> tuple[SessionRegistry, EtcdClusterView]:
    view = EtcdClusterView(node)
    return SessionRegistry(store, view, node, lambda: 7, Writes()), view  # type: ignore[arg-type]


async def test_a_claim_that_loses_reads_the_winner_and_claims_on_top_of_it() -> None:
    store = OneKeyStore()
    store.other_node_claims("n2")  # a claim this node has not seen yet
    claims, view = registry(store)
    previous, _ = await claims.claim("c")
    assert previous == "n2"  # the holder the winning transaction replaced
    assert store.claims == 2 and store.entry == keys.SessionEntry("n1")
    assert view.sessions["c"] == "n1" and view.session_revision("c") == store.entry_revision


async def test_a_claim_refuses_another_users_session_and_changes_nothing() -> None:
    store = OneKeyStore()
    store.other_node_claims("n2", owner="alice")
    claims, view = registry(store)
    view.note_session("c", store.entry, store.entry_revision)
    with pytest.raises(ClaimRefused, match="another user"):
        await claims.claim("c", owner="bob", owned=True, refuse_other_user=True)
    assert store.claims == 0 and store.entry is not None and store.entry.node == "n2"


async def test_a_handover_claim_is_refused_once_the_session_moved_on() -> None:
    store = OneKeyStore()
    store.other_node_claims("n3")
    claims, view = registry(store)
    view.note_session("c", store.entry, store.entry_revision)
    with pytest.raises(SessionMovedOn):
        await claims.claim("c", held_by="n2")
    assert store.claims == 0


async def test_a_claim_beaten_every_time_gives_up_with_an_etcd_error() -> None:
    store = OneKeyStore()
    claims, _ = registry(store)

    async def always_beaten(client_id: str, entry: keys.SessionEntry, lease: int, *,
                            known_revision: int, also_read: Sequence[str] = (),
                            snapshot: tuple[str, int] | None = None) -> ClaimOutcome:
        store.claims += 1
        store.other_node_claims(f"n{store.claims + 1}")
        return ClaimOutcome(False, store.revision, [], KeyValue(
            KEY, keys.SessionEntry(f"n{store.claims + 1}").to_json(), 1, store.revision, 0))

    store.claim_session = always_beaten  # type: ignore[method-assign]
    with pytest.raises(EtcdError, match="claimed by other nodes"):
        await claims.claim("c")
