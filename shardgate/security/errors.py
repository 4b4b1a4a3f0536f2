"""The security model's one error: a users or ACL file that cannot be read, a user that
cannot be stored, a setting that makes no sense. The composition root turns it into a
`ConfigError` at start; the CLI prints it."""

from __future__ import annotations


class AuthError(Exception):
    """A users or ACL file that cannot be read or a user that cannot be stored."""
