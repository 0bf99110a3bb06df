"""Bearer tokens: stored as SHA-256 hashes, shown once, compared in constant time.

A token is ``gf_`` and 43 random URL-safe characters (256 bits). The server keeps its
SHA-256 and its first seven characters (the hint ``tokens ls`` shows), never the secret.
Rotating gives the same token id a new secret; the old one fails at once: this process
drops its short lookup cache, and on PostgreSQL a NOTIFY tells the other replicas to drop
theirs (should that message be lost, their cache expires within ``CACHE_SECONDS``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable

from gpufleet.domain.models import Role
from gpufleet.errors import Forbidden, NotFound, Unauthorized, ValidationFailed
from gpufleet.server.access import DEFAULT_POOL, check_pools
from gpufleet.server.holds import Credential
from gpufleet.store import AccessStore, TokenRow

log = logging.getLogger("gpufleet.server")
TOKEN_PREFIX = "gf_"
HINT = 7  # characters of the secret kept to tell tokens apart: the prefix and 4 more
CACHE_SECONDS = 2.0
SESSION_PREFIX = "gs_"
SESSION_SECONDS = 12 * 3600  # a dashboard sign-in lasts a working day
SESSION_KEY = "session:"  # a session's entry in the lookup cache (beside token digests)
LOCAL_WORKER = "local-worker"  # the token a server makes for its own machine's workers


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Auth:
    """Checks tokens against the store, with a short cache so claims stay cheap."""

    def __init__(
        self,
        store: AccessStore,
        clock: Callable[[], float] = time.time,
        cache_seconds: float = CACHE_SECONDS,
    ) -> None:
        self.cache_seconds = cache_seconds
        self._generation = 0
        self.store = store
        self.clock = clock
        self._cache: dict[str, tuple[float, TokenRow]] = {}
        self._lock = threading.Lock()
        # Called after every change of a token or session (here or on another replica).
        self.on_forget: list[Callable[[], None]] = []

    def create(
        self,
        name: str,
        role: Role,
        pools: list[str] | None = None,
        expires_at: float | None = None,
        labels: dict[str, str] | None = None,
    ) -> tuple[TokenRow, str]:
        """Make a token; the secret is returned here and never again. ``pools`` are checked
        against the role (a worker token has one, a submitter's default to ``default``, an
        operator's are its scope (none: every pool), an admin has none). ``labels`` (worker
        tokens) are fixed on every worker the token enrolls."""
        pools = check_pools(role, list(pools or []))
        if labels and role != Role.WORKER:
            raise ValidationFailed(
                "labels: only a worker token fixes labels", detail={"field": "labels"}
            )
        secret = _secret()
        values = {
            "id": "t-" + secrets.token_hex(6),
            "name": name,
            "role": role.value,
            "pool": ",".join(pools) if pools else None,
            "hash": digest(secret),
            "created_at": self.clock(),
            "revoked_at": None,
            "expires_at": expires_at,
            "hint": secret[:HINT],
            "labels": json.dumps(labels or {}),
        }
        self.store.insert_token(values)
        row = self.store.get_token(str(values["id"]))
        assert row is not None
        return row, secret

    def rotate(self, token_id: str) -> tuple[TokenRow, str]:
        """A new secret for an active token; the old secret stops working now."""
        secret = _secret()
        if not self.store.rotate_token(token_id, digest(secret), secret[:HINT]):
            raise NotFound(f"no active token {token_id!r}", detail={"token": token_id})
        self._forget()
        row = self.store.get_token(token_id)
        assert row is not None
        return row, secret

    def ensure_admin(self) -> str | None:
        """A fresh server's first admin token (the secret), or None if one exists."""
        if self.store.count_tokens(Role.ADMIN.value):
            return None
        return self.create("admin", Role.ADMIN)[1]

    def local_worker(self, saved: str | None, admin: str | None) -> str | None:
        """A new worker token for the workers of the server's own machine (the secret),
        or None: when the one saved there (``saved``) still works, or when the admin
        token saved there (``admin``) is not this server's (that machine's credentials
        are for another server, which makes its own). A worker that runs with it may act
        only as a worker of the default pool, whatever its jobs do. Made once: a server
        that has one (revoked or rotated by an admin too) never makes another, so a
        revoke lasts."""
        if saved and self._role_of(saved) == Role.WORKER.value:
            return None
        if any(row.name == LOCAL_WORKER for row in self.store.list_tokens()):
            return None
        if not admin or self._role_of(admin) != Role.ADMIN.value:
            return None
        return self.create(LOCAL_WORKER, Role.WORKER, pools=[DEFAULT_POOL])[1]

    def _role_of(self, secret: str) -> str | None:
        try:
            return self.check(f"Bearer {secret}").role
        except Unauthorized:
            return None

    def check(self, header: str | None) -> TokenRow:
        """The token row behind an ``Authorization: Bearer`` header, or Unauthorized."""
        want = self._wanted(header)
        return self._valid(want, self._lookup(want))

    def check_cached(self, header: str | None) -> TokenRow | None:
        """:meth:`check` if it needs no database read; None if it does (a token not seen
        lately, or a wrong one): the caller then runs :meth:`check` off the event loop."""
        want = self._wanted(header)
        row = self._cached(want)
        return None if row is None else self._valid(want, row)

    @staticmethod
    def _wanted(header: str | None) -> str:
        """The digest of the header's token; Unauthorized if there is none."""
        if not header:
            raise Unauthorized(
                "missing token: send 'Authorization: Bearer <token>' "
                "(the CLI reads GPUFLEET_TOKEN or the token the local server saved)"
            )
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("malformed Authorization header: expected 'Bearer <token>'")
        return digest(token.strip())

    # ---- dashboard sessions ---------------------------------------------------------------

    def sign_in(self, token: str) -> tuple[TokenRow, str, float]:
        """Exchange a client token for a dashboard session: the token's row, the session
        secret (for an HttpOnly cookie; the server keeps its hash) and when it ends (a
        working day, or the token's own expiry if sooner). Worker tokens may not."""
        row = self.check(f"Bearer {token.strip()}")
        if row.role == Role.WORKER.value:
            raise Forbidden("a worker token may not sign in to the dashboard")
        now = self.clock()
        ends = now + SESSION_SECONDS
        if row.expires_at is not None:
            ends = min(ends, row.expires_at)
        secret = SESSION_PREFIX + secrets.token_urlsafe(32)
        values = {
            "hash": digest(secret),
            "token_id": row.id,
            "token_hash": row.hash,
            "created_at": now,
            "expires_at": ends,
        }
        self.store.insert_session(values, now)
        return row, secret, ends

    def session(self, secret: str) -> TokenRow:
        """The token behind a dashboard session cookie, or Unauthorized (unknown, ended,
        signed out, or its token revoked, rotated or expired)."""
        return self._session(digest(secret))

    def _session(self, key: str) -> TokenRow:
        row = self._cached(SESSION_KEY + key)
        if row is None:
            with self._lock:
                generation = self._generation
            row = self.store.session_token(key, self.clock())
            if row is None:
                raise Unauthorized("your dashboard session has ended: sign in again")
            with self._lock:
                if generation == self._generation:
                    self._cache[SESSION_KEY + key] = (time.monotonic(), row)
        return self._live(row)

    def session_cached(self, secret: str) -> TokenRow | None:
        """:meth:`session` when it needs no database read, else None."""
        row = self._cached(SESSION_KEY + digest(secret))
        return None if row is None else self._live(row)

    @staticmethod
    def credential(header: str | None, cookie: str | None) -> Credential:
        """What a request that was let in came with: its bearer token, else its session."""
        if header is None and cookie:
            return Credential("session", digest(cookie))
        return Credential("bearer", Auth._wanted(header))

    def valid(self, credential: Credential) -> bool:
        """Whether ``credential`` still lets its holder in (read from the store unless
        cached since the last change of a token)."""
        try:
            if credential.kind == "session":
                self._session(credential.digest)
            else:
                self._valid(credential.digest, self._lookup(credential.digest))
        except Unauthorized:
            return False
        return True

    def sign_out(self, secret: str) -> None:
        self.store.delete_session(digest(secret))
        self._forget()

    @staticmethod
    def csrf(secret: str) -> str:
        """The CSRF token of a session: derived from its secret, which only the HttpOnly
        cookie holds, so a page elsewhere can neither read nor compute it."""
        return hashlib.sha256(f"csrf:{secret}".encode()).hexdigest()[:32]

    @classmethod
    def csrf_ok(cls, secret: str, sent: str | None) -> bool:
        return sent is not None and hmac.compare_digest(cls.csrf(secret), sent.strip())

    def _valid(self, want: str, row: TokenRow | None) -> TokenRow:
        if row is None or not hmac.compare_digest(row.hash, want):
            raise Unauthorized("invalid or revoked token")
        return self._live(row)

    def _live(self, row: TokenRow) -> TokenRow:
        if row.revoked_at is not None:
            raise Unauthorized("invalid or revoked token")
        if row.expires_at is not None and row.expires_at <= self.clock():
            raise Unauthorized(
                f"token {row.id} ({row.name}) has expired; ask an admin for a new one"
            )
        return row

    def _cached(self, want: str) -> TokenRow | None:
        """The token row read lately for this digest, if it is still fresh."""
        with self._lock:
            hit = self._cache.get(want)
        return hit[1] if hit and time.monotonic() - hit[0] < self.cache_seconds else None

    def _lookup(self, want: str) -> TokenRow | None:
        row = self._cached(want)
        if row is not None:
            return row
        now = time.monotonic()
        with self._lock:
            generation = self._generation
        row = self.store.token_by_hash(want)
        with self._lock:
            # A rotate or revoke that happened while we read must not be undone by
            # caching what we read before it.
            if row is not None and generation == self._generation:
                self._cache[want] = (now, row)
        return row

    def revoke(self, token_id: str) -> TokenRow:
        if not self.store.revoke_token(token_id, self.clock()):
            raise NotFound(f"no active token {token_id!r}", detail={"token": token_id})
        self._forget()
        row = self.store.get_token(token_id)
        assert row is not None
        return row

    def _forget(self) -> None:
        self.forget()
        try:
            self.store.publish_tokens_changed()
        except Exception:  # the change is committed; other replicas' caches still expire
            log.exception("could not tell other replicas that a token changed")

    def forget(self) -> None:
        """Drop every cached token (another replica rotated or revoked one)."""
        with self._lock:
            self._cache.clear()
            self._generation += 1
        for callback in self.on_forget:
            callback()


def _secret() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def require(row: TokenRow, *roles: Role) -> TokenRow:
    """Admins may do anything; everyone else needs one of ``roles``."""
    if row.role == Role.ADMIN.value or row.role in {r.value for r in roles}:
        return row
    allowed = ", ".join(r.value for r in (Role.ADMIN, *roles))
    raise Forbidden(f"a {row.role} token may not do this (needs: {allowed})")
