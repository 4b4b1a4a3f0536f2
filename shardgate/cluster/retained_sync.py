"""Retained sync: the retained message of a topic is set or cleared by the owner of the topic's
shard, which tells every other node over its links; a new link gets the retained messages of
the shards this node owns. Every node thus answers a new subscription with the retained
messages of the whole cluster from its own copy.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..proto import cluster_pb2 as pb
from .frames import RecordFormatError, body_of, message_from_push, push_frame

if TYPE_CHECKING:
    from ..core.message import Message
    from .data_plane import DataPlane

log = logging.getLogger(__name__)

# Topics whose retained state is the node's own: its $SYS topics, its internal state.
NODE_LOCAL_TOPICS = ("$SYS/", "$internal/")


class RetainedSync:
    """Sends this node's retained changes to its peers and applies theirs (one per data
    plane)."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.links = plane.links

    def changed(self, topic: str, message: Message | None) -> None:
        """A retained message was set or cleared here (the owner of its shard), and stored:
        tell every other node."""
        if topic.startswith(NODE_LOCAL_TOPICS):
            return
        update = retained_frame(topic, message)
        for link in self.links.values():
            link.send_retained(update)

    def snapshot(self) -> list[pb.Retained]:
        """The retained messages of the shards this node owns, for a new link."""
        broker = self.plane.broker
        owned = []
        for topic, message in broker.retained.items():
            if topic.startswith(NODE_LOCAL_TOPICS):
                continue
            stream = broker.stream_for_topic(topic)  # restored messages carry no shard
            if self.plane.view.leads(stream.name, stream.shard_for(topic, message.key).index):
                owned.append(retained_frame(topic, message))
        return owned

    def apply(self, updates: list[pb.Retained]) -> None:
        broker = self.plane.broker
        for update in updates:
            message: Message | None = None
            if update.present:
                try:
                    message = message_from_push(update.message)
                except RecordFormatError as exc:
                    log.warning("dropped a malformed retained message from a peer: %s", exc)
                    continue
                message.retain = True
            broker.retain_from_peer(update.topic, message)


def retained_frame(topic: str, message: Message | None) -> pb.Retained:
    if message is None:
        return pb.Retained(topic=topic, present=False)
    return pb.Retained(topic=topic, present=True, message=push_frame(message, body_of(message)))
