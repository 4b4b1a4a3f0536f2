"""How far a replicated shard's leader has dispatched to every node: its **dispatched mark**,
told to its followers with each fetch answer (`ReplicaAnswer.dispatched_end`), as the high
watermark is.

A leader dispatches a record once it is committed: to its own subscribers, and pushed over the
peer link to each other node that wants it (`fanout.py`). A push reaches the peer's
subscribers when the peer answers the frame that carries it; if the leader dies first, the push
is lost with it. The mark is the offset below which every record of the shard was dispatched
here and each push of it answered by its node: a follower elected after the leader died hands
on (dispatches again) only from the mark it was last told (`replicated_shards.inherited_from`),
so nothing is lost, and only what the old leader dispatched after that mark may reach a live
subscriber twice.

It is found with checkpoints, taken at each fetch answer (`mark`): the offset the shard was
dispatched to (`PushFanout.dispatched`; the core dispatches a shard's messages in offset order)
and how many pushes each link had queued then (`PeerLink.pushes_queued`). Once each of those
links has settled that many (`PeerLink.pushes_settled`: answered in order, or given up with a
peer that went away), the checkpoint's offset is the mark: at once when no push is on its way,
else at a later fetch answer. A checkpoint taken while a stored message
waits for some node's routes (`unrouted.py`: pushed later, maybe) never counts. A link closed
since the checkpoint (its peer left the view) is not waited for: what it held was given up, as
at any node's departure.

A leadership starts at the mark its hand-on starts from (`begin`): records below it were
dispatched and delivered under the earlier leader, and this leader's own dispatching counts
from there (the shard's dispatched offset is forgotten as it begins). The marks are kept in
memory and, for a node started again, on disk (`dispatch_checkpoints.py`: written in the
background from `known` and from the marks told to this node as a follower, read back as "at
least this far").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Protocol

Key = tuple[str, int]

# At most this many checkpoints wait per shard (a peer that answers nothing for long): later
# ones are not taken meanwhile, so the mark only lags more.
MAX_CHECKPOINTS = 1_000


class PushCounts(Protocol):
    """A peer link's push counts (`peer_link.PeerLink`)."""

    @property
    def pushes_queued(self) -> int: ...

    @property
    def pushes_settled(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _Checkpoint:
    end: int | None  # the offset the shard was dispatched to (None: nothing yet this leadership)
    queued: tuple[tuple[str, PushCounts, int], ...]  # (peer, its link, pushes queued on it)
    counts: bool  # False: a message waited for some node's routes


@dataclass(slots=True)
class _Led:
    mark: int | None
    checkpoints: deque[_Checkpoint] = field(default_factory=deque)


class DispatchMarks:
    """The dispatched marks of the replicated shards this node leads (see the module
    docstring). `dispatched` is the fanout's offset per shard, `links` the peer links by
    node, `routes_pending` whether a stored message waits for some node's routes."""

    def __init__(self, dispatched: MutableMapping[Key, int], links: Mapping[str, PushCounts],
                 routes_pending: Callable[[], bool]) -> None:
        self._dispatched = dispatched
        self._links = links
        self._routes_pending = routes_pending
        self._led: dict[Key, _Led] = {}

    def begin(self, key: Key, start: int | None) -> None:
        """This node has just begun to lead the shard `key`, handing on from `start`: every
        record below it was dispatched and delivered before (None: this process dispatched
        the shard itself so far, as one replica; its own dispatching counts)."""
        if start is not None:
            self._dispatched.pop(key, None)
        self._led[key] = _Led(start)

    def end(self, key: Key) -> None:
        """This node no longer leads the shard."""
        self._led.pop(key, None)

    def mark(self, key: Key) -> int | None:
        """The shard's dispatched mark now (None: not known), after taking a checkpoint of
        now (it counts at once when no push is on its way)."""
        led = self._led.get(key)
        if led is None:
            return None
        checkpoints, links = led.checkpoints, self._links
        end = self._dispatched.get(key)
        last = checkpoints[-1] if checkpoints else None
        if (end is not None and (led.mark is None or end > led.mark)
                and len(checkpoints) < MAX_CHECKPOINTS
                and (last is None or last.end != end or not last.counts)):
            checkpoints.append(_Checkpoint(
                end, tuple((node, link, link.pushes_queued) for node, link in links.items()),
                not self._routes_pending()))
        while checkpoints:
            checkpoint = checkpoints[0]
            if not self._settled(checkpoint):
                break  # (a later one has at least as many pushes to wait for)
            checkpoints.popleft()
            if checkpoint.counts and checkpoint.end is not None and (
                    led.mark is None or checkpoint.end > led.mark):
                led.mark = checkpoint.end
        return led.mark

    def known(self, key: Key) -> int | None:
        """The shard's dispatched mark as last found (None: not known, or not led here),
        without taking a checkpoint."""
        led = self._led.get(key)
        return led.mark if led is not None else None

    def waiting(self, key: Key) -> bool:
        """Whether a checkpoint of the shard waits for pushes to be answered."""
        led = self._led.get(key)
        return led is not None and bool(led.checkpoints)

    def ready(self, key: Key) -> bool:
        """Whether the shard's oldest waiting checkpoint would count now (the mark moves at
        the next `mark`): the leader then answers its followers' parked fetches at once."""
        led = self._led.get(key)
        return led is not None and bool(led.checkpoints) and self._settled(led.checkpoints[0])

    def _settled(self, checkpoint: _Checkpoint) -> bool:
        """Whether every link of the checkpoint settled the pushes it had queued then (or is
        closed since); one that never counts is settled, as there is nothing to wait for."""
        links = self._links
        return not checkpoint.counts or all(
            link.pushes_settled >= queued for node, link, queued in checkpoint.queued
            if links.get(node) is link)
