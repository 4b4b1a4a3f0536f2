"""ACL rules (`<data_dir>/acl.toml` unless `auth.acl_file` says otherwise): the actions a
client asks for, and the `[[allow]]` / `[[deny]]` rules of the file, parsed and checked, with
the `%u` / `%c` substitution of each rule's topic filters. How the rules decide is
`auth.Security.authorize`'s (see `auth.py`'s docstring); this module only reads them.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from .errors import AuthError

ACL_FILE = "acl.toml"


class Action(StrEnum):
    PUBLISH = "publish"
    SUBSCRIBE = "subscribe"
    ADMIN = "admin"
    CONNECT = "connect"


# ---------------------------------------------------------------------------- topic filters
def strip_share(topic_filter: str) -> str:
    if topic_filter.startswith("$share/"):
        parts = topic_filter.split("/", 2)
        return parts[2] if len(parts) == 3 else ""
    return topic_filter


# ---------------------------------------------------------------------------- ACL rules
ALL_ACTIONS = frozenset({Action.PUBLISH.value, Action.SUBSCRIBE.value, Action.ADMIN.value})


@dataclass(slots=True)
class AclRule:
    allow: bool
    actions: frozenset[str]
    topics: tuple[str, ...]
    user: str | None = None
    client: str | None = None

    def applies_to(self, username: str | None, client_id: str) -> bool:
        if self.user is not None and self.user != username:
            return False
        return self.client is None or self.client == client_id

    def filters_for(self, username: str | None, client_id: str) -> Iterable[str]:
        for pattern in self.topics:
            if "%u" in pattern:
                if username is None or (self.allow and _unsafe(username)):
                    continue
                pattern = pattern.replace("%u", username)
            if "%c" in pattern:
                if self.allow and _unsafe(client_id):
                    continue
                pattern = pattern.replace("%c", client_id)
            yield pattern


def _unsafe(value: str) -> bool:
    return not value or any(ch in value for ch in "+#/")


def parse_acl(document: dict[str, Any], source: str = "ACL") -> list[AclRule]:
    rules: list[AclRule] = []
    for kind in ("deny", "allow"):
        entries = document.get(kind, [])
        if not isinstance(entries, list):
            raise AuthError(f"{source}: '{kind}' must be an array of tables ([[{kind}]])")
        for number, entry in enumerate(entries, 1):
            where = f"{source}: [[{kind}]] #{number}"
            if not isinstance(entry, dict):
                raise AuthError(f"{where}: expected a table")
            unknown = set(entry) - {"user", "client", "actions", "topics"}
            if unknown:
                raise AuthError(f"{where}: unknown keys {sorted(unknown)}")
            actions = entry.get("actions", "all")
            actions = [actions] if isinstance(actions, str) else actions
            if not isinstance(actions, list) or not actions:
                raise AuthError(f"{where}: 'actions' is a string or a list of strings")
            expanded: set[str] = set()
            for action in actions:
                if action == "all":
                    expanded |= ALL_ACTIONS
                elif action in ALL_ACTIONS:
                    expanded.add(action)
                else:
                    raise AuthError(f"{where}: unknown action {action!r}")
            topics = entry.get("topics")
            if isinstance(topics, str):
                topics = [topics]
            if not isinstance(topics, list) or not topics or not all(isinstance(t, str) and t for t in topics):
                raise AuthError(f"{where}: 'topics' is a non-empty list of topic filters")
            user, client = entry.get("user"), entry.get("client")
            if user is not None and not isinstance(user, str) or client is not None and not isinstance(client, str):
                raise AuthError(f"{where}: 'user' and 'client' are strings")
            rules.append(AclRule(kind == "allow", frozenset(expanded), tuple(topics), user, client))
    return rules


def load_acl(path: Path) -> list[AclRule] | None:
    """The rules of an ACL file, or None when there is no such file."""
    try:
        with path.open("rb") as handle:
            document = tomllib.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise AuthError(f"cannot read {path}: {exc}") from exc
    return parse_acl(document, str(path))

