"""Access rules of the dashboard server: where it listens, who may open it, which traces a URL may name.

- `is_local(host)`: 127.0.0.1 / localhost / ::1. Any other address requires an access token.
- `new_token()` / `token_ok(given, expected)`: a random URL token (`?token=...`), compared in constant time.
- `resolve_trace(value, root)`: the `trace` URL parameter as a directory inside the allowed root;
  absolute paths, `..` escapes and symlinks pointing outside are rejected with a readable message.
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


class AccessError(ValueError):
    """A request the dashboard refuses (bad token, trace outside the root); the message is shown in the app."""


def is_local(host: str) -> bool:
    return host in LOCAL_HOSTS


def new_token() -> str:
    return secrets.token_urlsafe(18)


def token_ok(given: str | bytes | None, expected: str | None) -> bool:
    """Whether a request's token matches (always true when no token is required)."""
    if expected is None:
        return True
    if given is None:
        return False
    if isinstance(given, bytes):
        given = given.decode("utf-8", errors="replace")
    return hmac.compare_digest(given.encode(), expected.encode())


def resolve_trace(value: str | bytes, root: str | Path) -> Path:
    """The trace directory named by a URL parameter, guaranteed to lie inside `root` (raises AccessError)."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if not value or "\x00" in value:
        raise AccessError("the trace parameter is empty or malformed")
    if len(value) > 1024:
        raise AccessError("the trace parameter is too long")
    base = Path(root).resolve()
    candidate = Path(value)
    if candidate.is_absolute():
        raise AccessError(f"trace {value!r} must be a path relative to the dashboard's trace root")
    resolved = (base / candidate).resolve()
    if resolved != base and base not in resolved.parents:
        raise AccessError(f"trace {value!r} is outside the dashboard's trace root; refused")
    return resolved
