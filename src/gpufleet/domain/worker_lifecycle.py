"""The worker state machine: one table of allowed transitions, beside the job's
(:mod:`gpufleet.domain.lifecycle`), and every stored status change of a worker computed
from it here.

A worker's stored status is ``connecting``, ``available``, ``draining`` or ``offline``;
``reserved`` and ``busy`` are worked out from the jobs it holds and never stored. The
table is drawn in ``docs/core.md`` ("A worker's states"; its test reads the drawing).
Each function below turns one event into a :class:`WorkerChange` (or None: the event
changes no status, such as the heartbeat of a worker already available). A store applies
a change as one conditional update on the worker's status, and decides nothing itself.

Two events act on many workers at once, in the store's own query, and are not
:class:`WorkerChange`: ``silent`` (no heartbeat for a lease: the sweep) and ``remove``
(forgotten, by an operator or, for an ephemeral worker, after its time offline); the
store takes their statuses from :func:`sources` and :func:`target`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from gpufleet.domain.models import WorkerStatus
from gpufleet.domain.transitions import Table

C, A = WorkerStatus.CONNECTING, WorkerStatus.AVAILABLE
D, OFF = WorkerStatus.DRAINING, WorkerStatus.OFFLINE

#: The statuses a worker's row can hold.
STORED = frozenset({C, A, D, OFF})
#: Where every worker starts, and starts again when it registers.
INITIAL = C


class WorkerEvent(StrEnum):
    REGISTER = "register"  # registered again (a new worker starts at INITIAL)
    POLL = "poll"  # asked for work: alive, and past connecting
    HEARTBEAT = "heartbeat"  # a heartbeat, not draining
    DRAIN = "drain"  # a heartbeat while draining (asked to, or on its own)
    SILENT = "silent"  # no heartbeat for a lease
    LEAVE = "leave"  # it stopped on purpose
    REVOKE = "revoke"  # the token that enrolled it was revoked
    REMOVE = "remove"  # forgotten (the row goes)


#: ``None`` as a target: the worker's row is gone.
TRANSITIONS: dict[tuple[WorkerStatus, WorkerEvent], WorkerStatus | None] = {
    (C, WorkerEvent.REGISTER): C,
    (A, WorkerEvent.REGISTER): C,
    (D, WorkerEvent.REGISTER): C,
    (OFF, WorkerEvent.REGISTER): C,
    (C, WorkerEvent.POLL): A,
    (OFF, WorkerEvent.POLL): A,
    (C, WorkerEvent.HEARTBEAT): A,
    (D, WorkerEvent.HEARTBEAT): A,
    (OFF, WorkerEvent.HEARTBEAT): A,
    (C, WorkerEvent.DRAIN): D,
    (A, WorkerEvent.DRAIN): D,
    (OFF, WorkerEvent.DRAIN): D,
    (C, WorkerEvent.SILENT): OFF,
    (A, WorkerEvent.SILENT): OFF,
    (D, WorkerEvent.SILENT): OFF,
    (C, WorkerEvent.LEAVE): OFF,
    (A, WorkerEvent.LEAVE): OFF,
    (D, WorkerEvent.LEAVE): OFF,
    (C, WorkerEvent.REVOKE): OFF,
    (A, WorkerEvent.REVOKE): OFF,
    (D, WorkerEvent.REVOKE): OFF,
    (OFF, WorkerEvent.REVOKE): OFF,
    (OFF, WorkerEvent.REMOVE): None,
}


#: The lookups on :data:`TRANSITIONS`, worked out once.
TABLE: Table[WorkerStatus, WorkerEvent, WorkerStatus | None] = Table("worker", TRANSITIONS)
transition = TABLE.transition
sources = TABLE.sources
target = TABLE.target


def status_after(event: WorkerEvent) -> WorkerStatus:
    """The status ``event`` leads to, for an event that keeps the worker's row."""
    to = target(event)
    if to is None:
        raise ValueError(f"{event.value}: the worker's row goes")
    return to


@dataclass(frozen=True)
class WorkerChange:
    """One status change of one worker, decided here. A store applies it only if the
    worker is still in one of ``sources``: it sets ``status`` and ``fields``."""

    worker_id: str
    event: WorkerEvent
    fields: Mapping[str, object] = field(default_factory=dict)

    @property
    def sources(self) -> frozenset[WorkerStatus]:
        return sources(self.event)

    @property
    def status(self) -> WorkerStatus:
        return status_after(self.event)

    def values(self) -> dict[str, object]:
        """What the store writes: the status and the fields."""
        return {"status": self.status.value, **self.fields}


def poll(worker_id: str, status: str | WorkerStatus, now: float) -> WorkerChange | None:
    """A worker asked for work: one connecting or offline is available now (heartbeat or
    not); any other status stays."""
    if WorkerStatus(status) not in sources(WorkerEvent.POLL):
        return None
    return WorkerChange(worker_id, WorkerEvent.POLL, {"last_heartbeat": now, "offline_since": None})


def _heartbeat_event(drain: bool, draining: bool) -> WorkerEvent:
    """A heartbeat drains a worker asked to (``drain``, the server's flag) or that says it
    is draining (``draining``); any other heartbeat is a plain one."""
    return WorkerEvent.DRAIN if (drain or draining) else WorkerEvent.HEARTBEAT


def heartbeat_status(drain: bool, draining: bool) -> WorkerStatus:
    """The status a heartbeat puts a worker in: draining when it was asked to or says it
    is, else available."""
    return status_after(_heartbeat_event(drain, draining))


def heartbeat(
    worker_id: str,
    status: str | WorkerStatus,
    drain: bool,
    draining: bool,
    now: float,
    gpu_stats: str | None,
) -> WorkerChange | None:
    """A heartbeat: the change it makes to the worker's status, or None when its status
    stays (the usual heartbeat, which only says the worker is alive)."""
    if WorkerStatus(status) == heartbeat_status(drain, draining):
        return None
    fields: dict[str, object] = {"last_heartbeat": now, "offline_since": None}
    if gpu_stats is not None:
        fields["gpu_stats"] = gpu_stats
    return WorkerChange(worker_id, _heartbeat_event(drain, draining), fields)


def leave(worker_id: str, now: float) -> WorkerChange:
    """The worker stopped on purpose: offline from now (a store applies it only to a
    worker not offline already)."""
    return WorkerChange(worker_id, WorkerEvent.LEAVE, {"offline_since": now})


def revoke(worker_id: str, now: float) -> WorkerChange:
    """The token that enrolled the worker was revoked: offline from now, and asked to
    drain, so a claim already past the token check cannot revive it (only registering
    again, with a valid token, clears it)."""
    return WorkerChange(worker_id, WorkerEvent.REVOKE, {"offline_since": now, "drain": True})
