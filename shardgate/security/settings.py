"""The `[auth]` configuration section (`AuthSettings`) and what it decides alone: where the
users and ACL files are (`security_paths`), the anonymous-access setting as written
(`anonymous_setting`) and whether a listener host is a loopback address (`is_loopback_host`,
which turns anonymous access on when no user exists)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..setting_values import Range
from .acl import ACL_FILE
from .errors import AuthError
from .users import USERS_FILE


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0].strip("[]")).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------- the model
@dataclass(slots=True)
class AuthSettings:
    """The `[auth]` configuration section."""

    # Empty: <data_dir>/users.json and <data_dir>/acl.toml.
    users_file: str = ""
    acl_file: str = ""
    # None: anonymous only on a loopback listener with no user defined (see the module doc).
    allow_anonymous: bool | None = None
    # The login guard (`login_guard.py`): after a source address's first wrong password its
    # next check waits `login_delay_s`, doubling with each further failure, at most
    # `login_max_delay_s`; 0 for both turns the delay off (checks stay one at a time per
    # address).
    login_delay_s: float = 0.25
    login_max_delay_s: float = 5.0

    RANGES: ClassVar[dict[str, Range]] = {
        "login_delay_s": (0, None), "login_max_delay_s": (0, None),
    }


def security_paths(data_dir: Path, settings: AuthSettings | None = None) -> tuple[Path, Path]:
    settings = settings or AuthSettings()
    users = Path(settings.users_file) if settings.users_file else data_dir / USERS_FILE
    acl = Path(settings.acl_file) if settings.acl_file else data_dir / ACL_FILE
    return users, acl


def anonymous_setting(value: Any) -> bool | None:
    """`auth.allow_anonymous` as configured: a bool, or None / "auto" (also from an env string)."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("", "auto", "none", "null"):
        return None
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise AuthError(f"auth.allow_anonymous: expected true, false or auto, got {value!r}")
