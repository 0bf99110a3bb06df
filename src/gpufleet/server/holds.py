"""What a credential holds open: event streams, claim long-polls, a dashboard's streams.

A request is authenticated once, when it arrives; a stream or a long-poll then runs on for
minutes. So that revoking or rotating a token (or signing a session out) ends what it
opened, each such request *holds* its :class:`Credential` while it runs, and
:class:`Holds` checks the held credentials again whenever a token changes: on this server
(:meth:`Auth.forget <gpufleet.server.auth.Auth.forget>` runs after every revoke, rotate
and sign-out) and on the others of a PostgreSQL fleet (the NOTIFY that tells them to drop
their token cache calls the same method). Should such a message be lost, every held
credential is checked again each ``RECHECK`` seconds anyway, which also ends what an
expired token holds.

A hold whose credential fails the check is *ended*: its ``ended`` event is set and its
``on_end`` called; the stream returns (the client sees it end, and its reconnect gets 401),
the poll answers at once. Everything but :meth:`Holds.changed` runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from starlette.concurrency import run_in_threadpool

log = logging.getLogger("gpufleet.server")

RECHECK = 10.0  # seconds between checks of every held credential when no change is told


@dataclass(frozen=True)
class Credential:
    """What a request was let in with: a bearer token or a dashboard session, by the
    digest of its secret (the secret itself is not kept)."""

    kind: Literal["bearer", "session"]
    digest: str


class Hold:
    """One request's hold on its credential; ``ended`` is set once the credential fails."""

    def __init__(self, credential: Credential, on_end: Callable[[], None] | None) -> None:
        self.credential = credential
        self.ended = asyncio.Event()
        self._on_end = on_end

    def end(self) -> None:
        if not self.ended.is_set():
            self.ended.set()
            if self._on_end is not None:
                self._on_end()


class Holds:
    """The holds open on this server, and the task that checks their credentials again.
    ``valid`` says whether a credential still lets its holder in (it reads the store:
    it runs in a thread)."""

    def __init__(self, valid: Callable[[Credential], bool], recheck: float = RECHECK) -> None:
        self.valid = valid
        self.recheck = recheck
        self._open: set[Hold] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._open)

    @contextlib.contextmanager
    def hold(
        self, credential: Credential, on_end: Callable[[], None] | None = None
    ) -> Iterator[Hold]:
        """Hold ``credential`` for the length of the ``with`` block."""
        hold = Hold(credential, on_end)
        self._open.add(hold)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch())
        try:
            yield hold
        finally:
            self._open.discard(hold)

    def changed(self) -> None:
        """A token or session changed (here or on another server): check the held
        credentials now. Safe from any thread."""
        loop = self._loop
        if loop is not None and not loop.is_closed() and self._open:
            loop.call_soon_threadsafe(self._changed.set)

    def bind(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop
        if loop is None and self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self) -> None:
        """Check the held credentials when told of a change, or every ``recheck``
        seconds; stop once nothing is held (the next hold starts it again)."""
        while self._open:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.recheck)
            self._changed.clear()
            try:
                await self._check()
            except Exception:  # the database is away: keep what is held, check again later
                log.exception("could not check the credentials of open streams")

    async def _check(self) -> None:
        held = {hold.credential for hold in self._open}
        dead = await run_in_threadpool(lambda: {c for c in held if not self.valid(c)})
        for hold in [h for h in self._open if h.credential in dead]:
            hold.end()
