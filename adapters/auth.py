"""Bearer keys at the HTTP edge, one way for every service (proxy, model server, analytics).
Pure: the standard library only.

    bearer_token(header) -> str | None       the token of ``Authorization: Bearer <token>``
    key_matches(token, keys) -> bool          constant-time match against the allowed keys
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

__all__ = ["bearer_token", "key_matches"]


def bearer_token(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, else None. The token may
    be any text (a non-ASCII one is simply not a valid token: 401 where it is checked)."""
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_matches(token: str | None, keys: Iterable[bytes]) -> bool:
    """Whether ``token`` is one of ``keys`` (compared in constant time; None matches none)."""
    if token is None:
        return False
    raw = token.encode()
    return any(hmac.compare_digest(raw, k) for k in keys)
