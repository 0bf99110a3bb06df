"""A small piece both ASGI middlewares (audit, limits) need."""

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
