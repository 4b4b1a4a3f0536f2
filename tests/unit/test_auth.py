"""Unit tests of password hashing, ACL filter matching and the `Security` decisions."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardgate.security.auth import (
    AuthError,
    Security,
    User,
    anonymous_setting,
    hash_password,
    load_acl,
    load_users,
    save_users,
    verify_password,
)
from shardgate.security.users_cli import main as users_main


# ---------------------------------------------------------------------------- hashing
def test_hash_is_self_describing_and_salted() -> None:
    first, second = hash_password("pw"), hash_password("pw")
    assert first != second
    scheme, n, r, p, salt, digest = first.split("$")
    assert (scheme, n, r, p) == ("scrypt", "16384", "8", "1")
    assert salt and digest


def test_verify_accepts_right_password_refuses_wrong() -> None:
    encoded = hash_password("correct horse")
    assert verify_password("correct horse", encoded)
    assert verify_password(b"correct horse", encoded)
    assert not verify_password("correct hors", encoded)
    assert not verify_password("", encoded)


def test_verify_honours_parameters_in_the_string() -> None:
    encoded = hash_password("pw", n=2**10, r=4, p=2)
    assert encoded.startswith("scrypt$1024$4$2$")
    assert verify_password("pw", encoded)


@pytest.mark.parametrize("encoded", [
    "", "plain", "scrypt$16384$8$1$c2FsdA==", "bcrypt$16384$8$1$c2FsdA==$aGFzaA==",
    "scrypt$1000$8$1$c2FsdA==$aGFzaA==",  # N not a power of two
    "scrypt$1073741824$8$1$c2FsdA==$aGFzaA==",  # far too much memory
    "scrypt$16384$8$1$!!!$aGFzaA==",
])
def test_verify_refuses_malformed_hashes(encoded: str) -> None:
    assert not verify_password("pw", encoded)


# ---------------------------------------------------------------------------- users file
def test_users_file_round_trip_is_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "users.json"
    save_users(path, {"alice": User("alice", hash_password("a"), ["admin"])})
    users = load_users(path)
    assert users["alice"].roles == ["admin"]
    assert verify_password("a", users["alice"].password_hash)
    assert path.stat().st_mode & 0o077 == 0


def test_missing_users_file_holds_nobody(tmp_path: Path) -> None:
    assert load_users(tmp_path / "absent.json") == {}


def test_broken_users_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "users.json"
    path.write_text('{"users": {"bob": {"roles": []}}}')
    with pytest.raises(AuthError, match="password"):
        load_users(path)


# ---------------------------------------------------------------------------- Security
def make_security(tmp_path: Path, users: dict[str, list[str]] | None = None, acl: str | None = None,
                  **kwargs: object) -> Security:
    users_file = tmp_path / "users.json"
    if users is not None:
        save_users(users_file, {name: User(name, hash_password(f"{name}-pw", n=2**8), roles)
                                for name, roles in users.items()})
    acl_file = tmp_path / "acl.toml"
    if acl is not None:
        acl_file.write_text(acl)
    return Security(users_file, acl_file, **kwargs)  # type: ignore[arg-type]


def test_anonymous_allowed_only_on_loopback_without_users(tmp_path: Path) -> None:
    assert make_security(tmp_path, listener_host="127.0.0.1").allow_anonymous
    assert make_security(tmp_path, listener_host="::1").allow_anonymous
    assert not make_security(tmp_path, listener_host="0.0.0.0").allow_anonymous
    assert not make_security(tmp_path, {"alice": []}, listener_host="127.0.0.1").allow_anonymous
    assert make_security(tmp_path, {"alice": []}, allow_anonymous=True).allow_anonymous
    assert not make_security(tmp_path / "x", allow_anonymous=False).allow_anonymous


def test_anonymous_setting_parses_config_values() -> None:
    assert anonymous_setting(None) is None
    assert anonymous_setting("auto") is None
    assert anonymous_setting("false") is False
    assert anonymous_setting(True) is True
    with pytest.raises(AuthError):
        anonymous_setting("maybe")


def test_authenticate_outcomes_and_denial_counter(tmp_path: Path) -> None:
    security = make_security(tmp_path, {"alice": []})
    assert security.authenticate("alice", b"alice-pw", "c1") is None
    assert security.authenticate("alice", b"alice-pw", "c1") is None  # cached path
    assert security.authenticate("alice", b"wrong", "c1") == "bad-credentials"
    assert security.authenticate("mallory", b"alice-pw", "c1") == "bad-credentials"
    assert security.authenticate("alice", None, "c1") == "bad-credentials"
    assert security.authenticate(None, None, "c1") == "not-authorized"
    assert security.authenticate(None, b"token", "c1", protocol="grpc") == "bad-credentials"
    assert security.denials[("mqtt", "connect")] == 4
    assert security.denials[("grpc", "connect")] == 1


def test_open_broker_does_not_check_credentials(tmp_path: Path) -> None:
    security = make_security(tmp_path)
    assert security.authenticate("guest", b"guest") is None
    assert security.authenticate(None, b"token", protocol="grpc") is None
    explicit = make_security(tmp_path / "x", {"alice": []}, allow_anonymous=True)
    assert explicit.authenticate(None, None) is None
    assert explicit.authenticate("guest", b"guest") == "bad-credentials"


def test_password_change_invalidates_cached_login(tmp_path: Path) -> None:
    security = make_security(tmp_path, {"alice": []})
    assert security.authenticate("alice", b"alice-pw") is None
    save_users(security.users_file, {"alice": User("alice", hash_password("new", n=2**8))})
    assert security.authenticate("alice", b"alice-pw") == "bad-credentials"
    assert security.authenticate("alice", b"new") is None


ACL = """
[[allow]]
actions = ["publish", "subscribe"]
topics = ["devices/%u/#", "clients/%c/#"]

