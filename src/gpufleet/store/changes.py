"""The store's status-changing operations, named for what each does: every backend
applies them through its own ``_commit``, all or nothing, and the store decides no status
(a :class:`~gpufleet.domain.lifecycle.Change` names the statuses and lease it may come
from, the status it goes to and the fields it sets).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from gpufleet.domain.lifecycle import Change, Event
from gpufleet.domain.models import JobStatus
from gpufleet.store.api import Applied

#: Fields kept as JSON text.
_JSON = frozenset({"gpus", "stderr_tail"})
#: A job that ends so fails the jobs waiting on it.
FAILS_DEPENDENTS = frozenset({JobStatus.FAILED, JobStatus.CANCELLED})


def encode(values: Mapping[str, object]) -> dict[str, Any]:
    """Field values as columns hold them (tuples of GPUs or lines as JSON text)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key in _JSON and value is not None:
            value = json.dumps(list(value))  # type: ignore[call-overload]
        out[key] = value
    return out


class NamedChanges(ABC):
    """The store's status-changing operations, each named for what it does and taking only
    its own events; both stores apply them through ``_commit``."""

    # ---- the operations, each one named for what it does ------------------------------

    def start(self, change: Change) -> Applied | None:
        """The claimed job's process started (``lifecycle.start``)."""
        return self._checked(change, {Event.START})

    def finish(self, change: Change) -> Applied | None:
        """The worker says how the attempt ended (``lifecycle.finish``)."""
        return self._checked(change, {Event.SUCCEED, Event.RETRY, Event.FAIL})

    def release(self, change: Change) -> Applied | None:
        """The worker hands the job back (``lifecycle.release``)."""
        return self._checked(
            change, {Event.RELEASE, Event.FAIL, Event.LOSE_FINAL, Event.PAUSE, Event.PREEMPT}
        )

    def lose(self, change: Change) -> Applied | None:
        """An expired lease is lost (``lifecycle.lose``): only if it is expired still."""
        return self._checked(change, {Event.LOSE, Event.LOSE_FINAL, Event.PAUSE})

    def cancel(self, change: Change) -> Applied | None:
        return self._checked(change, {Event.CANCEL})

    def requeue(self, change: Change) -> Applied | None:
        return self._checked(change, {Event.REQUEUE})

    def pause(self, change: Change) -> Applied | None:
        """A pending job is held (``lifecycle.pause``)."""
        return self._checked(change, {Event.PAUSE})

    def resume(self, change: Change) -> Applied | None:
        """A paused job is queued again (``lifecycle.resume``)."""
        return self._checked(change, {Event.RESUME})

    def _checked(self, change: Change, allowed: set[Event]) -> Applied | None:
        if change.event not in allowed:
            raise ValueError(f"{change.event.value} is not this operation's change")
        return self._commit(change)

    @abstractmethod
    def _commit(self, change: Change) -> Applied | None:
        """Apply ``change`` and what follows from it, all or nothing; None if it did not
        take."""
