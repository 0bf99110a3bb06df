"""The job state machine: one table of allowed transitions, and nothing else decides them.

::

    pending --claim--> claimed --start--> running --succeed--> succeeded
       ^                  |                  |--retry (attempts left)--> pending (after backoff)
       |                  |                  |--fail (no attempts left)-> failed
       |                  +-- lose (lease expired) / release (drained) --> pending
       +-- requeue (operator) <-- failed | cancelled
    any non-terminal --cancel--> cancelled
    pending --dependency failed (a job:NAME input failed or was cancelled)--> failed

A lost lease counts as an attempt (and may fail the job when none are left); a release
by a draining worker does not.
"""

from __future__ import annotations

from enum import StrEnum

from gpufleet.domain.models import JobStatus
from gpufleet.errors import InvalidTransition

P, C, R = JobStatus.PENDING, JobStatus.CLAIMED, JobStatus.RUNNING
S, F, X = JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED


class Event(StrEnum):
    CLAIM = "claim"
    START = "start"
    SUCCEED = "succeed"
    RETRY = "retry"  # failed, attempts left: back to pending after a backoff
    FAIL = "fail"  # failed, no attempts left
    LOSE = "lose"  # lease expired, attempts left
    LOSE_FINAL = "lose_final"  # lease expired, no attempts left
    RELEASE = "release"  # a draining worker hands the job back; attempt not counted
    CANCEL = "cancel"
    REQUEUE = "requeue"
    DEPENDENCY_FAILED = "dependency_failed"  # a job whose result it needs failed or was cancelled


TRANSITIONS: dict[tuple[JobStatus, Event], JobStatus] = {
    (P, Event.CLAIM): C,
    (C, Event.START): R,
    (R, Event.SUCCEED): S,
    (C, Event.SUCCEED): S,
    (R, Event.RETRY): P,
    (C, Event.RETRY): P,
    (R, Event.FAIL): F,
    (C, Event.FAIL): F,
    (C, Event.LOSE): P,
    (R, Event.LOSE): P,
    (C, Event.LOSE_FINAL): F,
    (R, Event.LOSE_FINAL): F,
    (C, Event.RELEASE): P,
    (R, Event.RELEASE): P,
    (P, Event.CANCEL): X,
    (C, Event.CANCEL): X,
    (R, Event.CANCEL): X,
    (F, Event.REQUEUE): P,
    (X, Event.REQUEUE): P,
    (P, Event.DEPENDENCY_FAILED): F,
}

#: Events that count one attempt against ``max_attempts``.
COUNTED = frozenset({Event.RETRY, Event.FAIL, Event.LOSE, Event.LOSE_FINAL, Event.SUCCEED})


def transition(status: JobStatus, event: Event) -> JobStatus:
    """The state after ``event`` in ``status``, or :class:`InvalidTransition`."""
    try:
        return TRANSITIONS[(status, event)]
    except KeyError:
        raise InvalidTransition(
            f"a {status.value} job cannot {event.value}",
            detail={"status": status.value, "event": event.value},
        ) from None


def sources(event: Event) -> frozenset[JobStatus]:
    """Every status from which ``event`` is allowed; stores use it in conditional updates."""
    return frozenset(src for (src, ev) in TRANSITIONS if ev == event)


def failure_event(attempts_used: int, max_attempts: int, *, lost: bool = False) -> Event:
    """What a failed attempt does, given the attempts used *including* this one."""
    if attempts_used >= max_attempts:
        return Event.LOSE_FINAL if lost else Event.FAIL
    return Event.LOSE if lost else Event.RETRY


def backoff_seconds(attempts_used: int, base: float, cap: float = 600.0) -> float:
    """Exponential backoff before the next attempt: base, 2*base, 4*base ... up to cap."""
    if attempts_used <= 0 or base <= 0:
        return 0.0
    return float(min(cap, base * (2 ** (attempts_used - 1))))
