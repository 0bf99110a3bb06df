"""The unit of work every backend's :meth:`~gpufleet.store.api.Store.transaction` gives:
the store bound to one transaction, its savepoints, and what to do once it has committed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

from gpufleet.store.api import InTransaction

log = logging.getLogger("gpufleet.store")


class UnitOfWork:
    """One transaction (:class:`~gpufleet.store.api.Transaction`). The backend that opens
    it commits it and then calls :meth:`committed`; one that rolls back never does."""

    def __init__(
        self, store: InTransaction, savepoint: Callable[[], AbstractContextManager[object]]
    ) -> None:
        self.store = store
        self._savepoint = savepoint
        self._after: list[Callable[[], None]] = []

    def savepoint(self) -> AbstractContextManager[object]:
        return self._savepoint()

    def after_commit(self, call: Callable[[], None]) -> None:
        self._after.append(call)

    def committed(self) -> None:
        """Run the after-commit calls, in the order they were given. The writes stand
        whatever these do: a call that fails is logged, and the others still run."""
        calls, self._after = self._after, []
        for call in calls:
            try:
                call()
            except Exception:
                log.exception("a call made after a transaction committed failed")
