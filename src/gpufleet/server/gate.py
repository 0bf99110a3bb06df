"""Who is calling, from the request's headers alone, before a byte of its body is read.

Every route but a few public ones needs a credential: a bearer token, or the dashboard's
session cookie. :class:`Gate` checks it as the headers arrive, so a stranger's request is
answered 401 without its body being read or parsed: a body costs the server nothing until
its sender has proved who it is. The route's own role check then finds the caller already
known (``scope["state"]["token"]``, see :mod:`gpufleet.server.deps`).

A credential this process checked lately is answered from the token cache, with no
thread and no database. One it has not is read from the database in a thread, at most
``LOOKUPS`` at a time, so a flood of wrong tokens cannot take the thread pool the routes
run in. A header or cookie that was refused is remembered, whole, with why (a secret is
256 random bits: no token created later can have it; a revoked, rotated or expired one
stays refused), so the same wrong credential sent again costs a dictionary lookup. The
whole header is the key: ``Token X`` refused as malformed says nothing of ``Bearer X``.

What this module sees is what the request *offers* (:class:`Offer`); what a request was
let in with, by digest, is :class:`gpufleet.server.holds.Credential`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import anyio.to_thread
from anyio import CapacityLimiter
from starlette.requests import cookie_parser
from starlette.types import Scope

from gpufleet.errors import Unauthorized
from gpufleet.server.auth import Auth, digest
from gpufleet.store import TokenRow

SESSION_COOKIE = "gpufleet_session"
#: Routes answered without a credential: the health check, and signing in (its body holds
#: the token, checked by the route; the abuse limits count every try as it arrives).
PUBLIC = frozenset({("GET", "/v1/health"), ("HEAD", "/v1/health"), ("POST", "/v1/session")})
SIGN_IN = ("POST", "/v1/session")
LOOKUPS = 8  # credentials read from the database at once (those not cached)
MISSES = 10_000  # wrong digests remembered


def needs_credential(method: str, path: str, metrics_public: bool) -> bool:
    """Whether a request must prove who it is before it is read: every ``/v1`` route but
    the public ones, and ``/metrics`` unless the server serves it to anyone. The
    dashboard's page and files, and the API's description, are public."""
    if path.startswith("/v1/"):
        return (method, path) not in PUBLIC
    if path == "/metrics":
        return not metrics_public
    return False


@dataclass(frozen=True, slots=True)
class Offer:
    """What a request offers to prove who it is: an ``Authorization`` header, or else the
    dashboard's session cookie."""

    kind: Literal["bearer", "session"]
    value: str

    @property
    def key(self) -> str:
        """What a refusal is remembered by: the digest of the whole header (so "Token X",
        refused as malformed, never refuses "Bearer X"), or of the session's secret."""
        return f"{self.kind}:{digest(self.value.strip())}"


def offer(scope: Scope) -> Offer | None:
    """The request's credential, from its headers (the header wins over the cookie, as in
    the routes' own check); None when it has neither."""
    cookies = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            return Offer("bearer", value.decode("latin-1"))
        if name == b"cookie":
            cookies = value.decode("latin-1")
    if cookies:
        secret = cookie_parser(cookies).get(SESSION_COOKIE)
        if secret:
            return Offer("session", secret)
    return None


class Gate:
    """Checks credentials for the abuse limits' middleware (see the module's text)."""

    def __init__(self, auth: Auth) -> None:
        self.auth = auth
        self._lookups = CapacityLimiter(LOOKUPS)
        self._misses: OrderedDict[str, str] = OrderedDict()  # digest -> why

    async def identify(self, cred: Offer | None) -> TokenRow:
        """The token behind ``cred``, or Unauthorized saying why."""
        if cred is None:
            self.auth.check(None)  # raises the message that says how to send a token
        assert cred is not None
        try:
            cached = self._cached(cred)
            if cached is not None:
                return cached
            refused = self._misses.get(cred.key)
            if refused is not None:
                raise Unauthorized(refused)
            return await anyio.to_thread.run_sync(self._read, cred, limiter=self._lookups)
        except Unauthorized as exc:
            self._missed(cred, exc.message)
            raise

    def _cached(self, cred: Offer) -> TokenRow | None:
        if cred.kind == "bearer":
            return self.auth.check_cached(cred.value)
        return self.auth.session_cached(cred.value)

    def _read(self, cred: Offer) -> TokenRow:
        if cred.kind == "bearer":
            return self.auth.check(cred.value)
        return self.auth.session(cred.value)

    def _missed(self, cred: Offer, why: str) -> None:
        """Remember a refused digest and why: unknown, revoked, rotated away, expired or
        signed out, it is refused for good."""
        misses = self._misses
        misses[cred.key] = why
        misses.move_to_end(cred.key)
        while len(misses) > MISSES:
            misses.popitem(last=False)
