"""Who is calling: bearer tokens (made by `lmforge jobs token create`, stored hashed) and the per-user
token bucket that limits job creation.

A token reads `lmf_<id>_<secret>`: the id (public, 12 hex digits) finds the row, the secret (32 random
bytes) is checked against its stored SHA-256 with a constant-time compare. A leaked database therefore
yields no usable token, and a wrong secret takes as long to refuse as a nearly right one.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import threading
import time
from dataclasses import dataclass

from lmforge.errors import LmforgeError
from lmforge.jobserver.store import Store

USER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TOKEN_RE = re.compile(r"^lmf_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("ascii")).hexdigest()


def check_user(user: str) -> str:
    """`user`, if it is a valid user name (letters, digits, '.', '_', '-'; at most 64)."""
    if not USER_RE.match(user or ""):
        raise LmforgeError(f"--user {user!r}: a user name is 1-64 letters, digits, '.', '_' or '-', starting "
                           "with a letter or digit")
    return user


def create_token(store: Store, user: str) -> str:
    """A new token for `user`; only its hash is kept, so this is the one time it can be shown."""
    check_user(user)
    token_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    store.add_token(token_id, user, _digest(secret))
    return f"lmf_{token_id}_{secret}"


def revoke_token(store: Store, token_id: str) -> None:
    """Revoke by id (or by the whole token: its id part is used)."""
    m = _TOKEN_RE.match(token_id)
    token_id = m.group(1) if m else token_id
    if not store.revoke_token(token_id):
        raise LmforgeError(f"no active token with id {token_id!r}; `lmforge jobs token list` shows them")


def authenticate(store: Store, header: str | None) -> str | None:
    """The user an `Authorization: Bearer ...` header proves, or None."""
    if not header or not header.startswith("Bearer "):
        return None
    m = _TOKEN_RE.match(header[7:].strip())
    # An unknown id still costs a digest and a compare, so ids cannot be told apart by timing.
    row = store.token(m.group(1)) if m else None
    want = row["hash"] if row is not None else "0" * 64
    ok = hmac.compare_digest(_digest(m.group(2) if m else ""), want)
    if not ok or row is None or row["revoked_at"] is not None:
        return None
    return row["user"]


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """A token bucket per user: `burst` jobs at once, refilled at `per_minute` per minute."""

    def __init__(self, per_minute: float, burst: int) -> None:
        if not (isinstance(per_minute, (int, float)) and math.isfinite(per_minute) and per_minute >= 0):
            raise ValueError(f"jobs_per_minute={per_minute!r}: give a finite number >= 0 (0: unlimited)")
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ValueError(f"job_burst={burst!r}: give a whole number >= 1")
        self.rate, self.burst = per_minute / 60.0, float(burst)
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def take(self, user: str) -> float:
        """0 if `user` may go ahead (a token is spent), else the seconds until a token is back."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            b = self._buckets.setdefault(user, _Bucket(self.burst, now))
            b.tokens = min(self.burst, b.tokens + (now - b.at) * self.rate)
            b.at = now
            if b.tokens >= 1.0:
                b.tokens -= 1.0
                return 0.0
            return (1.0 - b.tokens) / self.rate
