"""Retained messages and the broker's internal state (`$internal/` topics: protocol state such
as AMQP's durable topology, registered schemas): kept, cleared, told to the store and, for
retained messages, to the cluster.
"""

from __future__ import annotations

from collections.abc import Callable

from .message import Message
from .retained import RetainedStore
from .store_ports import PortSlot, StateKeeper

INTERNAL_PREFIX = "$internal/"
# The producer protocol of the records the broker itself publishes under `$internal/` (a
# cluster's replicated internal state, `shardgate/cluster/state_log.py`): the only messages on
# those topics the broker stores; a client's publish there is refused.
INTERNAL_PRODUCER = "internal"


class KeptState:
    """The kept state part of `Broker` (`core/broker.py`), which holds the state."""

    _cluster_retained: Callable[[str, Message | None], None] | None
    internal_state: dict[str, Message]
    keeper: PortSlot[StateKeeper]
    retained: RetainedStore[Message]

    def keep_internal(self, message: Message) -> None:
        """Keep `message` as internal state under its topic (which must start with
        `$internal/`); an empty payload removes it. Persisted by the keeper (`retained_changed`)."""
        if not message.topic.startswith(INTERNAL_PREFIX):
            raise ValueError(f"internal state lives under {INTERNAL_PREFIX}, not {message.topic!r}")
        if message.payload:
            self.internal_state[message.topic] = message
        elif self.internal_state.pop(message.topic, None) is None:
            return
        if (keeper := self.keeper.current) is not None:
            keeper.retained_changed(message.topic, message if message.payload else None)

    def restore_internal(self, topic: str, message: Message) -> None:
        """Internal state read back from the store at start (the keeper is not told)."""
        self.internal_state[topic] = message

    def forget_retained(self, topic: str) -> None:
        """Remove the retained message of `topic`, if any (its store is told)."""
        self._retain(Message(topic, b""))

    def _retain(self, message: Message) -> None:
        if message.payload:
            self.retained.set(message.topic, message)
            changed: Message | None = message
        else:
            if not self.retained.delete(message.topic):
                return
            changed = None
        if (keeper := self.keeper.current) is not None:
            keeper.retained_changed(message.topic, changed)
        if self._cluster_retained is not None:
            self._cluster_retained(message.topic, changed)

    def retain_from_peer(self, topic: str, message: Message | None) -> None:
        """Cluster mode: another node set (or cleared, None) the retained message of `topic`;
        kept here and stored, not told back to the cluster."""
        if message is not None:
            self.retained.set(topic, message)
        elif not self.retained.delete(topic):
            return
        if (keeper := self.keeper.current) is not None:
            keeper.retained_changed(topic, message)
