"""Small pieces the ASGI middlewares (audit, limits, request ids) and routes share."""

from __future__ import annotations

from starlette.types import Message, Send


class StatusWatch:
    """Wraps an ASGI ``send`` and remembers the response's status (0 until it starts)."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.status = 0

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)


class AnswerCut(Exception):
    """Raised by a route to cut its answer off after it began (its connection closes with
    the body short: a client, a browser too, sees the download fail). The route has logged
    why; the request-id middleware logs nothing more, no traceback."""
