"""A drain's handshake on the leader's side: before the controller moves a replicated shard's
leadership off a live node (`shardgate cluster drain`), it asks that leader to quiesce the
shard (`quiesce/<stream>/<shard>`: the leader and its epoch, under the controller's lease;
`controller.py`, `replica_placement.py`). The leader does what a graceful leave does for every
shard it leads (`ReplicatedShards.quiesce`): the shard takes no more publishes (refused,
retryable; a forwarding node holds them for the next leader), what it holds commits, and it
waits, at most `QUIESCE_S`, until every in-sync follower said in a fetch that it knows the
high watermark this leader ends at. Then it answers (`quiesced/<stream>/<shard>`, under this
node's lease, naming the request's etcd revision: an answer to a request withdrawn and made
again since is no answer to the new one) and the controller moves the leadership: the
follower it elects hands on exactly what this leader never dispatched, so no subscriber gets
a message twice.

When the request goes (the controller moved the shard, or wants it moved no more: the drain
was cancelled, a follower fell out of sync), the shard takes publishes again here, if this
node still leads it in that epoch, and the answer is deleted. A request for an epoch this node
does not lead (yet) waits, within the same bound, for the replica manager to lead it. A node
that leaves quiesces every shard it leads itself (`ClusterNode.leave`) and reopens none.

It only reads the view and writes its answers through the node's ordered writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from . import keys

if TYPE_CHECKING:
    from .control import ClusterNode
    from .replicated_shards import ReplicatedShards

log = logging.getLogger(__name__)

ShardKey = tuple[str, int]
# at most how long the leader waits for its followers (as a graceful leave's `QUIESCE_S`;
# the controller waits `replica_placement.QUIESCE_WAIT_S` for the answer)
QUIESCE_S = 3.0
POLL_S = 0.01


class LeaderHandoff:
    """This node's answers to the controller's quiesce requests (see the module docstring)."""

    def __init__(self, node: ClusterNode, replicas: ReplicatedShards) -> None:
        self.node = node
        self.view = node.view
        self.replicas = replicas
        # the requests this node took up: shard -> ((epoch, the request's etcd revision),
        # the task quiescing it)
        self._taken: dict[ShardKey, tuple[tuple[int, int], asyncio.Task[None]]] = {}
        self._running = False

    def start(self) -> None:
        self._running = True
        self.view.on_change(self.sync)
        self.sync()

    def sync(self) -> None:
        """Take up the requests naming this node that are new; end those withdrawn."""
        if not self._running:
            return
        me = self.node.node_id
        asked = {key: (epoch, revision)
                 for key, (leader, epoch, revision) in self.view.quiesce_requests.items()
                 if leader == me}
        for key, (request, _task) in list(self._taken.items()):
            if asked.get(key) != request:  # withdrawn (and maybe made again since)
                self._withdrawn(key, request[0])
        for key, (epoch, revision) in asked.items():
            if key not in self._taken:
                task = asyncio.get_running_loop().create_task(
                    self._quiesce(key, epoch, revision), name=f"quiesce-{key[0]}/{key[1]}")
                self._taken[key] = ((epoch, revision), task)

    async def _quiesce(self, key: ShardKey, epoch: int, revision: int) -> None:
        stream, index = key
        loop = asyncio.get_running_loop()
        deadline = loop.time() + QUIESCE_S
        # the replica manager may not lead the requested epoch yet (the view came first)
        while self._led_epoch(key) < epoch and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        led = self._led_epoch(key)
        if led > epoch:
            return  # a newer leadership here: the controller asks again for it
        known = led == epoch and await self.replicas.quiesce(
            max(deadline - loop.time(), POLL_S), [key], why="drain")
        shard_log = self.replicas.manager.leading(stream, index)
        mark = shard_log.high_watermark if shard_log is not None else -1
        self.node.submit(f"{keys.QUIESCED}{stream}/{index}", keys.encode({
            "leader": self.node.node_id, "epoch": epoch, "asked": revision,
            "high_watermark": mark, "known": known}), under_lease=True)
        log.info("%s/%d: quiesced for the drain (epoch %d, high watermark %d%s)", stream, index,
                 epoch, mark, "" if known else ", not every follower said it knows it")

    def _led_epoch(self, key: ShardKey) -> int:
        """The epoch this node leads the shard in (-1: it does not)."""
        shard_log = self.replicas.manager.leading(*key)
        leader = shard_log.leader if shard_log is not None else None
        return leader.epoch if leader is not None else -1

    def _withdrawn(self, key: ShardKey, epoch: int) -> None:
        _request, task = self._taken.pop(key)
        task.cancel()
        placed = self.view.leader(*key)
        leading = (placed is not None and placed.leader == self.node.node_id
                   and placed.leader_epoch == epoch)
        self.replicas.reopen(*key, leading=leading)
        self.node.submit(f"{keys.QUIESCED}{key[0]}/{key[1]}", None)

    async def close(self) -> None:
        self._running = False
        tasks = [task for _epoch, task in self._taken.values()]
        self._taken.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