[[allow]]
user = "alice"
actions = "subscribe"
topics = ["devices/#"]

[[allow]]
client = "logger"
actions = "all"
topics = ["#"]

[[deny]]
topics = ["devices/+/secret"]
"""


def test_acl_user_and_client_substitution(tmp_path: Path) -> None:
    security = make_security(tmp_path, {"alice": [], "bob": []}, ACL)
    assert security.authorize("publish", "bob", "b1", "devices/bob/temp")
    assert not security.authorize("publish", "bob", "b1", "devices/alice/temp")
    assert security.authorize("publish", "bob", "b1", "clients/b1/status")
    assert not security.authorize("publish", "bob", "b1", "clients/b2/status")
    assert security.authorize("subscribe", "alice", "a1", "devices/+/temp")
    assert not security.authorize("subscribe", "bob", "b1", "devices/+/temp")
    assert security.authorize("subscribe", "bob", "b1", "$share/g/devices/bob/temp")
    assert security.authorize("subscribe", "bob", "b1", "clients/b1/#")
    assert not security.authorize("subscribe", None, "anon", "devices/None/x")


def test_acl_deny_beats_allow_and_overlapping_subscriptions_are_denied(tmp_path: Path) -> None:
    security = make_security(tmp_path, {"bob": []}, ACL)
    assert not security.authorize("publish", "bob", "b1", "devices/bob/secret")
    assert security.authorize("publish", "bob", "logger", "anything/at/all")
    assert not security.authorize("subscribe", "bob", "logger", "#")  # overlaps the deny
    assert security.authorize("subscribe", "bob", "logger", "other/#")
    assert security.denials[("mqtt", "publish")] == 1
    assert security.denials[("mqtt", "subscribe")] == 1


def test_acl_wildcards_in_names_do_not_widen_grants(tmp_path: Path) -> None:
    security = make_security(tmp_path, None, ACL, allow_anonymous=True)
    assert not security.authorize("publish", None, "+", "clients/x/status")
    assert not security.authorize("subscribe", None, "#", "clients/#")
    assert security.authorize("publish", None, "c9", "clients/c9/status")


def test_without_acl_file_everything_but_admin_is_allowed(tmp_path: Path) -> None:
    security = make_security(tmp_path, {"root": ["admin"], "bob": []})
    assert security.authorize("publish", "bob", "b", "any/topic")
    assert security.authorize("subscribe", "bob", "b", "#")
    assert not security.authorize("admin", "bob", "b", "api")
    assert security.authorize("admin", "root", "r", "api")
    assert security.denials[("mqtt", "admin")] == 1


def test_acl_file_changes_are_picked_up(tmp_path: Path) -> None:
    now = [0.0]
    security = make_security(tmp_path, {"bob": []}, clock=lambda: now[0])
    assert security.authorize("publish", "bob", "b", "x")
    (tmp_path / "acl.toml").write_text('[[allow]]\ntopics = ["y"]\nactions = "publish"\n')
    now[0] += 2
    assert not security.authorize("publish", "bob", "b", "x")
    assert security.authorize("publish", "bob", "b", "y")


def test_bad_acl_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "acl.toml"
    path.write_text('[[allow]]\ntopics = ["a"]\nactions = "read"\n')
    with pytest.raises(AuthError, match="unknown action"):
        load_acl(path)
    path.write_text('[[allow]]\nactions = "publish"\n')
    with pytest.raises(AuthError, match="topics"):
        load_acl(path)


# ---------------------------------------------------------------------------- users CLI
def test_users_cli_add_list_remove(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = str(tmp_path)
    assert users_main(["users", "add", "alice", "--password", "pw", "--role", "admin",
                       "--data-dir", data]) == 0
    assert users_main(["users", "add", "bob", "--password", "pw2", "--data-dir", data]) == 0
    assert users_main(["users", "list", "--data-dir", data]) == 0
    out = capsys.readouterr().out
    assert "alice\tadmin" in out and "\nbob\n" in out and "pw" not in out.replace("pw2", "")
    users = load_users(tmp_path / "users.json")
    assert verify_password("pw2", users["bob"].password_hash)
    assert users_main(["users", "remove", "bob", "--data-dir", data]) == 0
    assert users_main(["users", "remove", "bob", "--data-dir", data]) == 2
    assert users_main(["users", "add", "a/b", "--password", "x", "--data-dir", data]) == 2
    assert set(load_users(tmp_path / "users.json")) == {"alice"}


def test_a_policy_installed_again_decides_the_next_check_of_every_principal(tmp_path: Path) -> None:
    """The front door's security port: one swap replaces the whole policy, and the Edge reads
    it at each check, so a client connected under the old one is decided by the new one."""
    from shardgate.core.broker import Broker
    from shardgate.core.edge import Action, Edge, Principal, SecurityPort

    save_users(tmp_path / "users.json", {"alice": User("alice", hash_password("pw"))})
    (tmp_path / "acl.toml").write_text(
        '[[allow]]\nuser = "alice"\nactions = ["publish", "subscribe"]\ntopics = ["a/#"]\n')
    port = SecurityPort()
    edge = Edge(Broker(), security=port)
    alice = Principal("mqtt", "alice", "c1", "127.0.0.1")
    assert not edge.secured and edge.authenticate(alice, "wrong") is None
    assert edge.authorize(alice, Action.PUBLISH, "b/1")
    first = Security(tmp_path / "users.json", tmp_path / "acl.toml")
    assert port.install(first) is None
    assert edge.secured and edge.security is port
    assert edge.authorize(alice, Action.PUBLISH, "a/1")
    assert not edge.authorize(alice, Action.PUBLISH, "b/1")
    # $delayed: the release topic is asked of the same policy
    assert not edge.authorize(alice, Action.PUBLISH, "$delayed/5/b/1")
    (tmp_path / "narrow.toml").write_text(
        '[[allow]]\nuser = "alice"\nactions = ["subscribe"]\ntopics = ["a/#"]\n')
    second = Security(tmp_path / "users.json", tmp_path / "narrow.toml")
    assert port.install(second) is first
    assert not edge.authorize(alice, Action.PUBLISH, "a/1")  # the grant is gone at once
    assert edge.authorize(alice, Action.SUBSCRIBE, "a/#")
    assert first.denials[("mqtt", "publish")] == 2 and second.denials[("mqtt", "publish")] == 1
    assert not edge.authorize(alice, Action.SUBSCRIBE, "$internal/x")  # the core's own rule


def test_security_is_the_front_doors_policy(tmp_path: Path) -> None:
    from shardgate.core.edge import Action, Principal, SecurityPolicy

    security: SecurityPolicy = Security(tmp_path / "users.json")
    assert not security.checks_credentials()  # no user, loopback: open
    save_users(tmp_path / "users.json", {"alice": User("alice", hash_password("pw"))})
    assert security.checks_credentials()  # the first user closes it at the next login
    security.count_denial(Principal("amqp", "guest"), Action.CONNECT)
    assert isinstance(security, Security) and security.denials[("amqp", "connect")] == 1
