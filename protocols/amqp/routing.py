"""How AMQP exchanges and bindings map onto core topic names and topic filters.

Every AMQP publish becomes one core message on one topic, so it goes through the core like any
other message (streams, shards, subscriptions) and AMQP queues are core subscriptions whose
filters are the queue's bindings. The mapping:

- `amq.topic` is shared with MQTT and gRPC, as RabbitMQ's MQTT plugin does it: the routing key
  `a.b.c` is the topic `a/b/c` (dots and slashes swap, so the MQTT topic `a.x/b` is the routing
  key `a/x.b`), a binding `*` is the filter level `+`, `#` stays `#`. A routing key is a
  plain name to AMQP, so `+` and `#` in a published key are escaped as `%2B` and `%23`: the key
  `w.#` is the topic `w/%23` (never a wildcard in an MQTT PUBLISH), and AMQP consumers get the
  key `w.#` back.
- Any other exchange `E` owns the reserved subtree `$amqp/E/`, which MQTT `#` subscriptions never
  see (topics starting with `$`). The default exchange is `$amqp/amq.default/<queue name>`.
  - direct and headers exchanges: `$amqp/E/<key>`, the key as one level (percent-escaped);
    a direct binding is the exact topic, a headers binding is `$amqp/E/#` plus header matching;
  - fanout: publish like direct, a binding is `$amqp/E/#`;
  - topic exchanges: `$amqp/E/<word>/<word>...` (each word percent-escaped), bindings converted
    as for `amq.topic`.
  Escaping (`%` `/` `+` `#` U+0000 as `%25` `%2F` `%2B` `%23` `%00`) keeps any routing key,
  exchange name and queue name a valid topic level: the exchange `dave-x/#` is the level
  `dave-x%2F%23`, so its topics stay inside `$amqp/dave-x%2F%23/` and an ACL granting
  `$amqp/dave-x/#` never covers them, and a queue or exchange name holding any character
  RabbitMQ accepts maps onto the core losslessly (`exchange_and_key` reverses it).
- A binding a topic filter cannot express exactly (a `#` that is not the last word, headers
  matching) is the widest filter that covers it plus a `Binding.accepts` check run by the queue.

Delivered messages get their exchange and routing key back from the topic (`exchange_and_key`).
This module does no I/O and knows nothing of connections.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...core.message import Message

AMQ_TOPIC = "amq.topic"
DEFAULT_EXCHANGE_TOPIC = "amq.default"
PREFIX = "$amqp/"

_SWAP = str.maketrans("./", "/.")
# What the topic layer gives a meaning to or refuses (core/topics.py), and `%` itself.
_ESCAPES = {"%": "%25", "/": "%2F", "+": "%2B", "#": "%23", "\x00": "%00"}
_UNESCAPES = {v: k for k, v in _ESCAPES.items()}


def escape(word: str) -> str:
    """One topic level holding `word` (a routing key word, an exchange or queue name) as it
    is: never a wildcard, never a separator, never a character a topic may not hold."""
    if (
        "%" not in word and "/" not in word and "+" not in word and "#" not in word
        and "\x00" not in word
    ):
        return word
    return "".join(_ESCAPES.get(c, c) for c in word)


def unescape(level: str) -> str:
    """The word `escape` made `level` of (a `%` not starting an escape stays as it is)."""
    if "%" not in level:
        return level
    parts = level.split("%")
    out = [parts[0]]
    for part in parts[1:]:
        original = _UNESCAPES.get("%" + part[:2])
        out.append(original + part[2:] if original is not None else "%" + part)
    return "".join(out)


def exchange_level(exchange: str) -> str:
    """The topic level of exchange `exchange` under `$amqp/` (the default exchange's is
    `amq.default`)."""
    return escape(exchange) if exchange else DEFAULT_EXCHANGE_TOPIC


def topic_for_routing_key(routing_key: str) -> str:
    """The core topic of an `amq.topic` routing key (RabbitMQ's MQTT convention: `.` and `/`
    swap; a `+` or `#` in the key is escaped, never a wildcard in a topic name)."""
    topic = routing_key.translate(_SWAP)
    if "+" in topic or "#" in topic or "\x00" in topic:
        topic = topic.replace("+", "%2B").replace("#", "%23").replace("\x00", "%00")
    return topic


def routing_key_for_topic(topic: str) -> str:
    """The `amq.topic` routing key of a core topic: the inverse of `topic_for_routing_key`."""
    key = topic.translate(_SWAP)
    if "%2" in key or "%00" in key:
        key = key.replace("%2B", "+").replace("%23", "#").replace("%00", "\x00")
    return key


def publish_topic(exchange: str, exchange_type: str, routing_key: str) -> str:
    """The core topic a message published to `exchange` with `routing_key` goes to."""
    if exchange == AMQ_TOPIC:
        return topic_for_routing_key(routing_key)
    name = exchange_level(exchange)
    if exchange_type == "topic":
        return PREFIX + name + "/" + "/".join(escape(w) for w in routing_key.split("."))
    return PREFIX + name + "/" + escape(routing_key)


def exchange_filter(exchange: str) -> str:
    """The filter of every topic exchange `exchange` publishes to."""
    return PREFIX + exchange_level(exchange) + "/#"


def queue_topic(queue: str) -> str:
    """The topic of the default exchange's implicit binding of `queue`."""
    return PREFIX + DEFAULT_EXCHANGE_TOPIC + "/" + escape(queue)


