"""A database (or blob) disk that filled up: how to tell it from other failures, and
whether this server's writes fail for lack of space now.

SQLite says ``database or disk is full`` (``SQLITE_FULL``); PostgreSQL raises SQLSTATE
``53100`` (``disk_full``) and its other ``53`` errors when it is short of memory or
connections; a file write fails with ``ENOSPC`` (or ``EDQUOT``). The server answers each
with 507 (disk) or 503 and ``Retry-After`` (another shortage), never 500, and its health
says ``degraded`` while writes fail so.
"""

from __future__ import annotations

import errno
import sqlite3
import threading
from dataclasses import dataclass

from sqlalchemy import Engine, event
from sqlalchemy.engine import ExceptionContext

DISK_FULL = "53100"  # PostgreSQL's SQLSTATE disk_full
SHORTAGE_CLASS = "53"  # PostgreSQL's insufficient_resources class
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_DEPTH = 6  # causes followed at most: a driver error wrapped by SQLAlchemy, re-raised


@dataclass(frozen=True)
class Shortage:
    """A write failed for lack of a resource: ``disk`` (space) or not (memory,
    connections), and the words of whoever said so."""

    disk: bool
    why: str


def shortage(exc: BaseException) -> Shortage | None:
    """The shortage ``exc`` (or an error it wraps) stands for, or None for another
    failure."""
    seen: BaseException | None = exc
    for _ in range(_DEPTH):
        if seen is None:
            return None
        found = _own_shortage(seen)
        if found is not None:
            return found
        seen = getattr(seen, "orig", None) or seen.__cause__ or seen.__context__
    return None


def _own_shortage(exc: BaseException) -> Shortage | None:
    if isinstance(exc, sqlite3.OperationalError):
        full = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
        if full or "database or disk is full" in str(exc):
            return Shortage(True, f"SQLite: {exc}")
        return None
    if isinstance(exc, OSError):
        return Shortage(True, exc.strerror or str(exc)) if exc.errno in _NO_SPACE else None
    state = getattr(exc, "sqlstate", None)  # psycopg's errors
    if isinstance(state, str) and state.startswith(SHORTAGE_CLASS):
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else state
        return Shortage(state == DISK_FULL, f"PostgreSQL {state}: {said}")
    return None


def shortage_classes() -> tuple[type[Exception], ...]:
    """The errors a shortage comes as: SQLAlchemy's wrapping of a driver's, a driver's
    own (a bulk insert through the driver), a file's."""
    import psycopg
    from sqlalchemy.exc import DBAPIError

    return (DBAPIError, sqlite3.Error, psycopg.Error, OSError)


class SpaceWatch:
    """Whether this server's writes fail for lack of space now: set by a write that
    failed so, cleared by the next write transaction that commits with no such failure
    since it began (a batch whose parts all failed commits, having written nothing). One
    per store; any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._why: str | None = None
        self._failures = 0  # writes that failed for lack of space, ever

    def full(self, why: str) -> None:
        with self._lock:
            self._why = why
            self._failures += 1

    def mark(self) -> int:
        """Where a write transaction begins: give it back to :meth:`wrote` as it commits."""
        return self._failures

    def wrote(self, since: int) -> None:
        """A write transaction that began at mark ``since`` committed."""
        if self._why is not None:
            with self._lock:
                if self._failures == since:
                    self._why = None

    @property
    def why(self) -> str | None:
        """What the last failed write said, while no write has committed since."""
        return self._why


def watch_engine(engine: Engine, space: SpaceWatch) -> None:
    """Tell ``space`` of each statement of ``engine``'s that fails for lack of disk. (The
    store clears it when one of its write transactions commits: a listener on every
    statement, to see which wrote, cost the claim path a tenth of its time.)"""

    def failed(context: ExceptionContext) -> None:
        found = shortage(context.original_exception)
        if found is not None and found.disk:
            space.full(found.why)

    event.listen(engine, "handle_error", failed)
