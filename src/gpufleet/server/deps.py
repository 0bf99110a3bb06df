"""Request dependencies: the shared service and the caller, checked against a role."""

from __future__ import annotations

from dataclasses import dataclass

import anyio.to_thread
from anyio import CapacityLimiter
from fastapi import Request

from gpufleet.domain.models import Role
from gpufleet.errors import Forbidden
from gpufleet.server.access import Caller
from gpufleet.server.audit import AuditWriter
from gpufleet.server.auth import Auth, require
from gpufleet.server.event_ids import PLAIN, EventIds, Opaque
from gpufleet.server.events import Hub
from gpufleet.server.gate import SESSION_COOKIE
from gpufleet.server.holds import Credential, Holds
from gpufleet.server.notify import Notifier
from gpufleet.server.polls import Polls
from gpufleet.server.services import Services
from gpufleet.store import TokenRow


@dataclass
class ServerState:
    services: Services
    auth: Auth
    notifier: Notifier
    # Claims take the store's write path; on SQLite (one writer) more than one claim thread
    # at a time only adds lock and GIL contention, so they queue here instead.
    claim_limiter: CapacityLimiter
    audit: AuditWriter
    polls: Polls
    hub: Hub  # event streams
    holds: Holds  # what open streams and polls hold: ended when their token is revoked
    event_ids: Opaque  # the event ids a pool-scoped caller sees (its key loaded at start)
    metrics_public: bool = False  # /metrics without a token


def state(request: Request) -> ServerState:
    st: ServerState = request.app.state.gpufleet
    return st


def note(request: Request, target: str) -> None:
    """Name the object a call created or changed, for its audit record."""
    request.state.audit_target = target


CSRF_HEADER = "X-CSRF-Token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


async def _token(request: Request) -> TokenRow:
    """The caller's token: from ``Authorization: Bearer``, else from the dashboard's
    session cookie, whose state-changing calls must also carry the session's CSRF token.
    The abuse limits' gate (:mod:`gpufleet.server.gate`) has checked it already, from the
    headers, and left it in the request's state; it is checked here again only where no
    gate ran (an app built without it)."""
    auth, header = state(request).auth, request.headers.get("authorization")
    token: TokenRow | None = getattr(request.state, "token", None)
    cookie = request.cookies.get(SESSION_COOKIE)
    if header is None and cookie:
        if token is None:
            token = auth.session_cached(cookie)
        if token is None:
            token = await anyio.to_thread.run_sync(auth.session, cookie)
        if request.method not in SAFE_METHODS and not auth.csrf_ok(
            cookie, request.headers.get(CSRF_HEADER)
        ):
            request.state.caller = Caller(token)
            raise Forbidden(
                f"header {CSRF_HEADER}: missing or wrong; the dashboard sends its session's "
                "CSRF token with every change (reload the page)",
                detail={"field": f"header.{CSRF_HEADER}"},
            )
        return token
    if token is None:
        token = auth.check_cached(header)
    if token is None:  # a database read (or a wait for a pooled connection): off the loop
        token = await anyio.to_thread.run_sync(auth.check, header)
    return token


def event_ids(request: Request, caller: Caller) -> EventIds:
    """The event ids ``caller`` sees: the fleet's own numbers if it sees every pool,
    else opaque ones (:mod:`gpufleet.server.event_ids`)."""
    return PLAIN if caller.pools is None else state(request).event_ids


def credential(request: Request) -> Credential:
    """What the caller was let in with (after a role check passed): a stream or a poll
    holds it while it runs (:mod:`gpufleet.server.holds`). Worked out here, for those
    alone, not for every request (a digest of the token each time)."""
    header, cookie = request.headers.get("authorization"), request.cookies.get(SESSION_COOKIE)
    return state(request).auth.credential(header, cookie)


async def _caller(request: Request, *roles: Role) -> Caller:
    token = await _token(request)
    caller = Caller(token)
    request.state.caller = caller  # for the audit log, even when the role check refuses
    require(token, *roles)
    return caller


# The role checks are ``async def`` so FastAPI runs them on the loop: a cached token check
# costs microseconds, far less than a hop to the thread pool (claims are the hot path).
# A token that is not cached (a new one, or a wrong one) is read in a thread, so a burst
# of wrong tokens never stalls the loop on the database.


async def anyone(request: Request) -> Caller:
    """Any valid token."""
    return await _caller(request, Role.OPERATOR, Role.SUBMITTER, Role.WORKER)


async def reader(request: Request) -> Caller:
    """Clients read the queue; a submitter sees only its pools (checked per object)."""
    return await _caller(request, Role.OPERATOR, Role.SUBMITTER)


# Submitting takes the same roles as reading (a submitter is scoped per object).
submitter = reader


async def operator(request: Request) -> Caller:
    return await _caller(request, Role.OPERATOR)


async def admin(request: Request) -> Caller:
    return await _caller(request)


async def worker(request: Request) -> Caller:
    return await _caller(request, Role.WORKER)


async def env_reader(request: Request) -> Caller:
    """Environment locks are read by workers (to build) and operators (to look)."""
    return await _caller(request, Role.OPERATOR, Role.WORKER)


async def blob_user(request: Request) -> Caller:
    """Blobs are read and written by clients (packages) and workers (artifacts)."""
    return await _caller(request, Role.OPERATOR, Role.SUBMITTER, Role.WORKER)
