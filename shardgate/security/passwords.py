"""Password hashing: scrypt (`hashlib.scrypt`, 16 random salt bytes) in a self-describing
`scrypt$N$r$p$salt$hash` string, so that stronger parameters can come later without breaking
stored entries; verification reads the parameters from the string (bounded, so that a bad
entry cannot exhaust memory) and compares in constant time. Knows no user and no file.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import os
import secrets

# scrypt cost: N=2^14, r=8, p=1 takes 16 MiB and some tens of milliseconds; successful checks
# are cached (see `Security._verified`) so a reconnecting client does not pay it again.
SCRYPT_N = 2**14
SCRYPT_R = 8
SCRYPT_P = 1
SCRYPT_DKLEN = 32
SALT_BYTES = 16
# Bounds on parameters read from a users file, so a bad entry cannot exhaust memory.
MAX_SCRYPT_MEMORY = 256 * 1024 * 1024


def secret_bytes(password: bytes | str | None) -> bytes:
    return password.encode("utf-8") if isinstance(password, str) else (password or b"")



def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def hash_password(password: str | bytes, *, n: int = SCRYPT_N, r: int = SCRYPT_R, p: int = SCRYPT_P) -> str:
    """`scrypt$N$r$p$salt$hash` with a fresh random salt (base64 salt and hash)."""
    secret = password.encode("utf-8") if isinstance(password, str) else password
    salt = os.urandom(SALT_BYTES)
    digest = hashlib.scrypt(secret, salt=salt, n=n, r=r, p=p, dklen=SCRYPT_DKLEN,
                            maxmem=MAX_SCRYPT_MEMORY)
    return f"scrypt${n}${r}${p}${_b64(salt)}${_b64(digest)}"


def _parse_hash(encoded: str) -> tuple[int, int, int, bytes, bytes]:
    parts = encoded.split("$")
    if len(parts) != 6 or parts[0] != "scrypt":
        raise ValueError("not an scrypt$N$r$p$salt$hash string")
    n, r, p = int(parts[1]), int(parts[2]), int(parts[3])
    if n < 2 or n & (n - 1) or r < 1 or p < 1 or 128 * r * n > MAX_SCRYPT_MEMORY // 2 or p > 16:
        raise ValueError("scrypt parameters out of bounds")
    try:
        salt = base64.b64decode(parts[4], validate=True)
        digest = base64.b64decode(parts[5], validate=True)
    except binascii.Error as exc:
        raise ValueError(f"bad base64: {exc}") from exc
    if not salt or not digest:
        raise ValueError("empty salt or hash")
    return n, r, p, salt, digest


def verify_password(password: str | bytes, encoded: str) -> bool:
    """True when `password` hashes to `encoded`; False for a wrong password or a bad string."""
    secret = password.encode("utf-8") if isinstance(password, str) else password
    try:
        n, r, p, salt, expected = _parse_hash(encoded)
    except ValueError:
        return False
    actual = hashlib.scrypt(secret, salt=salt, n=n, r=r, p=p, dklen=len(expected),
                            maxmem=MAX_SCRYPT_MEMORY)
    return hmac.compare_digest(actual, expected)


@functools.cache
def dummy_hash() -> str:
    """A hash of nothing anyone knows: unknown users cost as much time as known ones."""
    return hash_password(secrets.token_bytes(16))

