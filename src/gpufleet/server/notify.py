"""Wake long-polling claims the moment a job may have become claimable.

Callers on any thread call :meth:`Notifier.notify`; waiters on the event loop await the
event they took *before* trying to claim, so a wake-up between try and wait is not lost.
"""

from __future__ import annotations

import asyncio


class Notifier:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event = asyncio.Event()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def current(self) -> asyncio.Event:
        return self._event

    def _fire(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    def notify(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._fire)