def exchange_and_key(topic: str) -> tuple[str, str]:
    """(exchange, routing key) a delivered message reports for its core topic."""
    if not topic.startswith(PREFIX):
        return AMQ_TOPIC, routing_key_for_topic(topic)
    rest = topic[len(PREFIX):]
    name, _, key = rest.partition("/")
    name = "" if name == DEFAULT_EXCHANGE_TOPIC else unescape(name)
    return name, ".".join(unescape(level) for level in key.split("/"))


HeaderCheck = Callable[[Message], bool]


@dataclass(slots=True)
class Binding:
    """One queue binding: its core filter and, when the filter is wider, the exact check."""

    exchange: str
    routing_key: str
    arguments: tuple[tuple[str, str], ...]
    topic_filter: str
    check: HeaderCheck | None = None

    def accepts(self, message: Message) -> bool:
        return self.check is None or self.check(message)


def binding_for(
    exchange: str, exchange_type: str, routing_key: str, arguments: dict[str, Any] | None
) -> Binding:
    """Translate an AMQP binding into a core topic filter (and a check if needed)."""
    args = tuple(sorted((str(k), header_value(v)) for k, v in (arguments or {}).items()))
    if exchange_type == "fanout":
        return Binding(exchange, routing_key, args, exchange_filter(exchange))
    if exchange_type == "headers":
        return Binding(
            exchange, routing_key, args, exchange_filter(exchange), headers_check(arguments or {})
        )
    if exchange_type == "direct":
        return Binding(exchange, routing_key, args, publish_topic(exchange, "direct", routing_key))
    # topic
    words = routing_key.split(".")
    prefix = "" if exchange == AMQ_TOPIC else PREFIX + exchange_level(exchange) + "/"
    check: HeaderCheck | None = None
    if "#" in words[:-1]:
        # A '#' before the end: filter on the words before it, check the whole pattern.
        cut = words.index("#")
        words = words[: cut + 1]
        pattern = routing_key.split(".")
        check = _topic_check(exchange, pattern)
    levels = []
    for word in words:
        if word == "*":
            levels.append("+")
        elif word == "#":
            levels.append("#")
        elif exchange == AMQ_TOPIC:
            levels.append(topic_for_routing_key(word))  # one word: no `.` in it
        else:
            levels.append(escape(word))
    return Binding(exchange, routing_key, args, prefix + "/".join(levels), check)


