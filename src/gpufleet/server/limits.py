"""Abuse limits: one pure ASGI middleware in front of the whole app.

What it does, before the app sees the request:

* **The credential before the body.** Every route but the public ones (``/v1/health``,
  signing in, the dashboard's files) needs a bearer token or a dashboard session, checked
  from the headers (:class:`~gpufleet.server.gate.Gate`) before a byte of the body is read:
  a request without a valid one is answered 401 (and its connection closed when it came
  with a body, which is never read).
* **Failed-auth rate limiting.** Each request refused for its credential counts against
  the client's address as its headers arrive, and so does each sign-in (given back when
  it succeeds): a burst is counted whole, not only the answers already sent. More than
  ``failed_auth`` within ``failed_auth_window`` seconds and that address gets 429
  ``rate_limited`` (with ``Retry-After``) for one window, for sign-ins and for wrong
  credentials. A valid token or session is never refused for it: it is still checked,
  and passes (a worker behind the same NAT as a client stuck on a revoked token keeps
  running its jobs; a dashboard user is not locked out by someone else's typos).
* **Body size, by route.** A body over its route's limit is a 413 ``too_large``, from its
  ``Content-Length`` before a byte is read, or as soon as a chunked body passes the
  limit; nothing past the limit is kept. A worker's log batches take the most
  (``max_body``), a manifest less (``max_manifest_body``), every other JSON call
  ``max_json_body``, a sign-in ``max_sign_in_body``. The blob routes (``PUT
  /v1/blobs/...``, ``PATCH /v1/uploads/...``) stream and have their own limit
  (``--max-blob-size``).
* **JSON depth.** A body nested deeper than ``max_json_depth`` is a 422
  ``validation_error``, found by a bracket scan before anything parses it.
* **Concurrency.** At most ``claims_per_worker`` long-polls (``POST
  /v1/workers/{id}/claim``) at once per worker id, and ``requests_per_token`` requests at
  once per token (keyed by the token's id, however it was sent: header or session); more
  is a 429. Claims and blob transfers are long by design and have their own bounds, so
  they do not count against the token: a fleet sharing one worker token may poll and
  download on every worker at once. Event streams (SSE) are long too: at most
  ``streams_per_token`` at once per token, apart from the other requests.

Slow and oversized requests (headers, connections) are cut off below, in the HTTP
protocol itself (:mod:`gpufleet.server.connections`).

Every 413 and 429 is logged at most once per address per window, never with the token.
The limits hold per server process; everything runs on the event loop, so the tables need
no lock.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpufleet.domain.models import Role
from gpufleet.errors import Unauthorized
from gpufleet.server.asgi import StatusWatch
from gpufleet.server.audit import AuditWriter
from gpufleet.server.gate import SIGN_IN, Gate, Offer, needs_credential, offer
from gpufleet.server.json_depth import too_deep
from gpufleet.server.responses import error_response

log = logging.getLogger("gpufleet.server.limits")

HEALTH = "/v1/health"
#: Roles a worker may run as (a fresh server's local workers have a worker token of their
#: own; an admin may still run one with its token, given as GPUFLEET_TOKEN): only their
#: calls may carry a log batch's 16 MiB.
_BATCHERS = frozenset({Role.WORKER.value, Role.ADMIN.value})
_WORKERS, _CLAIM = "/v1/workers/", "/claim"


@dataclass(frozen=True)
class Limits:
    """The server's abuse limits (per server process). 0 turns a limit off."""

    #: More 401 answers than this to one address within the window: 429 for a window.
    failed_auth: int = 20
    failed_auth_window: float = 60.0
    #: Addresses, and known-good token hashes, remembered at most (oldest dropped first).
    max_tracked: int = 10_000
    #: Bytes of a worker's log batch (``/v1/reports``, ``/v1/jobs/{id}/output``), the
    #: largest JSON body: 2M characters of output, JSON-escaped (6 bytes at worst each).
    max_body: int = 16 << 20
    #: Bytes of a manifest (``POST /v1/manifests``): a plan of many jobs.
    max_manifest_body: int = 8 << 20
    #: Bytes of any other JSON body (a submit, a claim, a token...).
    max_json_body: int = 1 << 20
    #: Bytes of a sign-in: a token, read before anyone is known.
    max_sign_in_body: int = 8 << 10
    #: Nesting of arrays and objects in a JSON body.
    max_json_depth: int = 32
    #: Long-polls at once per worker id: one, plus one left over from a cut connection.
    claims_per_worker: int = 2
    #: Requests at once per token, claims, blob transfers and event streams aside.
    requests_per_token: int = 64
    #: Event streams (``GET /v1/events``, ``/v1/jobs/{ref}/events``) open at once per token.
    streams_per_token: int = 1000
    #: Bytes of a request's line and headers: more is a 431 (server/connections.py).
    max_header_bytes: int = 64 << 10
    #: Seconds a client may take to send a request's line and headers, from its first
    #: byte (or its connection); then the connection is closed.
    header_timeout: float = 10.0
    #: Seconds a request's body may stall (no byte while the server waits for one).
    body_timeout: float = 60.0
    #: Connections open at once from one address, and in all (uvicorn's
    #: ``limit_concurrency``: a request beyond it is answered 503).
    connections_per_address: int = 1024
    max_connections: int = 8192
    #: Seconds an idle kept-alive connection stays open.
    keep_alive: int = 5
    #: Reverse proxies whose ``X-Forwarded-For`` is believed, and whose connections (their
    #: clients') are not counted per address: addresses or networks. None by default: a
    #: process on the server's own host (a job, say) could claim any address.
    trusted_proxies: tuple[str, ...] = ()
    #: Seconds, monotonic; tests pass a fake to move the window without sleeping.
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)


