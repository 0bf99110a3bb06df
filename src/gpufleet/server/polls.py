"""Open claim long-polls: the newest per worker counts, and all are answered at a stop.

A worker's poll carries the slots it had free when it was sent. When a slot frees while a
poll is open, the worker sends a new poll at once with its fresh slots; the new poll
*supersedes* the old one, which wakes and answers empty, so the server claims with the
worker's current slots and a freed GPU is taken within the dispatch latency, not at the
old poll's end. (Slots the server knows the worker's jobs hold are taken out of any poll's
slots when it claims, so two polls crossing cannot hand one slot out twice.)

When the server is told to stop, every open poll answers empty at once, and a poll that
arrives while it stops is refused with 503 and ``Retry-After``: the shutdown never has to
cut a waiting request off.

With several server replicas (PostgreSQL), a worker's new poll may reach another
replica than its open one; a worker says when its poll replaces one it has open
(``supersede``), and that replica publishes it (NOTIFY) so the other ends its poll too.

Everything here runs on the event loop; :meth:`Polls.request_stop` and
:meth:`Polls.superseded_elsewhere` may be called from a signal handler or another thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable


class Poll:
    """One open poll: ``over`` is set when it should answer now (superseded, or a stop)."""

    def __init__(self) -> None:
        self.over = asyncio.Event()


class Polls:
    def __init__(self) -> None:
        self._open: dict[str, Poll] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False
        self.replica = secrets.token_hex(6)  # tells this process's notices from others

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def __len__(self) -> int:
        return len(self._open)

    def begin(self, worker_id: str) -> Poll:
        """A new poll for ``worker_id``; an older one still open answers empty now."""
        old = self._open.get(worker_id)
        if old is not None:
            old.over.set()
        poll = self._open[worker_id] = Poll()
        if self.stopping:
            poll.over.set()
        return poll

    def end(self, worker_id: str, poll: Poll) -> bool:
        """Forget ``poll``; whether it was still the worker's newest."""
        if self._open.get(worker_id) is poll:
            del self._open[worker_id]
            return True
        return False

    def stop(self) -> None:
        """Answer every open poll now, and refuse new ones."""
        self.stopping = True
        for poll in self._open.values():
            poll.over.set()

    def request_stop(self) -> None:
        """:meth:`stop`, from any thread or a signal handler."""
        self._soon(self.stop)

    def superseded_elsewhere(self, worker_id: str, replica: str) -> None:
        """Another replica got a newer poll of ``worker_id``: end the one open here."""
        if replica != self.replica:
            self._soon(lambda: self._end_open(worker_id))

    def _end_open(self, worker_id: str) -> None:
        poll = self._open.get(worker_id)
        if poll is not None:
            poll.over.set()

    def _soon(self, callback: Callable[[], None]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(callback)


async def wait_either(
    first: asyncio.Event, second: asyncio.Event, timeout: float | None = None
) -> None:
    """Return when either event is set, or after ``timeout`` seconds (None: no limit)."""
    if first.is_set() or second.is_set():
        return
    waiters = [asyncio.ensure_future(first.wait()), asyncio.ensure_future(second.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        for w in waiters:
            with contextlib.suppress(asyncio.CancelledError):
                await w
