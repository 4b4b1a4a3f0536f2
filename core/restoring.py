"""The one rule of every restore at start: a stored record that cannot be restored never stops
the broker. It is logged with what it was and set aside (skipped; it stays in the store, so
nothing is lost and an operator can look at it), and everything else is restored.

Every restore path (retained messages, durable subscriptions and their cursors, MQTT sessions,
delayed messages, AMQP topology, streams and routes) reports such a record through
`set_aside`, so the log always reads the same way: `cannot be restored, set aside`.
This module knows nothing of protocols or storage engines.
"""

from __future__ import annotations

import logging

# How much of a record a log line shows.
MAX_SHOWN = 500


def shown(record: object) -> str:
    """`record` as the log shows it: its repr, cut at MAX_SHOWN characters."""
    text = repr(record)
    if len(text) > MAX_SHOWN:
        return text[:MAX_SHOWN] + f"... ({len(text)} characters)"
    return text


def set_aside(log: logging.Logger, what: str, record: object, error: BaseException) -> None:
    """Log that `what` (e.g. "durable subscription 'amqp:/:q'") stored as `record` cannot
    be restored because of `error`, and is skipped. One ERROR line, no traceback: the record
    is the problem, not the code that read it."""
    log.error(
        "%s cannot be restored, set aside (%s: %s); stored as %s",
        what, type(error).__name__, error, shown(record),
    )