def topic_matches(pattern: Sequence[str], words: Sequence[str]) -> bool:
    """AMQP topic matching: `*` is one word, `#` zero or more."""
    if not pattern:
        return not words
    head = pattern[0]
    if head == "#":
        return any(topic_matches(pattern[1:], words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    if head != "*" and head != words[0]:
        return False
    return topic_matches(pattern[1:], words[1:])


def _topic_check(exchange: str, pattern: list[str]) -> HeaderCheck:
    def check(message: Message) -> bool:
        _, key = exchange_and_key(message.topic)
        return topic_matches(pattern, key.split("."))

    return check


def header_value(value: Any) -> str:
    """An AMQP field value as the string a core header carries."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    if value is None:
        return ""
    return str(value)


def _typed(value: Any) -> tuple[str, Any]:
    """A field value with its type class as rabbit_misc:type_class/1 sees it: every integer
    width is one class, float and double another, and values of different classes never
    match (the long 1 is not the string "1", nor true)."""
    if isinstance(value, bool):
        return "bool", value
    if isinstance(value, int):
        return "int", value
    if isinstance(value, float):
        return "float", value
    if isinstance(value, bytes | bytearray):
        return "binary", bytes(value)
    if isinstance(value, str):
        return "binary", value.encode()
    return type(value).__name__, value


def _amqp_headers(message: Message) -> dict[str, Any] | None:
    """The typed header table `message` was published with over AMQP, None if it came from
    another protocol."""
    native = message.native_properties
    raw = native.get("amqp-0-9-1") if native else None
    if raw is None:
        return None
    from .properties import decode_properties  # properties imports this module

    return dict(decode_properties(raw).headers or {})


def headers_check(arguments: dict[str, Any]) -> HeaderCheck:
    """The headers exchange rule for `arguments` (x-match all/any/all-with-x/any-with-x), as
    rabbit_exchange_type_headers matches: a void argument asks only for the header's presence,
    any other must equal the header in value and type class."""
    mode = header_value(arguments.get("x-match", "all"))
    with_x = mode.endswith("-with-x")
    chosen = {
        str(k): v for k, v in arguments.items()
        if k != "x-match" and (with_x or not str(k).startswith("x-"))
    }
    wanted = {k: (None if v is None else header_value(v)) for k, v in chosen.items()}
    wanted_typed = {k: (None if v is None else _typed(v)) for k, v in chosen.items()}
    match_any = mode.startswith("any")

    def check(message: Message) -> bool:
        typed = _amqp_headers(message)
        if typed is not None:
            results = (
                name in typed and (value is None or _typed(typed[name]) == value)
                for name, value in wanted_typed.items()
            )
        else:
            have = dict(message.headers or ())
            results = (
                name in have and (value is None or have[name] == value)
                for name, value in wanted.items()
            )
        return any(results) if match_any else all(results)

    return check


def hop_check(exchange_type: str, routing_key: str, arguments: dict[str, Any] | None) -> HeaderCheck | None:
    """Whether a message passes one binding of an exchange of `exchange_type` that it reaches
    through exchange-to-exchange bindings. The routing key does not change on the way, so it
    is the key the message was published with (recovered from its topic); None: always."""
    if exchange_type == "fanout":
        return None
    if exchange_type == "headers":
        return headers_check(arguments or {})
    if exchange_type == "direct":
        def direct(message: Message) -> bool:
            return exchange_and_key(message.topic)[1] == routing_key

        return direct
    pattern = routing_key.split(".")

    def topic(message: Message) -> bool:
        return topic_matches(pattern, exchange_and_key(message.topic)[1].split("."))

    return topic


def all_of(checks: Sequence[HeaderCheck]) -> HeaderCheck | None:
    """One check that passes when every one of `checks` does (None when there are none)."""
    if not checks:
        return None
    if len(checks) == 1:
        return checks[0]

    def every(message: Message) -> bool:
        return all(check(message) for check in checks)

    return every
