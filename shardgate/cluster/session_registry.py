"""The MQTT session registry (`sessions/<client id>`: the node a client's session lives on,
and the user who made it), as this node claims and releases its entries.

Every kind of session is claimed through one etcd transaction compared on the revision of the
claim this node knows (`ControlStore.claim_session`); a claim that loses reads the winner's
entry in the same transaction and is made again on top of it. So claims are ordered by etcd:
the last one wins everywhere, and each node applies them by revision
(`EtcdClusterView.note_session`), which is how a takeover ends exactly the old connection.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from . import keys
from .control_store import ControlStore
from .etcd import EtcdError, KeyValue
from .etcd_view import EtcdClusterView
from .node_writes import NodeWrites

# a session claim that loses to other claims this many times in a row fails
CLAIM_ATTEMPTS = 5


class ClaimRefused(Exception):
    """A session claim refused: the registry names another user as the session's owner."""


class SessionMovedOn(Exception):
    """A claim `held_by` a node refused: the registry names another node (or none) now."""


class SessionRegistry:
    """This node's claims and releases of registry entries."""

    def __init__(self, store: ControlStore, view: EtcdClusterView, node_id: str,
                 lease: Callable[[], int], writes: NodeWrites) -> None:
        self._store = store
        self._view = view
        self._node_id = node_id
        self._lease = lease
        self._writes = writes

    async def claim(self, client_id: str, also_read: Sequence[str] = (), *,
                    owner: str | None = None, owned: bool = False,
                    refuse_other_user: bool = False,
                    vacant_refuses: tuple[str, Callable[[KeyValue | None], bool]] | None = None,
                    held_by: str | None = None,
                    ) -> tuple[str | None, list[list[KeyValue]]]:
        """Make the registry name this node for `client_id`, for any kind of session: one etcd
        transaction that puts the entry only if it is still the claim this node knows (compared
        on its revision); when another claim came first, what it wrote is read in the same
        transaction and the claim is made again on top of it. So claims are ordered by etcd:
        the last one wins everywhere, and each node applies them by revision (`note_session`).
        Returns the holder before this claim and the values of the etcd keys `also_read`
        (full keys), read in the transaction that won. The entry names `owner` as the user who
        made the session when `owned`. With `refuse_other_user`, a session the registry names
        another user for (at the revision the claim compares on) is not claimed:
        ClaimRefused is raised, and nothing changes anywhere. When the registry names no node
        (the holder is gone, its entry with its lease), `vacant_refuses` judges instead: the
        full key of the session's last snapshot and whether that snapshot is another user's.
        The snapshot is read before the transaction, which compares its revision as well, so
        a snapshot written between that judgement and the claim (the dying holder's last one)
        makes the claim look again rather than hand one user's session to another. With
        `held_by`, the claim is made only while the registry names that node (a leaving node's
        handover, which must not take a session its client resumed elsewhere meanwhile): else
        SessionMovedOn. Raises EtcdError when etcd fails or others keep claiming."""
        view = self._view
        entry = keys.SessionEntry(self._node_id, owner, owned)
        for _attempt in range(CLAIM_ATTEMPTS):
            known = view.session_revision(client_id)
            previous = view.sessions.get(client_id) if known else None
            held = view.session_entries.get(client_id) if known else None
            if refuse_other_user and held is not None and held.refuses(owner):
                raise ClaimRefused(f"client identifier {client_id!r} has a session of "
                                   f"another user (on {held.node})")
            if held_by is not None and previous != held_by:
                raise SessionMovedOn(f"the session of {client_id!r} is on {previous} now")
            snapshot_guard = None
            if refuse_other_user and vacant_refuses is not None and previous is None:
                snapshot_key, refuses = vacant_refuses
                snapshot = await self._store.get(snapshot_key)
                if refuses(snapshot):
                    raise ClaimRefused(f"client identifier {client_id!r} has a session of "
                                       "another user (its holder is gone)")
                snapshot_guard = (snapshot_key, 0 if snapshot is None else snapshot.mod_revision)
            outcome = await self._store.claim_session(
                client_id, entry, self._lease(), known_revision=known, also_read=also_read,
                snapshot=snapshot_guard)
            if outcome.succeeded:
                view.note_session(client_id, entry, outcome.revision)
                return previous, outcome.reads
            current = outcome.current
            if current is not None:
                view.note_session(client_id, keys.SessionEntry.from_json(current.value),
                                  current.mod_revision)
            else:
                view.note_session(client_id, None, outcome.revision)
        raise EtcdError(f"the session of {client_id!r} was claimed by other nodes "
                        f"{CLAIM_ATTEMPTS} times in a row")

    def claim_soon(self, client_id: str, owner: str | None = None, owned: bool = False) -> None:
        """A session opened here without a claim (the client's session was here already, or
        was made by another user here): claim it in the background unless the registry names
        this node and this owner already."""
        entry = keys.SessionEntry(self._node_id, owner, owned)
        if self._view.session_entries.get(client_id) == entry:
            return
        self._writes.run_later(functools.partial(self._claim_in_background, entry, client_id))

    async def _claim_in_background(self, entry: keys.SessionEntry, client_id: str) -> None:
        if self._view.session_entries.get(client_id) != entry:
            await self.claim(client_id, owner=entry.owner, owned=entry.owned)

    def release(self, client_id: str) -> None:
        """The client's session ended here: drop its registry entry, in the background, only
        if it is still this node's claim (a claim made since on another node stays)."""
        if self._view.sessions.get(client_id) == self._node_id:
            self._writes.run_later(functools.partial(
                self._release, client_id, self._view.session_revision(client_id)))

    async def _release(self, client_id: str, claimed: int) -> None:
        deleted = await self._store.release_session(client_id, claimed)
        if deleted is not None:
            self._view.note_session(client_id, None, deleted)
