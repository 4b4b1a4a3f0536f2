"""AMQP reply codes and the adapter's exceptions.

Reply codes come from the AMQP 0-9-1 specification, §1.2 "Constants" (amqp0-9-1.xml). A
`ChannelException` closes only its channel (channel.close); a `ConnectionException` closes the
whole connection (connection.close). Both carry the class and method id of the offending method.
"""

from __future__ import annotations

from enum import IntEnum


class ReplyCode(IntEnum):
    SUCCESS = 200
    CONTENT_TOO_LARGE = 311  # soft (channel)
    NO_ROUTE = 312  # basic.return for mandatory publishes
    NO_CONSUMERS = 313
    CONNECTION_FORCED = 320  # hard (connection)
    INVALID_PATH = 402
    ACCESS_REFUSED = 403  # soft
    NOT_FOUND = 404  # soft
    RESOURCE_LOCKED = 405  # soft
    PRECONDITION_FAILED = 406  # soft
    FRAME_ERROR = 501  # hard
    SYNTAX_ERROR = 502  # hard
    COMMAND_INVALID = 503  # hard
    CHANNEL_ERROR = 504  # hard
    UNEXPECTED_FRAME = 505  # hard
    RESOURCE_ERROR = 506  # hard
    NOT_ALLOWED = 530  # hard
    NOT_IMPLEMENTED = 540  # hard
    INTERNAL_ERROR = 541  # hard


class AmqpError(Exception):
    """An AMQP exception: its reply code and text, and the method that caused it."""

    def __init__(self, code: ReplyCode, text: str, class_id: int = 0, method_id: int = 0) -> None:
        super().__init__(f"{code.name} - {text}")
        self.code = code
        self.text = text
        self.class_id = class_id
        self.method_id = method_id

    @property
    def reply_text(self) -> str:
        # RabbitMQ's style, e.g. "NOT_FOUND - no exchange 'x' in vhost '/'"; shortstr <= 255.
        return f"{self.code.name} - {self.text}"[:255]


class ChannelException(AmqpError):
    """Closes the channel the offending method came on."""


class ConnectionException(AmqpError):
    """Closes the connection."""
