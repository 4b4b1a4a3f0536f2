"""Whether a topic's reliable shard already holds a message: the question a node asks before it
publishes again what a node that died may have published already (a will its claimer died
after publishing, a delayed message its holder died after releasing); and the last message on
a topic since a time (a replicated state record, `state_log.py`).

The shard is read from its owner's journal from the first record at or after a time: here
when this node owns it, else through the owner's shard reader (`state_rpc.read_shard`, the
records of that topic only). A non-reliable shard keeps no journal: the answer is then
"cannot tell" (None), and the caller publishes again (at least once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.message import Message
from ..core.records import decode_to_message

if TYPE_CHECKING:
    from ..core.broker import Broker
    from .control import ClusterNode

# Records read at a time.
SEARCH_BATCH = 512


class ShardUnreadable(Exception):
    """The shard's owner is not live or did not answer: ask again later."""


async def shard_holds(node: ClusterNode, broker: Broker, topic: str, since_ms: int,
                      match: Callable[[Message], bool], timeout_s: float = 5.0) -> bool | None:
    """Whether the reliable shard of `topic` holds a message on `topic`, published at or after
    `since_ms` (by the journal's time index), for which `match` is true. None when it cannot be
    known (a non-reliable stream); raises ShardUnreadable when its owner cannot be read now."""
    found: list[Message] = []

    def matched(message: Message) -> bool:
        if match(message):
            found.append(message)
            return True
        return False

    read = await _search(node, broker, topic, since_ms, matched, timeout_s)
    return None if read is None else bool(found)


async def latest_on_topic(node: ClusterNode, broker: Broker, topic: str, since_ms: int,
                          timeout_s: float = 5.0, *, settled: bool = False) -> Message | None:
    """The last message on `topic` that its reliable shard holds from `since_ms` on (the
    shard is read to its committed end); None when there is none or the stream is not
    reliable. Raises ShardUnreadable when the shard's owner cannot be read now, and, with
    `settled`, while a replicated shard's new leader has not yet committed all that earlier
    epochs held (its high watermark below the end it started its epoch with: a record its
    previous leader acknowledged may still be above it)."""
    last: list[Message] = []

    def keep(message: Message) -> bool:
        last[:] = [message]
        return False

    await _search(node, broker, topic, since_ms, keep, timeout_s, settled=settled)
    return last[0] if last else None


async def _search(node: ClusterNode, broker: Broker, topic: str, since_ms: int,
                  match: Callable[[Message], bool], timeout_s: float, *,
                  settled: bool = False) -> bool | None:
    """Reads the messages on `topic` of its reliable shard from `since_ms` on, in order,
    until `match` is true for one (True) or the committed end (False); None for a shard that
    keeps no journal. Raises ShardUnreadable (`settled`: see `latest_on_topic`)."""
    stream = broker.stream_for_topic(topic)
    if not stream.reliable:
        return None
    name, index = stream.config.name, stream.shard_for(topic, None).index

    def found(data: bytes) -> bool:
        try:
            message = decode_to_message(data)
        except ValueError:
            return False
        return message.topic == topic and match(message)

    assignment = node.view.leader(name, index)
    if assignment is None or assignment.leader not in node.view.nodes():
        raise ShardUnreadable(f"{name}/{index} has no live owner")
    if assignment.leader == node.node_id:
        shard_log = broker.streams[name].shards[index].log
        if shard_log is None:
            return None
        if settled and not getattr(shard_log, "settled", True):
            raise ShardUnreadable(f"{name}/{index}: its new leader has not settled yet")
        position = shard_log.offset_for_timestamp(since_ms)
        while batch := shard_log.read(position, SEARCH_BATCH):
            if any(found(record.data) for record in batch):
                return True
            position = batch[-1].offset + 1
        return False
    rpc = node.state_rpc
    if rpc is None:
        raise ShardUnreadable(f"{name}/{index}: this node cannot call its peers yet")
    position = 0
    while True:
        request = {"stream": name, "shard": index, "from": position, "since_ms": since_ms,
                   "max": SEARCH_BATCH, "filters": [topic], "node": node.node_id}
        try:
            header, records = await rpc.read_shard(assignment.leader, request, timeout_s)
        except Exception as exc:  # noqa: BLE001 - a link down, a timeout: asked again later
            raise ShardUnreadable(f"{name}/{index} on {assignment.leader}: {exc}") from exc
        if "error" in header:
            raise ShardUnreadable(f"{name}/{index} on {assignment.leader}: {header['error']}")
        if any(found(record.data) for record in records):
            return True
        if header.get("caught_up"):
            if settled and not header.get("settled", True):
                raise ShardUnreadable(f"{name}/{index} on {assignment.leader}: its new leader "
                                      "has not settled yet")
            return False
        position = int(header["next"])
