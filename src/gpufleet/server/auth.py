"""Bearer tokens: stored as SHA-256 hashes, shown once, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable

from gpufleet.domain.models import Role
from gpufleet.errors import Forbidden, NotFound, Unauthorized
from gpufleet.store import SqlStore, TokenRow

TOKEN_PREFIX = "gf_"
_CACHE_SECONDS = 2.0


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Auth:
    """Checks tokens against the store, with a short cache so claims stay cheap."""

    def __init__(self, store: SqlStore, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self._cache: dict[str, tuple[float, TokenRow]] = {}
        self._lock = threading.Lock()

    def create(self, name: str, role: Role, pool: str | None = None) -> tuple[TokenRow, str]:
        """Make a token; the secret is returned here and never again."""
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        values = {
            "id": "t-" + secrets.token_hex(6),
            "name": name,
            "role": role.value,
            "pool": pool,
            "hash": digest(secret),
            "created_at": self.clock(),
            "revoked_at": None,
        }
        self.store.insert_token(values)
        return TokenRow(**values), secret  # type: ignore[arg-type]

    def ensure_admin(self) -> str | None:
        """A fresh server's first admin token (the secret), or None if one exists."""
        if self.store.count_tokens(Role.ADMIN.value):
            return None
        return self.create("admin", Role.ADMIN)[1]

    def check(self, header: str | None) -> TokenRow:
        """The token row behind an ``Authorization: Bearer`` header, or Unauthorized."""
        if not header:
            raise Unauthorized(
                "missing token: send 'Authorization: Bearer <token>' "
                "(the CLI reads GPUFLEET_TOKEN or the token the local server saved)"
            )
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("malformed Authorization header: expected 'Bearer <token>'")
        want = digest(token.strip())
        row = self._lookup(want)
        if row is None or not hmac.compare_digest(row.hash, want) or row.revoked_at is not None:
            raise Unauthorized("invalid or revoked token")
        return row

    def _lookup(self, want: str) -> TokenRow | None:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(want)
        if hit and now - hit[0] < _CACHE_SECONDS:
            return hit[1]
        row = self.store.token_by_hash(want)
        if row is not None:
            with self._lock:
                self._cache[want] = (now, row)
        return row

    def revoke(self, token_id: str) -> None:
        if not self.store.revoke_token(token_id, self.clock()):
            raise NotFound(f"no active token {token_id!r}", detail={"token": token_id})
        with self._lock:
            self._cache.clear()


def require(row: TokenRow, *roles: Role) -> TokenRow:
    """Admins may do anything; everyone else needs one of ``roles``."""
    if row.role == Role.ADMIN.value or row.role in {r.value for r in roles}:
        return row
    allowed = ", ".join(r.value for r in (Role.ADMIN, *roles))
    raise Forbidden(f"a {row.role} token may not do this (needs: {allowed})")
