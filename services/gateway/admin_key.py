"""The admin key: who may call the gateway's Admin service.

One key per suite, ``aisadm_`` and 64 hex characters (32 random bytes), in
``$AISERVE_HOME/admin.key`` (mode 0600; the gateway setting ``admin_key_path`` names another
file). The local suite writes it on first start; on Kubernetes it is a Secret mounted as that
file. A tenant's API key never passes as it (PERMISSION_DENIED). No grpc, no pb.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

PREFIX = "aisadm_"


def ensure_admin_key(path: Path) -> str:
    """The admin key in ``path``, made on first use (a well-formed key already there is kept)."""
    if (key := read_admin_key(path)) is not None:
        return key
    key = PREFIX + secrets.token_hex(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(key + "\n")
    return key


def read_admin_key(path: Path) -> str | None:
    """The key in ``path``, or None when the file is missing or holds no well-formed key."""
    try:
        key = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return key if is_admin_key(key) else None


def is_admin_key(value: str) -> bool:
    """Whether ``value`` has the admin key's form (not whether it is this suite's key)."""
    secret = value.removeprefix(PREFIX)
    return value.startswith(PREFIX) and len(secret) == 64 and all(c in "0123456789abcdef" for c in secret)


def matches(given: str, key: str) -> bool:
    """``given`` is ``key`` (compared in constant time)."""
    return hmac.compare_digest(given.encode(), key.encode())
