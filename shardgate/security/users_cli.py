"""`shardgate users add|remove|list`: manage the users file of a data directory.

Edits the JSON users file described in `shardgate.security.auth` (default `<data-dir>/users.json`) with
an atomic replace, so a running broker picks the change up at the next connection. It never
prints or stores a clear-text password. Run alone as `python -m shardgate.security.users_cli ...`.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path

from .auth import (
    USERS_FILE,
    AuthError,
    User,
    hash_password,
    load_users,
    save_users,
    validate_user_name,
)

DEFAULT_DATA_DIR = Path("./shardgate-data")


def add_users_commands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `users` command (with add / remove / list) to a CLI's sub-parsers."""
    users = subparsers.add_parser("users", help="manage users (authentication)")
    users.set_defaults(users_handler=run_users_command)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", type=Path, default=None,
                        help="data directory holding users.json "
                             "(default $SHARDGATE_DATA_DIR or ./shardgate-data)")
    common.add_argument("--users-file", type=Path,
                        help="users file to edit (default <data-dir>/users.json)")
    actions = users.add_subparsers(dest="users_action", metavar="{add,remove,list}")
    actions.required = True
    add = actions.add_parser("add", parents=[common], help="add a user or change a password")
    add.add_argument("name")
    add.add_argument("--password", help="the password (default: prompt, or one line of stdin)")
    add.add_argument("--role", action="append", default=None, dest="roles", metavar="ROLE",
                     help="a role to give the user, e.g. admin (repeatable; replaces the roles)")
    remove = actions.add_parser("remove", parents=[common], help="remove a user")
    remove.add_argument("name")
    actions.add_parser("list", parents=[common], help="list users and their roles")
    return users


def _users_file(args: argparse.Namespace) -> Path:
    if args.users_file is not None:
        return Path(args.users_file)
    data_dir = args.data_dir or Path(os.environ.get("SHARDGATE_DATA_DIR") or DEFAULT_DATA_DIR)
    return Path(data_dir) / USERS_FILE


def _read_password(args: argparse.Namespace) -> str:
    if args.password is not None:
        return str(args.password)
    if sys.stdin.isatty():
        first = getpass.getpass(f"password for {args.name}: ")
        if getpass.getpass("again: ") != first:
            raise AuthError("the passwords differ")
        return first
    line = sys.stdin.readline()
    return line.rstrip("\r\n")


def run_users_command(args: argparse.Namespace) -> int:
    """Carry out a parsed `users` command; 0 on success, 2 on error (message on stderr)."""
    path = _users_file(args)
    try:
        users = load_users(path)
        if args.users_action == "list":
            for name, user in sorted(users.items()):
                print(f"{name}\t{','.join(user.roles)}" if user.roles else name)
            return 0
        validate_user_name(args.name)
        if args.users_action == "remove":
            if users.pop(args.name, None) is None:
                raise AuthError(f"no user {args.name!r} in {path}")
            save_users(path, users)
            print(f"removed user {args.name}")
            return 0
        password = _read_password(args)
        if not password:
            raise AuthError("an empty password is not allowed")
        existing = users.get(args.name)
        roles = args.roles if args.roles is not None else (existing.roles if existing else [])
        users[args.name] = User(args.name, hash_password(password), sorted(set(roles)))
        save_users(path, users)
        print(f"{'updated' if existing else 'added'} user {args.name}")
        return 0
    except (AuthError, OSError) as exc:
        print(f"shardgate users: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardgate")
    add_users_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.users_handler(args))


if __name__ == "__main__":
    sys.exit(main())
