"""A NUL character in a request's path or query is refused with a 422 before any route
runs. SQLite stores it; PostgreSQL cannot hold it in a text value and fails the query
(which answered 500), so on both databases such a reference now gets the same clear
answer, naming where the character was."""

from __future__ import annotations

from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send

from gpufleet.server.responses import error_response


class RefuseNul:
    """ASGI middleware: 422 for a NUL in the path or in a query parameter."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        where = _nul_at(scope) if scope["type"] == "http" else None
        if where is None:
            await self.app(scope, receive, send)
            return
        message = f"{where}: a NUL character (\\x00) is not allowed"
        answer = error_response(422, "validation_error", message, {"field": where})
        await answer(scope, receive, send)


def _nul_at(scope: Scope) -> str | None:
    """Where a NUL is: ``path``, or ``query.NAME``; None if nowhere."""
    if "\x00" in scope["path"]:
        return "path"
    raw = scope.get("query_string", b"").decode("latin-1")
    if "%00" not in raw and "\x00" not in raw:
        return None
    for name, value in parse_qsl(raw, keep_blank_values=True):
        if "\x00" in name or "\x00" in value:
            return f"query.{name.replace(chr(0), '?')}"
    return None
