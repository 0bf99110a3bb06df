"""Who is told of a write, and when: a job's followers (its event log has new records)
and the waiting polls (the queue changed, a job may be claimable).

A write made inside :meth:`Notices.together` is told only once its transaction has
committed, so no follower or poll reads before the change is there; outside one, at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar

from gpufleet.store import Store

log = logging.getLogger("gpufleet.server")


class Notices:
    """The followers' and polls' signals, held back inside a transaction; one per server
    process, shared by the services of the worker protocol."""

    def __init__(
        self,
        store: Store,
        on_change: Callable[[], None],
        on_written: Callable[[str], None] = lambda _job_id: None,
    ) -> None:
        self.store = store
        self._on_change = on_change
        self._on_written = on_written
        # Inside ``together``: what to tell once its transaction has committed.
        self._told: ContextVar[list[Callable[[], None]] | None] = ContextVar(
            f"notices{id(self)}", default=None
        )

    def written(self, job_id: str) -> None:
        """The job's event log has new records: its followers read now."""
        self._tell(lambda: self._on_written(job_id))

    def changed(self) -> None:
        """The queue changed: waiting polls try to claim again."""
        self._tell(self._on_change)

    def _tell(self, call: Callable[[], None]) -> None:
        later = self._told.get()
        if later is None:
            call()
        else:
            later.append(call)

    @contextmanager
    def together(
        self, job_ids: Sequence[str] = ()
    ) -> Iterator[Callable[[], AbstractContextManager[object]]]:
        """The writes made inside go in one transaction (:meth:`Store.together`, whose
        ``part`` it gives; ``job_ids``: the jobs it will change, locked first in one
        order); followers and waiting polls are told once it has committed, so none reads
        before the change is there. Nothing is told if it fails, and a failure to tell
        one is logged: the writes stand."""
        told: list[Callable[[], None]] = []  # stays empty inside another: its end tells
        token = self._told.set(told) if self._told.get() is None else None
        try:
            with self.store.together(job_ids) as part:
                yield part
        finally:
            if token is not None:
                self._told.reset(token)
        for call in told:
            try:
                call()
            except Exception:  # committed: the others are still told
                log.exception("telling followers or polls of a change failed")
