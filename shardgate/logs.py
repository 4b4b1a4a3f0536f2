"""Logging set-up shared by the CLI and the connectors: Shardgate's own lines, and third-party
libraries kept quiet.

amqtt (with its `transitions` state machine) logs every state change at INFO and every failed
connection attempt as a WARNING; aiormq and aio-pika log an ERROR for each refused
reconnection. The bridges report the same events once, in Shardgate's words
(`ReconnectReport`), so those libraries only speak at `--log-level debug`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

# logger name -> the level it runs at unless Shardgate logs at debug
QUIET_LOGGERS = {
    "transitions": logging.WARNING,
    "amqtt": logging.ERROR,
    "aiormq": logging.CRITICAL,
    "aio_pika": logging.CRITICAL,
    "pamqp": logging.WARNING,
    "hpack": logging.WARNING,
    "fsspec": logging.WARNING,
    "botocore": logging.WARNING,
    "s3fs": logging.WARNING,
    # "server listening on ..." and "server closing": Shardgate says so itself for every listener
    "websockets.server": logging.WARNING,
}


# The attributes every LogRecord has: anything else on a record came in through `extra=` and
# is one of the line's structured fields.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: `ts` (ISO 8601, UTC, milliseconds), `level`, `logger`, `msg`,
    then the structured fields a call passed with `extra=` (`client_id`, `protocol`, `peer`,
    `reason`, ...), and `exc` with the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and not key.startswith("_"):
                line[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line)


def quiet_third_party_loggers(level: int) -> None:
    """Keep the libraries of `QUIET_LOGGERS` at their quiet level, unless `level` is DEBUG."""
    for name, quiet in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(logging.DEBUG if level <= logging.DEBUG else quiet)


class ReconnectReport:
    """Says once that a remote is unreachable (a warning), keeps later attempts at debug, and
    says when it is reachable again."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self.log = log
        self.what = what
        self.failures = 0

    def failed(self, error: BaseException, retry_max_s: float) -> None:
        self.failures += 1
        if self.failures == 1:
            self.log.warning("%s: cannot reach the remote (%s); retrying every few seconds (at "
                             "most %.0fs apart), messages wait meanwhile", self.what,
                             error or type(error).__name__, retry_max_s)
        else:
            self.log.debug("%s: attempt %d failed: %s", self.what, self.failures, error)

    def connected(self, where: str) -> None:
        if self.failures:
            self.log.info("%s: connected to %s after %d failed attempts", self.what, where, self.failures)
        else:
            self.log.info("%s: connected to %s", self.what, where)
        self.failures = 0

    def lost(self, error: BaseException) -> None:
        self.log.warning("%s: connection to the remote lost (%s); reconnecting", self.what,
                         error or type(error).__name__)


class DropReport:
    """Logs the messages a bridge drops, with the reason, without flooding: the first drop of
    each (direction, reason) at once as a WARNING naming the topic, then at most one line per
    `interval_s` with the count since the last line. Every drop is counted by its caller."""

    def __init__(self, log: logging.Logger, what: str, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.what = what
        self.interval_s = interval_s
        self.clock = clock
        # (direction, reason) -> (when the last line was written, drops not yet reported)
        self._pending: dict[tuple[str, str], tuple[float, int]] = {}

    def dropped(self, direction: str, reason: str, topic: str | None = None, detail: str = "") -> None:
        key = (direction, reason)
        now = self.clock()
        last = self._pending.get(key)
        if last is not None and now - last[0] < self.interval_s:
            self._pending[key] = (last[0], last[1] + 1)
            return
        count = 1 + (last[1] if last is not None else 0)
        self._pending[key] = (now, 0)
        about = f" on {topic!r}" if topic is not None else ""
        more = f" ({count} since the last report)" if count > 1 else ""
        self.log.warning("%s: dropped a message %s%s: %s%s%s", self.what,
                         "coming in" if direction == "in" else "going out", about, reason.replace("_", " "),
                         f" ({detail})" if detail else "", more,
                         extra={"event": "bridge_dropped", "direction": direction, "reason": reason})
