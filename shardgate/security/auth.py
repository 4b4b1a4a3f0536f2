"""Authentication and authorization: one security model for every protocol.

Users
    Kept in a JSON users file, `<data_dir>/users.json` unless `auth.users_file` says otherwise,
    managed by `shardgate users add|remove|list`:
    `{"version": 1, "users": {"alice": {"password": "scrypt$16384$8$1$<salt>$<hash>",
    "roles": ["admin"]}}}`. Passwords are hashed with scrypt (`hashlib.scrypt`, 16 random salt
    bytes, base64 salt and hash) in a self-describing string, so stronger parameters can be
    introduced later without breaking existing entries; verification compares in constant time.

    A file rather than the SQLite metadata store: the CLI edits it whether or not a broker is
    running (no second writer on the broker's private database), an operator can review it,
    provision it from configuration management and back it up alone, and the broker picks up
    changes by its modification time without a restart. Mosquitto's `password_file` is the
    model.

Anonymous access
    `auth.allow_anonymous` = true or false decides. Left unset (the embedded default), anonymous
    clients are accepted exactly when the listener host (`listeners.host`) is a loopback address
    (127.0.0.0/8, ::1, "localhost") *and* no user is defined (the users file is missing or lists
    nobody). Adding the first user, or binding a non-loopback address, turns anonymous access off.
    While anonymous access is on and no user is defined, credentials are not checked at all (as
    Mosquitto without a `password_file`): a gRPC bearer token is accepted and a claimed user
    name still selects `%u` ACL rules; AMQP keeps its built-in guest/guest login from loopback
    (RabbitMQ's default) since AMQP clients always send credentials. Once a user
    exists, an unknown user name or a wrong password is refused even when anonymous access is
    on by configuration.

ACL rules
    From a TOML file, `<data_dir>/acl.toml` unless `auth.acl_file` says otherwise::

        [[allow]]
        user = "alice"                 # optional: exact user name
        client = "sensor-1"            # optional: exact client id
        actions = ["publish", "subscribe"]   # publish / subscribe / admin / all
        topics = ["sensors/%u/#", "clients/%c/+"]

        [[deny]]
        topics = ["secret/#"]          # no user/client: applies to everyone, as Mosquitto's pattern

    `%u` becomes the user name and `%c` the client id, as in Mosquitto; a rule using `%u` never
    matches an anonymous client, and an allow rule never matches when the substituted value holds
    `+`, `#` or `/` (a client cannot widen its own grant). A deny rule beats an allow rule. A
    publish is matched as a topic name against the rule's filter; a subscribe filter is allowed
    when the rule's filter covers everything it can match (`a/#` allows `a/+/b`, `a/+` does not
    allow `a/#`) and denied when it merely overlaps a deny filter (subscribing to `#` is denied by
    a deny on `secret/#`). `$share/<group>/` is stripped first. With an ACL file, what no rule
    allows is refused. Without one, publish and subscribe are allowed to any accepted client and
    `admin` only to users with the `admin` role (or to anyone while anonymous loopback access is
    on); the `admin` role grants `admin` everywhere unless a deny rule says otherwise.

Denials are counted per (protocol, action) in `Security.denials`, action being "connect",
"publish", "subscribe" or "admin". This module knows no protocol: `Security` is the front
door's `SecurityPolicy` (`core/edge.py`), which every protocol asks through the Edge and whose
refusals it turns into its own reply.

This module holds the model (`Security`: files re-read on change, authentication, decisions);
its parts are `passwords.py` (scrypt hashes), `users.py` (the users file), `acl.py` (the ACL
file and its rules), `settings.py` (the `[auth]` section), `install.py` (hooking the model into
a running broker) and `errors.py`. Their names are importable from here as before.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

from ..core.edge import Principal
from ..core.topics import filter_covers, filter_matches, filters_overlap
from .acl import ACL_FILE, ALL_ACTIONS, AclRule, Action, load_acl, parse_acl, strip_share
from .errors import AuthError
from .install import apply_rules_change, install_security
from .login_guard import LoginGuard
from .passwords import (
    MAX_SCRYPT_MEMORY,
    SALT_BYTES,
    SCRYPT_DKLEN,
    SCRYPT_N,
    SCRYPT_P,
    SCRYPT_R,
    dummy_hash,
    hash_password,
    secret_bytes,
    verify_password,
)
from .settings import AuthSettings, anonymous_setting, is_loopback_host, security_paths
from .users import USERS_FILE, User, load_users, save_users, validate_user_name

__all__ = [
    "ACL_FILE", "ALL_ACTIONS", "MAX_CACHED_DECISIONS", "MAX_SCRYPT_MEMORY", "RELOAD_INTERVAL_S",
    "SALT_BYTES", "SCRYPT_DKLEN", "SCRYPT_N", "SCRYPT_P", "SCRYPT_R", "USERS_FILE", "AclRule",
    "Action", "AuthError", "AuthSettings", "Refusal", "Security", "User", "anonymous_setting",
    "apply_rules_change", "hash_password", "install_security", "is_loopback_host", "load_acl",
    "load_users", "parse_acl", "save_users", "security_paths", "validate_user_name",
    "verify_password",
]

log = logging.getLogger(__name__)

# How often (seconds) the users and ACL files are checked for changes.
RELOAD_INTERVAL_S = 1.0
MAX_CACHED_DECISIONS = 65536


# What `_precheck` answers when only a hash can decide.
_HASH = object()


class Refusal(StrEnum):
    """What `authenticate` returns instead of None; the strings the MQTT hook expects."""

    BAD_CREDENTIALS = "bad-credentials"
    NOT_AUTHORIZED = "not-authorized"


FileVersion = tuple[int, int, int]


def _version(path: Path) -> FileVersion | None:
    """What tells one version of a file from the next: its modification time, inode and size.
    The time alone is not enough: two writes within one tick of the file system's clock (a
    few milliseconds) would look the same, and a user removed right after being added would
    stay. Every writer replaces the file (a new inode)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_ino, stat.st_size