def address_key(address: str) -> str:
    """What a client's address counts as for the per-address limits: itself, or for IPv6
    its /64 (whoever holds one address of a /64 usually holds all of it)."""
    if ":" not in address:
        return address
    try:
        return str(ipaddress.IPv6Network(f"{address}/64", strict=False))
    except ValueError:
        return address


def trusts(proxies: tuple[str, ...], address: str) -> bool:
    """Whether ``address`` is one of the trusted ``proxies`` (addresses or networks)."""
    if not proxies:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in ipaddress.ip_network(p, strict=False) for p in proxies)


# ---- tables -------------------------------------------------------------------------------


class _Strikes:
    """Failed token checks per address, in fixed windows; an address over the limit is
    refused for one window from the strike that tripped it. Bounded: the address least
    recently struck is forgotten first."""

    def __init__(self, limit: int, window: float, cap: int) -> None:
        self.limit, self.window, self.cap = limit, window, cap
        # address -> [window start, strikes in it, refused until]
        self._seen: OrderedDict[str, list[float]] = OrderedDict()

    def refused_for(self, address: str, clock: Callable[[], float]) -> float:
        """Seconds this address is still refused; 0 when it is not."""
        entry = self._seen.get(address)
        if entry is None:
            return 0.0  # the usual case: no clock read
        return max(0.0, entry[2] - clock())

    def strike(self, address: str, now: float) -> bool:
        """Count a 401; True when this one trips the limit."""
        entry = self._seen.get(address)
        if entry is None or (now - entry[0] >= self.window and entry[2] <= now):
            entry = self._seen[address] = [now, 0, 0.0]
        self._seen.move_to_end(address)
        while len(self._seen) > self.cap:
            self._seen.popitem(last=False)
        entry[1] += 1
        if entry[1] > self.limit and entry[2] <= now:
            entry[2] = now + self.window
            return True
        return False

    def forgive(self, address: str) -> None:
        """Take one strike back (a sign-in counted as it arrived, that succeeded)."""
        entry = self._seen.get(address)
        if entry is not None and entry[1] > 0:
            entry[1] -= 1


