"""One setting's value as the configuration reads it from a TOML file, the environment or a
flag: coerced to the setting's declared type (`"8080"` to 8080 from the environment), then
checked against that type, its allowed words (`CHOICES`), its range (the `RANGES` of its
settings class) and, for a port, 0 to 65535. Every refusal is a `ConfigError` naming the
setting, where it came from and what is allowed. Nothing here knows the sections or the order
the sources are read in (`config.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ConfigError(Exception):
    """A setting, a file or a combination of settings the configuration refuses; the message
    names the setting and what it allows."""


# A setting's allowed range, inclusive; None: no bound. Each settings class says its own in a
# `RANGES` class attribute (setting name -> range), checked wherever the setting is given.
Range = tuple[float | None, float | None]


def coerce(value: Any, current: Any, name: str, annotation: str) -> Any:
    """`value` as the setting whose default is `current` and whose type is `annotation` takes
    it: text (the environment, a flag) is read as a flag, a number, a path or None."""
    if isinstance(value, str):
        text = value.strip()
        if isinstance(current, bool) or annotation == "bool":
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        if isinstance(current, int) or annotation.startswith("int"):
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
        if isinstance(current, float) or annotation.startswith("float"):
            try:
                return float(text)
            except ValueError:
                raise ConfigError(f"{name}: expected a number, got {value!r}") from None
        if isinstance(current, Path):
            return Path(text)
        if text.lower() in ("", "none", "null") and "None" in annotation:
            return None
        return text
    if isinstance(current, Path):
        return Path(value)
    if isinstance(current, float) and isinstance(value, int):
        return float(value)
    return value


# Settings that take one of a few words: dotted name -> allowed values.
CHOICES: dict[str, tuple[str, ...]] = {
    "log_level": ("debug", "info", "warning", "error"),
    "default_stream_mode": ("reliable", "non-reliable"),
    "journal.fsync": ("always", "interval", "os"),
    "mqtt.session_takeover_by_other_user": ("refuse", "new_session"),
    "streams.mode": ("reliable", "non-reliable"),
    "streams.schema": ("bytes", "string", "int64", "json"),
}


def check_choice(name: str, value: Any, source: str) -> None:
    allowed = CHOICES.get(name)
    if allowed is not None and value not in allowed:
        raise ConfigError(f"{source}: {name} = {value!r} is not allowed; use one of {' | '.join(allowed)}")


def check_type(value: Any, annotation: str, raw: Any, name: str) -> None:
    """Refuse a value of the wrong kind (`mqtt_port = "x"`, `retain_available = 3`): TOML
    carries types, and a setting must not take one its code does not expect. A setting of
    several kinds (`cluster.etcd`: a list or one string) is checked by its own section."""
    if "|" in annotation.replace(" | None", ""):
        return
    expected = (int,) if annotation.startswith("int") else (
        (int, float) if annotation.startswith("float") else
        (bool,) if annotation == "bool" else (str,) if annotation.startswith("str") else
        (dict,) if annotation.startswith("dict") else
        (list, tuple) if annotation.startswith(("list", "tuple")) else None)
    if expected and value is not None and (
        not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected)
    ):
        raise ConfigError(f"{name} must be {_kind(annotation)}, got {raw!r}")


def _bound(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1 \
        else f"{value:g}"


def check_range(cls: type, key: str, value: Any, name: str, raw: Any = None) -> None:
    """Refuse a number outside its setting's range (`RANGES` of its settings class), saying
    the range: `mqtt.receive_maximum = 0 is out of range (allowed: 1 to 65,535)`."""
    low, high = getattr(cls, "RANGES", {}).get(key, (None, None))
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if (low is not None and value < low) or (high is not None and value > high):
        if low is not None and high is not None:
            allowed = f"{_bound(low)} to {_bound(high)}"
        elif low is not None:
            allowed = f"at least {_bound(low)}" if low not in (0.001,) else "more than 0"
        else:
            allowed = f"at most {_bound(high)}"  # type: ignore[arg-type]
        shown = raw if isinstance(raw, int | float | str) else value
        raise ConfigError(f"{name} = {shown!r} is out of range (allowed: {allowed})")


def check_port(name: str, value: Any) -> None:
    """A listener port is 0 (off) to 65535: the socket layer would silently take 70000 as 4464."""
    if isinstance(value, int) and not 0 <= value <= 65535:
        raise ConfigError(f"{name} = {value} is not a port number (1 to 65535, 0 turns it off)")


def _kind(annotation: str) -> str:
    if annotation.startswith("int"):
        return "an integer"
    if annotation.startswith("float"):
        return "a number"
    if annotation == "bool":
        return "true or false"
    if annotation.startswith("dict"):
        return "a table"
    if annotation.startswith(("list", "tuple")):
        return "a list"
    return "a string"
