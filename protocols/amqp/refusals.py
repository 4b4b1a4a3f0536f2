"""The errors of a refused AMQP operation, with RabbitMQ's reply texts: a channel exception
for a frame's method, and how a redeclared argument differs (type names and values as
RabbitMQ prints them). Texts only: the checks are where the operations are.
"""

from __future__ import annotations

from typing import Any

from pamqp import commands, encode

from .errors import ChannelException, ReplyCode
from .frames import method_ids

# AMQP field-table type names as RabbitMQ prints them, by pamqp's type octet.
_FIELD_TYPES = {
    "b": "byte", "B": "unsignedbyte", "s": "short", "u": "unsignedshort", "I": "signedint",
    "i": "unsignedint", "l": "long", "f": "float", "d": "double", "D": "decimal",
    "S": "longstr", "t": "bool", "T": "timestamp", "F": "table", "A": "array", "V": "void",
    "x": "binary",
}


def _field_type(value: Any) -> str:
    """The field type RabbitMQ names for `value` as a pamqp-based client (aio-pika, aiormq)
    encodes it."""
    try:
        return _FIELD_TYPES.get(chr(encode.encode_table_value(value)[0]), "unknown")
    except (TypeError, ValueError):
        return "unknown"


def _erl(value: Any) -> str:
    """A value as RabbitMQ's ~s prints it in its reply texts."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def _arg_difference(received: Any, current: Any) -> str:
    """How a redeclared argument differs, in rabbit_misc:assert_args_equivalence's words."""
    if received is None:
        return (f"received none but current is the value '{_erl(current)}' of type "
                f"'{_field_type(current)}'")
    if current is None:
        return (f"received the value '{_erl(received)}' of type '{_field_type(received)}' "
                f"but current is none")
    return f"received '{_erl(received)}' but current is '{_erl(current)}'"


def _err(code: ReplyCode, text: str, method: type[commands.base.Frame] | None) -> ChannelException:
    class_id, method_id = method_ids(method)
    return ChannelException(code, text, class_id, method_id)