class _Slots:
    """Requests in flight per key; a key with none is dropped, so the table stays as small
    as the number of requests running."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held: dict[Any, int] = {}

    def take(self, key: Any) -> bool:
        n = self.held.get(key, 0)
        if n >= self.cap:
            return False
        self.held[key] = n + 1
        return True

    def give(self, key: Any) -> None:
        n = self.held[key] - 1
        if n:
            self.held[key] = n
        else:
            del self.held[key]


class _Quiet:
    """At most one log line per address per window; bounded like :class:`_Strikes`."""

    def __init__(self, window: float, cap: int) -> None:
        self.window, self.cap = window, cap
        self._last: OrderedDict[str, float] = OrderedDict()

    def first(self, address: str, now: float) -> bool:
        last = self._last.get(address)
        if last is not None and now - last < self.window:
            return False
        self._last[address] = now
        self._last.move_to_end(address)
        while len(self._last) > self.cap:
            self._last.popitem(last=False)
        return True


# ---- the middleware -----------------------------------------------------------------------


@dataclass(slots=True)
class _Refusal:
    status: int
    code: str
    message: str
    detail: Any = None
    retry_after: float | None = None


@dataclass(slots=True)
class _Call:
    """What the limits need to know about one request, read from its scope once."""

    address: str
    offer: Offer | None  # the token or session it offers, from its headers
    length: int | None
    has_body: bool
    body_limit: int  # bytes; 0: none here (a blob transfer, streamed and limited elsewhere)
    claim_of: str | None  # the worker id, for a long-poll claim
    transfer: bool  # a blob upload or download: streamed, limited elsewhere
    stream: bool  # an event stream: long, counted apart
    sign_in: bool
    guarded: bool  # it needs a valid credential
    token_id: str | None = None  # the caller's token, once the gate knows it


class LimitsMiddleware:
    """Applies :class:`Limits` to every HTTP request (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        limits: Limits | None = None,
        gate: Gate | None = None,
        audit: AuditWriter | None = None,
        metrics_public: bool = False,
    ) -> None:
        self.app = app
        self.limits = limits = limits or Limits()
        self.gate, self.audit, self.metrics_public = gate, audit, metrics_public
        window = limits.failed_auth_window or 60.0
        self._strikes = _Strikes(limits.failed_auth, window, limits.max_tracked)
        self._claims = _Slots(limits.claims_per_worker)
        self._tokens = _Slots(limits.requests_per_token)
        self._streams = _Slots(limits.streams_per_token)
        self._quiet = _Quiet(window, limits.max_tracked)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == HEALTH:
            await self.app(scope, receive, send)
            return
        call = self._call(scope)
        refusal = self._sign_in(call) if call.sign_in else None
        if refusal is None and call.guarded and self.gate is not None:
            refusal = await self._identify(call, scope)
        if refusal is None and call.has_body and call.body_limit:
            refusal, replay = await self._checked_body(call, receive)
            if replay is None:
                return  # the client left while sending: nobody to answer
            receive = replay
        if refusal is not None:
            await self._refuse(refusal, call, scope, receive, send)
            return
        await self._run(call, scope, receive, send)

    def _call(self, scope: Scope) -> _Call:
        length = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = int(value) if value.isdigit() else None
            elif name == b"transfer-encoding":
                chunked = True
        client = scope.get("client")
        method, path = scope["method"], scope["path"]
        claim_of = None
        if method == "POST" and path.startswith(_WORKERS) and path.endswith(_CLAIM):
            worker = path[len(_WORKERS) : -len(_CLAIM)]
            claim_of = worker if worker and "/" not in worker else None
        transfer = _is_transfer(method, path)
        guarded = needs_credential(method, path, self.metrics_public)
        sign_in = (method, path) == SIGN_IN
        return _Call(
            address=address_key(client[0]) if client else "-",
            offer=offer(scope),
            length=length,
            has_body=chunked or bool(length),
            body_limit=0
            if transfer or not (guarded or sign_in)
            else self._body_limit(method, path),
            claim_of=claim_of,
            transfer=transfer,
            stream=method == "GET" and path.startswith("/v1/") and path.endswith("/events"),
            sign_in=sign_in,
            guarded=guarded,
        )

    def _body_limit(self, method: str, path: str) -> int:
        limits = self.limits
        if (method, path) == SIGN_IN:
            return limits.max_sign_in_body
        if path == "/v1/reports" or (path.startswith("/v1/jobs/") and path.endswith("/output")):
            return limits.max_body
        if path == "/v1/manifests":
            return limits.max_manifest_body
        return limits.max_json_body

    def _locked_out(self, call: _Call) -> _Refusal | None:
        if not self.limits.failed_auth:
            return None
        wait = self._strikes.refused_for(call.address, self.limits.clock)
        if not wait:
            return None
        window = self._strikes.window
        return _Refusal(
            429,
            "rate_limited",
            f"too many requests with a missing or wrong token from {call.address} (more than "
            f"{self.limits.failed_auth} in {window:g} s); try again in {math.ceil(wait)} s "
            "with a valid token",
            {"address": call.address, "retry_after": math.ceil(wait)},
            wait,
        )

    def _strike(self, call: _Call) -> None:
        if self.limits.failed_auth and self._strikes.strike(call.address, self.limits.clock()):
            log.warning(
                "refusing %s for %g s: more than %d failed token checks",
                call.address,
                self._strikes.window,
                self.limits.failed_auth,
            )
            self._quiet.first(call.address, self.limits.clock())  # that line says it

    def _sign_in(self, call: _Call) -> _Refusal | None:
        """A sign-in counts as a strike as it arrives (given back if it succeeds): a burst
        of them is refused past the limit, however many are in flight."""
        refusal = self._locked_out(call)
        if refusal is None:
            self._strike(call)
        return refusal

    async def _identify(self, call: _Call, scope: Scope) -> _Refusal | None:
        """Check the credential from the headers; a refusal (401, or 429 for an address
        locked out) when it does not hold. A valid one passes even then."""
        assert self.gate is not None
        try:
            token = await self.gate.identify(call.offer)
        except Unauthorized as exc:
            locked = self._locked_out(call)
            if locked is not None:
                return locked
            self._strike(call)
            if self.audit is not None:
                self.audit.refused(scope, 401)
            return _Refusal(401, exc.code, exc.message)
        scope.setdefault("state", {})["token"] = token
        call.token_id = token.id
        if token.role not in _BATCHERS and call.body_limit == self.limits.max_body:
            call.body_limit = self.limits.max_json_body  # log batches come from workers
        return None

    async def _checked_body(
        self, call: _Call, receive: Receive
    ) -> tuple[_Refusal | None, Receive | None]:
        """Read the body (up to the limit) and check its size and depth; a receive that
        hands the app the body again."""
        limit = call.body_limit
        if call.length is not None and call.length > limit:
            return _too_large(limit, call.length), receive
        try:
            body = await _read_body(receive, limit)
        except _OverLimit:
            return _too_large(limit, call.length), receive
        if body is None:
            return None, None
        depth = self.limits.max_json_depth
        if depth and too_deep(body, depth):
            return _too_deep(depth), receive
        return None, _replay(body, receive)

    async def _run(self, call: _Call, scope: Scope, receive: Receive, send: Send) -> None:
        slots, limit = self._counted_in(call)
        token = call.token_id if limit else None
        if token is not None and not slots.take(token):
            await self._refuse(_busy_token(limit, call.stream), call, scope, receive, send)
            return
        try:
            await self._run_claim(call, scope, receive, send)
        finally:
            if token is not None:
                slots.give(token)

    def _counted_in(self, call: _Call) -> tuple[_Slots, int]:
        """The per-token count a call takes a place in, and its limit (0: none). Claims
        and blob transfers have bounds of their own; event streams are counted apart."""
        if call.stream:
            return self._streams, self.limits.streams_per_token
        if call.claim_of is not None or call.transfer:
            return self._tokens, 0
        return self._tokens, self.limits.requests_per_token

    async def _run_claim(self, call: _Call, scope: Scope, receive: Receive, send: Send) -> None:
        worker = call.claim_of if self.limits.claims_per_worker else None
        if worker is not None and not self._claims.take(worker):
            refusal = _busy_worker(worker, self.limits.claims_per_worker)
            await self._refuse(refusal, call, scope, receive, send)
            return
        watch = StatusWatch(send)
        try:
            await self.app(scope, receive, watch)
        finally:
            if worker is not None:
                self._claims.give(worker)
            self._account(call, watch.status)

    def _account(self, call: _Call, status: int) -> None:
        """Learn from the answer: a sign-in that succeeded gives its strike back; a 401
        the app gave (a credential that stopped holding since the gate) is a strike."""
        if call.sign_in:
            if 200 <= status < 300:
                self._strikes.forgive(call.address)
        elif status == 401:
            self._strike(call)

    async def _refuse(
        self, refusal: _Refusal, call: _Call, scope: Scope, receive: Receive, send: Send
    ) -> None:
        if refusal.status != 401 and self._quiet.first(call.address, self.limits.clock()):
            log.warning(
                "%d %s for %s %s from %s (further refusals of this address are not logged "
                "for %g s)",
                refusal.status,
                refusal.code,
                scope["method"],
                scope["path"],
                call.address,
                self._quiet.window,
            )
        headers = {}
        if call.has_body and refusal.status in (401, 413, 429):
            headers["Connection"] = "close"  # its body is not read: the connection ends
        if refusal.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(refusal.retry_after)))
        answer = error_response(
            refusal.status, refusal.code, refusal.message, refusal.detail, headers
        )
        await answer(scope, receive, send)