class Security:
    """Users, anonymous policy and ACL rules; `authenticate` and `authorize` for every protocol.

    Files are re-read when their modification time changes (checked on every authentication and
    at most once a second on authorization), so `shardgate users add` takes effect on a running
    broker. A file that fails to parse keeps the
    previous rules and logs an error; at start it raises `AuthError`.
    """

    def __init__(
        self, users_file: Path, acl_file: Path | None = None, *,
        allow_anonymous: bool | None = None, listener_host: str = "127.0.0.1",
        clock: Callable[[], float] = time.monotonic, guard: LoginGuard | None = None,
    ) -> None:
        self.users_file = users_file
        self.acl_file = acl_file
        self.allow_anonymous_setting = allow_anonymous
        self.loopback_listener = is_loopback_host(listener_host)
        self.denials: collections.Counter[tuple[str, str]] = collections.Counter()
        # Called after the users or the ACL rules changed (the running broker re-checks who
        # is connected and what they subscribed to); `removed_users` names who is gone.
        self.on_rules_change: list[Callable[[Security], None]] = []
        self.removed_users: frozenset[str] = frozenset()
        self._watcher: asyncio.TimerHandle | None = None
        self._clock = clock
        self._users: dict[str, User] = {}
        self._rules: list[AclRule] | None = None
        self._users_version: FileVersion | None = None
        self._acl_version: FileVersion | None = None
        self._checked_at = float("-inf")
        self._decisions: dict[tuple[str, str | None, str, str], bool] = {}
        # user -> (stored hash, keyed digest of the password last verified against it).
        self._verified: dict[str, tuple[str, bytes]] = {}
        self._cache_key = secrets.token_bytes(32)
        # Password checks in a thread pool, throttled per source address.
        self.guard = guard if guard is not None else LoginGuard()
        self.reload(strict=True)

    # ------------------------------------------------------------------ files
    def reload(self, *, strict: bool = False) -> None:
        """Re-read the files whose modification time changed."""
        self._checked_at = self._clock()
        changed = False
        users_version = _version(self.users_file)
        if users_version != self._users_version or (users_version is None and self._users):
            try:
                previous = self._users
                self._users = load_users(self.users_file)
                self.removed_users = frozenset(previous) - frozenset(self._users)
                changed = True
                self._users_version = users_version
                self._verified.clear()
                self._decisions.clear()
                log.info("loaded %d users from %s", len(self._users), self.users_file)
            except AuthError:
                if strict:
                    raise
                log.exception("keeping the previous users")
        if self.acl_file is not None:
            acl_version = _version(self.acl_file)
            if acl_version != self._acl_version:
                try:
                    self._rules = load_acl(self.acl_file)
                    self._acl_version = acl_version
                    self._decisions.clear()
                    changed = True
                    if self._rules is not None:
                        log.info("loaded %d ACL rules from %s", len(self._rules), self.acl_file)
                except AuthError:
                    if strict:
                        raise
                    log.exception("keeping the previous ACL rules")
        if not self.open:
            # computed once passwords may be checked (at start, or when the first users are
            # loaded), not on the first unknown user's check; an open broker never needs it
            dummy_hash()
        if changed and not strict:
            for listener in list(self.on_rules_change):
                try:
                    listener(self)
                except Exception:
                    log.exception("applying the changed users or ACL rules failed")
            self.removed_users = frozenset()

    def watch(self, interval_s: float = RELOAD_INTERVAL_S) -> None:
        """Check the files every `interval_s` on the running loop, so that a change applies
        to connected clients even when none of them authenticates or publishes."""
        self.stop_watching()
        loop = asyncio.get_running_loop()

        def tick() -> None:
            self.reload()
            self._watcher = loop.call_later(interval_s, tick)

        self._watcher = loop.call_later(interval_s, tick)

    def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def _maybe_reload(self) -> None:
        if self._clock() - self._checked_at >= RELOAD_INTERVAL_S:
            self.reload()

    @property
    def users(self) -> dict[str, User]:
        return self._users

    @property
    def rules(self) -> list[AclRule] | None:
        return self._rules

    @property
    def open(self) -> bool:
        """No user defined and anonymous access on: credentials are not checked."""
        return not self._users and self.allow_anonymous

    @property
    def allow_anonymous(self) -> bool:
        if self.allow_anonymous_setting is not None:
            return self.allow_anonymous_setting
        return self.loopback_listener and not self._users

    # ------------------------------------------------------------------ authentication
    def authenticate(
        self, username: str | None, password: bytes | str | None, client_id: str = "",
        remote: str = "", protocol: str = "mqtt",
    ) -> str | None:
        """None to accept, else a `Refusal` value ("bad-credentials" or "not-authorized"). Hashes
        on the calling thread: the protocols call `authenticate_later` instead."""
        self.reload()  # a stat of each file per connection: a user just added can log in
        refusal = self._precheck(username, password)
        if refusal is _HASH:
            user, secret = self._users.get(str(username)), secret_bytes(password)
            ok = verify_password(secret, user.password_hash if user is not None else dummy_hash())
            refusal = self._after_hash(username, password, user, secret, ok)
        return self._conclude(refusal, username, client_id, remote, protocol)

    def authenticate_later(
        self, username: str | None, password: bytes | str | None, client_id: str = "",
        remote: str = "", protocol: str = "mqtt",
    ) -> str | None | asyncio.Future[str | None]:
        """As `authenticate`, with the password hashed off the event loop and throttled per
        source address (`LoginGuard`): the verdict at once when no hash is needed (an open
        broker, an anonymous client, the password verified before), else a future of it. An
        unknown user and a known user without a password take the same path as a wrong
        password (a hash is computed), so that timing tells no user names apart."""
        self.reload()
        refusal = self._precheck(username, password)
        if refusal is not _HASH:
            return self._conclude(refusal, username, client_id, remote, protocol)
        user, secret = self._users.get(str(username)), secret_bytes(password)
        encoded = user.password_hash if user is not None else dummy_hash()
        checking = self.guard.check(remote, lambda: verify_password(secret, encoded))
        verdict: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

        def checked(done: asyncio.Future[bool | None]) -> None:
            ok = False
            if done.cancelled():
                log.debug("password check of %s cancelled", remote or "-")
            elif done.exception() is not None:
                log.debug("password check of %s failed: %r", remote or "-", done.exception())
            else:
                ok = bool(done.result())
            result = self._after_hash(username, password, user, secret, ok)
            if not verdict.done():
                verdict.set_result(self._conclude(result, username, client_id, remote, protocol))

        checking.add_done_callback(checked)
        return verdict

    def _precheck(self, username: str | None, password: bytes | str | None) -> Refusal | None | object:
        """The verdict when no hash is needed, else `_HASH`."""
        if self.open:
            return None  # nobody to check against: an open broker, as Mosquitto without a password_file
        if username is None:
            if password is not None:
                return Refusal.BAD_CREDENTIALS  # a token or a password without a user name
            return None if self.allow_anonymous else Refusal.NOT_AUTHORIZED
        user = self._users.get(username)
        if user is not None and password is not None:
            keyed = hmac.new(self._cache_key, secret_bytes(password), hashlib.sha256).digest()
            cached = self._verified.get(username)
            if cached is not None and cached[0] == user.password_hash and hmac.compare_digest(cached[1], keyed):
                return None
        return _HASH

    def _after_hash(self, username: str | None, password: bytes | str | None, user: User | None,
                    secret: bytes, ok: bool) -> Refusal | None:
        if not ok or user is None or password is None or username is None:
            return Refusal.BAD_CREDENTIALS
        keyed = hmac.new(self._cache_key, secret, hashlib.sha256).digest()
        if len(self._verified) >= MAX_CACHED_DECISIONS:
            self._verified.clear()
        self._verified[username] = (user.password_hash, keyed)
        return None

    def _conclude(self, refusal: Refusal | None | object, username: str | None, client_id: str,
                  remote: str, protocol: str) -> str | None:
        if refusal is None:
            return None
        assert isinstance(refusal, Refusal)
        self.denials[(protocol, Action.CONNECT.value)] += 1
        log.info("%s %s %s: %s refused: %s", protocol, remote or "-", client_id or "-",
                 f"user {username!r}" if username is not None else "anonymous client", refusal.value)
        return refusal.value

    # ------------------------------------------------------------------ authorization
    def authorize(
        self, action: str, username: str | None, client_id: str, topic: str, protocol: str = "mqtt",
    ) -> bool:
        """May this client publish to / subscribe to / administer `topic`? Counts refusals."""
        self._maybe_reload()
        if self._rules is None and action == "publish" and topic:
            return True  # what `_decide` answers without an ACL file, asked once per message
        if self._rules is None and action != Action.ADMIN.value:
            # No ACL file: the decision is a few comparisons; caching it per client and topic
            # would only hold memory.
            allowed = self._decide(action, username, client_id, topic)
        else:
            key = (action, username, client_id, topic)
            cached = self._decisions.get(key)
            if cached is None:
                allowed = self._decide(action, username, client_id, topic)
                if len(self._decisions) >= MAX_CACHED_DECISIONS:
                    self._decisions.clear()
                self._decisions[key] = allowed
            else:
                allowed = cached
        if not allowed:
            self.denials[(protocol, action)] += 1
            log.info("%s %s: %s on %r denied for %s", protocol, client_id or "-", action, topic,
                     f"user {username!r}" if username is not None else "anonymous client")
        return allowed

    def _decide(self, action: str, username: str | None, client_id: str, topic: str) -> bool:
        subscribing = action == Action.SUBSCRIBE.value
        wanted = strip_share(topic) if subscribing else topic
        if not wanted:
            return False
        rules = self._rules
        if rules is not None:
            for rule in rules:
                if rule.allow or action not in rule.actions or not rule.applies_to(username, client_id):
                    continue
                for acl_filter in rule.filters_for(username, client_id):
                    hit = filters_overlap(acl_filter, wanted) if subscribing else filter_matches(acl_filter, wanted)
                    if hit:
                        return False
        if action == Action.ADMIN.value and self._is_admin(username):
            return True
        if rules is None:
            if action == Action.ADMIN.value:
                return username is None and self.allow_anonymous
            return True
        for rule in rules:
            if not rule.allow or action not in rule.actions or not rule.applies_to(username, client_id):
                continue
            for acl_filter in rule.filters_for(username, client_id):
                hit = filter_covers(acl_filter, wanted) if subscribing else filter_matches(acl_filter, wanted)
                if hit:
                    return True
        return False

    def _is_admin(self, username: str | None) -> bool:
        user = self._users.get(username) if username is not None else None
        return user is not None and "admin" in user.roles

    # ------------------------------------------------------------------ the front door's policy
    # `core.edge.SecurityPolicy`: what the Edge asks for every protocol.
    def checks_credentials(self) -> bool:
        """False on an open broker (no user defined, anonymous access on), with the files
        re-read first: a user just added closes the broker to the next login."""
        self.reload()
        return not self.open

    def authenticate_principal(
        self, principal: Principal, password: bytes | str | None,
    ) -> str | None | asyncio.Future[str | None]:
        """Check a principal's credentials, counted under its protocol (a future when a
        password must be hashed: see `authenticate_later`)."""
        return self.authenticate_later(
            principal.username, password, principal.client_id, principal.remote, principal.protocol
        )

    def authorize_principal(self, principal: Principal, action: str, topic: str) -> bool:
        """`authorize` in the front door's shape, one for every protocol."""
        if self._rules is None and action == "publish" and topic:
            self._maybe_reload()  # an ACL file may have appeared
            if self._rules is None:
                return True  # the hot path: a publish without an ACL file, once per message
        return self.authorize(
            str(action), principal.username, principal.client_id, topic, principal.protocol
        )

    def count_denial(self, principal: Principal, action: str) -> None:
        """A refusal the protocol decided itself (AMQP's built-in login on an open broker)."""
        self.denials[(principal.protocol, str(action))] += 1
