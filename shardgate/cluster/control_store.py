"""The control plane's etcd state, behind one typed store: every read, write and transaction
the control plane (`control.py` and its parts) makes in etcd is a method here.

What is stored and how it is spelled is `keys.py`'s; what to write and when is the callers'
(the controller's decisions, the node's registration and leave, the session registry). This
module decides nothing: it turns one typed request into one etcd call and its answer into
typed values, so the decisions can be tested without etcd and the transactions against it
(`tests/e2e/test_control_store.py`).

The transactions:
- a registration, created only where no key is (`register`), or taken over from a stale key
  of the same node only while that key is unchanged (`take_over_registration`);
- the controller's election: `controller` created under the campaigner's lease (`campaign`);
- a drain's quiesce requests (`write_quiesce_requests`), compared on the election;
- placement (`write_placement`): each transaction compares the controller's election (the
  `controller` key's create revision) and the `placement-guard` revision the writer last
  saw, and bumps the guard, so a deposed controller's write, or one made from a stale view,
  fails; the in-sync set proposals it answers are deleted in the same transaction, each
  compared on its revision (one made again since stays for the next pass);
- a session registry claim (`claim_session`), compared on the revision of the claim the
  node knows (and, for a vacant entry, on the session snapshot's revision), reading the
  winner's entry when it fails; a release (`release_session`) compared on the claim's revision.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import keys
from .etcd import (
    EtcdClient,
    KeyValue,
    WatchEvent,
    create_revision_is,
    delete_op,
    get_op,
    mod_revision_is,
    put_op,
    version_is,
)
from .placement import ShardPlacement
from .replica_leader import IsrProposal

# etcd allows 128 operations per transaction by default; the guard takes one
MAX_TXN_OPS = 100
# in-sync set proposals answered per placement write (each one compare and one delete)
MAX_ANSWERED = 20


@dataclass(frozen=True, slots=True)
class HeldRegistration:
    """The registration found at a node's key when creating it failed."""

    registration: keys.NodeRegistration
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class AnsweredProposal:
    """An in-sync set proposal the controller answered, at the revision it read it."""

    stream: str
    shard: int
    revision: int


@dataclass(frozen=True, slots=True)
class PlacementChange:
    """One controller pass's placement write: the streams whose shards change (`put`), the
    streams gone (`removed`), the proposals answered, and what the write compares on."""

    controller: str
    controller_revision: int
    guard_revision: int
    put: Mapping[str, Sequence[ShardPlacement]]
    removed: Sequence[str] = ()
    answered: Sequence[AnsweredProposal] = ()


@dataclass(frozen=True, slots=True)
class PlacementWritten:
    """What a placement write did: `guard_revision` the guard's revision after the last
    transaction that succeeded (the one compared on before, when none did); `complete` when
    every transaction succeeded; `answered` the proposals deleted."""

    guard_revision: int
    complete: bool
    answered: tuple[AnsweredProposal, ...]


@dataclass(frozen=True, slots=True)
class ClaimOutcome:
    """A session claim's transaction: when it `succeeded`, at `revision`, with the values of
    the keys it was asked to read; when it failed, the registry entry that beat it (`current`,
    None when there is none, at `revision`)."""

    succeeded: bool
    revision: int
    reads: list[list[KeyValue]]
    current: KeyValue | None = None


def encode_placement(shards: Iterable[ShardPlacement]) -> bytes:
    return keys.encode({"shards": [placed.to_json() for placed in shards]})


def decode_placement(value: bytes) -> list[ShardPlacement]:
    return [ShardPlacement.from_json(shard) for shard in keys.decode(value)["shards"]]


def encode_proposal(proposal: IsrProposal) -> bytes:
    data = {"leader": proposal.leader, "leader_epoch": proposal.leader_epoch,
            "isr_version": proposal.isr_version, "isr": sorted(proposal.isr)}
    if proposal.gives_up:
        data["gives_up"] = True
    return keys.encode(data)


def decode_proposal(value: bytes) -> IsrProposal:
    data = keys.decode(value)
    return IsrProposal(str(data["leader"]), int(data["leader_epoch"]), int(data["isr_version"]),
                       frozenset(map(str, data["isr"])), bool(data.get("gives_up", False)))


