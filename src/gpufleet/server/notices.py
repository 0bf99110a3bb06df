"""Who is told of a write, and when: a job's followers (its event log has new records)
and the waiting polls (the queue changed, a job may be claimable).

A write made through a transaction is told only once the transaction has committed
(:meth:`Notices.within` gives the notices of one), so no follower or poll reads before the
change is there; any other write is told at once.
"""

from __future__ import annotations

from collections.abc import Callable

from gpufleet.store import Transaction


class Notices:
    """The followers' and polls' signals; one per server process, shared by the services
    of the worker protocol, and one per transaction (:meth:`within`)."""

    def __init__(
        self,
        on_change: Callable[[], None],
        on_written: Callable[[str], None] = lambda _job_id: None,
        tell: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._on_change = on_change
        self._on_written = on_written
        self._tell: Callable[[Callable[[], None]], None] = tell or _now

    def written(self, job_id: str) -> None:
        """The job's event log has new records: its followers read now."""
        self._tell(lambda: self._on_written(job_id))

    def changed(self) -> None:
        """The queue changed: waiting polls try to claim again."""
        self._tell(self._on_change)

    def within(self, tx: Transaction) -> Notices:
        """The same signals, given once ``tx`` has committed (never, if it rolls back)."""
        return Notices(self._on_change, self._on_written, tx.after_commit)


def _now(call: Callable[[], None]) -> None:
    call()
