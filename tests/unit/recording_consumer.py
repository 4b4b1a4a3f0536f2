"""A core consumer for durable-subscription tests: records what it is handed, holds up to
`window` messages unacknowledged (or acknowledges each at once with `auto_ack`)."""

from __future__ import annotations

from typing import Any

from shardgate.core.message import Message


class Consumer:
    def __init__(self, name: str, window: int = 1000, auto_ack: bool = False) -> None:
        self.consumer_id = name
        self.window = window
        self.connected = True
        self.auto_ack = auto_ack
        self.got: list[Message] = []
        self.unacked: list[tuple[object, Message]] = []

    @property
    def available(self) -> bool:
        return self.connected and len(self.unacked) < self.window

    def deliver(self, message: Message, subscription: Any, filters: Any) -> None:
        self.got.append(message)
        if self.auto_ack:
            subscription.ack(message)
        else:
            self.unacked.append((subscription, message))

    def ack_all(self) -> None:
        pending, self.unacked = self.unacked, []
        for subscription, message in pending:
            subscription.ack(message)
