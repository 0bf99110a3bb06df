"""Every request gets an id; every answer carries it; every 5xx is logged once with it.

The outermost ASGI middleware. It names each request (the client's ``X-Request-Id`` when
it is short and printable, else a fresh one) and returns the id in the ``X-Request-Id``
header of every answer, so a user quoting it finds the matching line of the server's log.

An exception no handler turned into an answer becomes a 500 here: logged once, with its
traceback and the request id, and answered in the error shape with the id in the message
and the detail. Any other 5xx the server answers (a server shutting down, a database gone)
is logged once at warning level, with its id. With ``access_log`` on, every request is
logged as one line at info level: client address, method, path, status, latency and id.
Paths are logged with control characters escaped and anything token-shaped cut.
"""

from __future__ import annotations

import logging
import re
import secrets
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpufleet.server.asgi import AnswerCut
from gpufleet.server.responses import error_response, internal_error
from gpufleet.tokens import redact

log = logging.getLogger("gpufleet.server")
access = logging.getLogger("gpufleet.access")
HEADER = "x-request-id"
_GIVEN = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def loggable(text: str) -> str:
    """Text a log or a database keeps: control characters (NUL, newlines) escaped, so a
    crafted path can neither fail an insert nor forge a line, and anything token-shaped
    cut to its hint."""
    return redact("".join(c if c.isprintable() else repr(c)[1:-1] for c in text))


class RequestIds:
    """ASGI middleware: request ids, the access log, and one log line per 5xx."""

    def __init__(self, app: ASGIApp, access_log: bool = False) -> None:
        self.app = app
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(HEADER.encode(), b"").decode("latin-1")
        rid = given if _GIVEN.fullmatch(given) else secrets.token_hex(8)
        scope.setdefault("state", {})["request_id"] = rid  # for a route's own log lines
        started, status = time.monotonic(), 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (HEADER.encode(), rid.encode())]
            await send(message)

        crashed = False
        try:
            await self.app(scope, receive, send_with_id)
        except AnswerCut:  # on purpose, and logged by the route
            crashed = True
        except Exception as exc:
            crashed = True
            where = f"{scope['method']} {loggable(scope['path'])}"
            log.error("internal error in %s (request %s)", where, rid, exc_info=exc)
            if status == 0:  # nothing sent yet: answer in the error shape
                info = internal_error(rid)
                answer = error_response(500, info.code, info.message, info.detail)
                await answer(scope, receive, send_with_id)
            # Not raised on: the log line above is the one; uvicorn would log it again.
        finally:
            ms = (time.monotonic() - started) * 1000
            line = "%s %s %s %d %.1fms request %s"
            client = scope.get("client")
            args = (
                client[0] if client else "-",
                scope["method"],
                loggable(scope["path"]),
                status,
                ms,
                rid,
            )
            if status >= 500 and not crashed:
                log.warning("answered " + line, *args)
            elif self.access_log:
                access.info(line, *args)