class ControlStore:
    """The control plane's keys under the cluster prefix, on one etcd client."""

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def key(self, suffix: str) -> str:
        return self.prefix + suffix

    # ---------------------------------------------------------------- the whole prefix
    async def read_all(self) -> tuple[list[KeyValue], int]:
        """Every key under the prefix, and the revision they were read at."""
        return await self.client.get_prefix(self.prefix)

    async def latest_modification(self) -> int:
        """The highest revision a key under the prefix was changed at (a watch's check)."""
        return await self.client.latest_modification(self.prefix)

    def watch(self, start_revision: int) -> AsyncGenerator[list[WatchEvent], None]:
        """Every change under the prefix from `start_revision` on (see `EtcdClient.watch_prefix`)."""
        return self.client.watch_prefix(self.prefix, start_revision)

    async def get(self, full_key: str) -> KeyValue | None:
        """One key by its full name (the session snapshots live outside the prefix)."""
        return await self.client.get(full_key)

    # ---------------------------------------------------------------- plain writes
    async def put(self, suffix: str, value: bytes, lease: int = 0) -> int:
        """Write `suffix` (under `lease`, 0: none); the revision written."""
        return await self.client.put(self.key(suffix), value, lease)

    async def delete(self, suffix: str) -> bool:
        return await self.client.delete(self.key(suffix))

    async def declare_stream(self, name: str, definition: Mapping[str, Any]) -> bool:
        """Write a stream's definition unless the cluster has one; True when written."""
        written, _held = await self.client.create(self.key(keys.STREAMS + name),
                                                  keys.encode(definition))
        return written

    async def set_drain(self, node_id: str, since_ms: int) -> None:
        await self.put(keys.DRAIN + node_id, keys.encode({"since_ms": since_ms}))

    async def clear_drain(self, node_id: str) -> None:
        await self.delete(keys.DRAIN + node_id)

    async def write_quiesce_requests(self, controller_revision: int,
                                     put: Mapping[tuple[str, int], tuple[str, int]],
                                     removed: Iterable[tuple[str, int]], lease: int) -> bool:
        """The controller's requests that live leaders quiesce shards before a drain moves
        them: `put` (shard -> (leader, its epoch)) under the controller's `lease` (a deposed
        controller's requests go with it), `removed` deleted; each transaction compared on the
        controller's election. False when one failed (another controller won)."""
        ops = [put_op(self.key(f"{keys.QUIESCE}{stream}/{shard}"),
                      keys.encode({"leader": leader, "epoch": epoch}), lease)
               for (stream, shard), (leader, epoch) in put.items()]
        ops += [delete_op(self.key(f"{keys.QUIESCE}{stream}/{shard}")) for stream, shard in removed]
        for start in range(0, len(ops), MAX_TXN_OPS):
            result = await self.client.txn(
                [create_revision_is(self.key(keys.CONTROLLER), controller_revision)],
                ops[start:start + MAX_TXN_OPS])
            if not result.succeeded:
                return False
        return True

    # ---------------------------------------------------------------- leases and registration
    async def grant_lease(self, ttl: int) -> int:
        return await self.client.grant(ttl)

    async def revoke_lease(self, lease: int) -> None:
        await self.client.revoke(lease)

    async def register(self, registration: keys.NodeRegistration,
                       lease: int) -> tuple[bool, HeldRegistration | None]:
        """Create the node's key under `lease` unless it exists: (True, None) when created,
        else (False, the registration there, None when it went meanwhile)."""
        written, held = await self.client.create(self.key(keys.NODES + registration.node_id),
                                                 registration.to_json(), lease)
        if written or held is None:
            return written, None
        return False, HeldRegistration(keys.NodeRegistration.from_json(held.value),
                                       held.mod_revision, held.lease)

    async def take_over_registration(self, registration: keys.NodeRegistration, lease: int,
                                     held: HeldRegistration) -> bool:
        """Replace the node's stale key `held` (the same node's, before a restart) while it is
        unchanged; True when replaced."""
        return await self.client.replace_unchanged(
            self.key(keys.NODES + registration.node_id), held.mod_revision,
            registration.to_json(), lease)

    async def put_registration(self, registration: keys.NodeRegistration, lease: int) -> int:
        """Write the node's registration again (leaving, a new load); the revision written."""
        return await self.put(keys.NODES + registration.node_id, registration.to_json(), lease)

    # ---------------------------------------------------------------- controller
    async def campaign(self, node_id: str, lease: int) -> int | None:
        """Create `controller` naming `node_id` under `lease` unless a controller is elected;
        the election's revision when this node won, else None."""
        key = self.key(keys.CONTROLLER)
        result = await self.client.txn(
            [version_is(key, 0)], [put_op(key, keys.encode({"node_id": node_id}), lease)])
        return result.revision if result.succeeded else None

    async def write_placement(self, change: PlacementChange) -> PlacementWritten:
        """Write `change` in as few transactions as etcd takes (MAX_TXN_OPS writes each, the
        first also deleting up to MAX_ANSWERED answered proposals), each compared on the
        election and the guard's revision the previous one left, stopping at the first that
        fails (the writer's view was stale, or another controller won)."""
        ops = [put_op(self.key(keys.PLACEMENT + name), encode_placement(shards))
               for name, shards in change.put.items()]
        ops += [delete_op(self.key(keys.PLACEMENT + name)) for name in change.removed]
        answered = tuple(change.answered[:MAX_ANSWERED])
        chunks = [ops[start:start + MAX_TXN_OPS] for start in range(0, len(ops), MAX_TXN_OPS)]
        if answered and not chunks:
            chunks = [[]]
        guard = self.key(keys.PLACEMENT_GUARD)
        guard_value = keys.encode({"controller": change.controller})
        guard_revision = change.guard_revision
        deleted: tuple[AnsweredProposal, ...] = ()
        for number, chunk in enumerate(chunks):
            compares = [create_revision_is(self.key(keys.CONTROLLER), change.controller_revision),
                        mod_revision_is(guard, guard_revision)]
            if number == 0:
                proposal_keys = [(self._proposal_key(a), a.revision) for a in answered]
                compares += [mod_revision_is(key, revision) for key, revision in proposal_keys]
                chunk = chunk + [delete_op(key) for key, _ in proposal_keys]
            result = await self.client.txn(compares, [put_op(guard, guard_value), *chunk])
            if not result.succeeded:
                return PlacementWritten(guard_revision, False, deleted)
            guard_revision = result.revision
            if number == 0:
                deleted = answered
        return PlacementWritten(guard_revision, True, deleted)

    def _proposal_key(self, answered: AnsweredProposal) -> str:
        return self.key(f"{keys.ISR_PROPOSALS}{answered.stream}/{answered.shard}")

    # ---------------------------------------------------------------- session registry
    async def claim_session(self, client_id: str, entry: keys.SessionEntry, lease: int, *,
                            known_revision: int, also_read: Sequence[str] = (),
                            snapshot: tuple[str, int] | None = None) -> ClaimOutcome:
        """Put `entry` for `client_id` under `lease` only while the entry is at
        `known_revision` (0: none) and, with `snapshot` (a full key and its revision, 0:
        absent), while that key is unchanged too; reading `also_read` (full keys) in the same
        transaction. On failure the entry that is there is read instead."""
        key = self.key(keys.SESSIONS + client_id)
        compares = [mod_revision_is(key, known_revision)]
        if snapshot is not None:
            compares.append(mod_revision_is(*snapshot))
        result = await self.client.txn(
            compares, [*(get_op(read) for read in also_read), put_op(key, entry.to_json(), lease)],
            [get_op(key)])
        if result.succeeded:
            return ClaimOutcome(True, result.revision, result.reads)
        current = result.reads[0][0] if result.reads and result.reads[0] else None
        return ClaimOutcome(False, result.revision, [], current)

    async def release_session(self, client_id: str, claimed_revision: int) -> int | None:
        """Delete `client_id`'s entry only while it is still the claim at `claimed_revision`;
        the revision deleted at, or None when another claim came since."""
        key = self.key(keys.SESSIONS + client_id)
        return await self.client.write(deletes=[key], if_at=(key, claimed_revision))