# ---- helpers ------------------------------------------------------------------------------


class _OverLimit(Exception):
    """A streamed body passed the limit; the rest of it is never read."""


def _is_transfer(method: str, path: str) -> bool:
    """Blob bodies, up and down: streamed, and bounded by ``--max-blob-size``."""
    if path.startswith("/v1/blobs/"):
        return method in ("PUT", "GET", "HEAD")
    return method == "PATCH" and path.startswith("/v1/uploads/")


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None when the client disconnects first; raises
    :class:`_OverLimit` as soon as it passes ``limit``."""
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk: bytes = message.get("body", b"")
        total += len(chunk)
        if limit and total > limit:
            raise _OverLimit
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives ``body`` first, then whatever the server sends (a disconnect)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _too_large(limit: int, length: int | None) -> _Refusal:
    size = f" ({length} bytes)" if length is not None else ""
    return _Refusal(
        413,
        "too_large",
        f"request body{size} is over the server's limit of {limit} bytes for a JSON "
        "request; send files as blobs (`gpufleet blobs put`, or --package)",
        {"limit": limit, "content_length": length},
    )


def _too_deep(limit: int) -> _Refusal:
    problem = f"JSON nested deeper than {limit} levels (arrays and objects)"
    return _Refusal(
        422,
        "validation_error",
        f"invalid request: body: {problem}",
        [{"field": "body", "problem": problem}],
    )


def _busy_worker(worker: str, cap: int) -> _Refusal:
    return _Refusal(
        429,
        "rate_limited",
        f"worker {worker!r} already has {cap} claims waiting (the limit per worker); is a "
        "second agent running under the same worker id?",
        {"worker": worker, "limit": cap, "retry_after": 1},
        1,
    )


def _busy_token(limit: int, stream: bool = False) -> _Refusal:
    what = "event streams" if stream else "requests"
    return _Refusal(
        429,
        "rate_limited",
        f"{limit} {what} with this token are already running (the limit per token); "
        "wait for some to finish and send fewer at once",
        {"limit": limit, "retry_after": 1},
        1,
    )
