"""The users file (`<data_dir>/users.json` unless `auth.users_file` says otherwise): its
`User` entries (a name, a password hash of `passwords.py`, roles), read and written whole,
atomically and readable by its owner only. The CLI (`users_cli.py`) edits it; the broker
re-reads it when it changes (`auth.Security`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import AuthError

USERS_FILE = "users.json"


@dataclass(slots=True)
class User:
    name: str
    password_hash: str
    roles: list[str] = field(default_factory=list)


def validate_user_name(name: str) -> None:
    if not name or len(name.encode("utf-8")) > 65535:
        raise AuthError("a user name is 1 to 65535 bytes of UTF-8")
    if any(ch in name for ch in "\x00+#/") or any(ord(ch) < 0x20 for ch in name):
        raise AuthError("a user name cannot hold control characters, '+', '#' or '/'")


def load_users(path: Path) -> dict[str, User]:
    """The users of a users file; an absent file holds none."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise AuthError(f"cannot read {path}: {exc}") from exc
    try:
        document = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise AuthError(f"{path} is not valid JSON: {exc}") from exc
    entries = document.get("users", {}) if isinstance(document, dict) else None
    if not isinstance(entries, dict):
        raise AuthError(f"{path}: expected an object with a 'users' object")
    users: dict[str, User] = {}
    for name, entry in entries.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("password"), str):
            raise AuthError(f"{path}: user {name!r} needs a 'password' string")
        roles = entry.get("roles", [])
        if not isinstance(roles, list) or not all(isinstance(role, str) for role in roles):
            raise AuthError(f"{path}: user {name!r}: 'roles' is a list of strings")
        users[name] = User(name, entry["password"], list(roles))
    return users


def save_users(path: Path, users: dict[str, User]) -> None:
    """Write the users file atomically, readable by its owner only."""
    document = {
        "version": 1,
        "users": {
            name: {"password": user.password_hash, "roles": user.roles}
            for name, user in sorted(users.items())
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)

