"""The web dashboard: its page and static files (``/``, ``/ui/...``), and sign-in.

The page is plain HTML, CSS and JavaScript shipped in the package (``dashboard/``), with
uPlot vendored for the charts: no CDN, no build step. A user pastes a token once;
``POST /v1/session`` exchanges it for a session whose secret lives only in an HttpOnly,
SameSite=Strict cookie, so the token never sits in the page, a URL or browser storage.
Changes made through the cookie carry the session's CSRF token (see
:mod:`gpufleet.server.deps`); every answer carries a Content-Security-Policy that allows
no inline script (:class:`SecurityHeaders`).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpufleet.server import deps
from gpufleet.server.access import Caller
from gpufleet.server.deps import state
from gpufleet.server.gate import SESSION_COOKIE
from gpufleet.store import TokenRow
from gpufleet.wire import ERRORS, SessionCreate, SessionOut

DASHBOARD = Path(__file__).parent.parent / "dashboard"  # gpufleet/server/dashboard/
router = APIRouter(responses=ERRORS)
Reader = Annotated[Caller, Depends(deps.reader)]

CSP = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "font-src 'self'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]


# FastAPI's own API browser (Swagger UI, ReDoc) runs inline script from a CDN: its pages
# keep their defaults, and the rest of the server's answers get the policy.
API_BROWSER = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc"})


class SecurityHeaders:
    """ASGI middleware: every answer forbids inline script, framing and MIME sniffing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in API_BROWSER:
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS:
                    headers.setdefault(name.decode(), value.decode())
            await send(message)

        await self.app(scope, receive, with_headers)


def static_files() -> StaticFiles:
    return StaticFiles(directory=DASHBOARD)


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    """The dashboard's one page (it routes by the URL's fragment)."""
    return FileResponse(DASHBOARD / "index.html", headers={"Cache-Control": "no-cache"})


def _session_out(row: TokenRow, csrf: str | None, ends: float | None) -> SessionOut:
    return SessionOut(
        id=row.id,
        name=row.name,
        role=row.role,
        pools=list(row.pools),
        csrf=csrf,
        expires_at=datetime.fromtimestamp(ends, UTC) if ends is not None else None,
    )


async def _header_holds(request: Request) -> None:
    """A token in the Authorization header of a sign-in must hold too (checked before the
    body): the abuse limiter trusts a header that got a 2xx (server/limits.py), so a wrong
    one must not ride on a good token in the body."""
    header = request.headers.get("authorization")
    if header is not None:
        await run_in_threadpool(state(request).auth.check, header)


@router.post(
    "/v1/session",
    response_model=SessionOut,
    tags=["dashboard"],
    dependencies=[Depends(_header_holds)],
)
async def sign_in(body: SessionCreate, request: Request, response: Response) -> SessionOut:
    """Exchange a token (admin, operator or submitter) for a dashboard session: the answer
    sets an HttpOnly, SameSite=Strict cookie and gives the session's CSRF token."""
    auth = state(request).auth
    row, secret, ends = await run_in_threadpool(auth.sign_in, body.token)
    request.state.caller = Caller(row)
    response.set_cookie(
        SESSION_COOKIE,
        secret,
        max_age=max(1, int(ends - auth.clock())),
        path="/",
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )
    response.headers["Cache-Control"] = "no-store"
    return _session_out(row, auth.csrf(secret), ends)


@router.get("/v1/session", response_model=SessionOut, tags=["dashboard"])
async def session(request: Request, caller: Reader) -> SessionOut:
    """Who the dashboard is signed in as, and its CSRF token (none for a bearer token)."""
    cookie = request.cookies.get(SESSION_COOKIE)
    csrf = state(request).auth.csrf(cookie) if cookie else None
    return _session_out(caller.token, csrf, None)


@router.delete("/v1/session", status_code=204, tags=["dashboard"])
async def sign_out(request: Request, response: Response, _: Reader) -> None:
    """End the dashboard session: the cookie stops working here and on every server."""
    cookie = request.cookies.get(SESSION_COOKIE)
    if cookie:
        await run_in_threadpool(state(request).auth.sign_out, cookie)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
