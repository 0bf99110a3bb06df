"""Preemption as the server carries it out: a periodic duty of the sweep.

Each sweep (about once a second) reads the sharing rules; with ``[preemption]`` on, it
looks in each pool for pending jobs of priority ``min_priority`` or more that have waited
``min_wait`` seconds since they became claimable (created, or out of their backoff), and
lets :func:`gpufleet.scheduling.preemption.plan` decide, on the fleet as it is now,
whether one of them preempts a running job and which. A victim is marked by one
conditional update (:meth:`~gpufleet.store.PreemptionStore.request_preempt`), so servers
sharing a database may all sweep: a job is marked once, and a waiting job has one victim
at a time. Its worker learns it at its next heartbeat (the order "preempt"), sends the
job its grace signal, keeps its checkpoint and hands it back: the job is pending again,
the attempt counted neither against ``max_attempts`` nor as a loss
(:func:`gpufleet.domain.lifecycle.release`), and it keeps its place among the jobs of its
rank (its ``created_at``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from gpufleet.domain import caps
from gpufleet.domain.models import JobStatus, WorkerStatus
from gpufleet.domain.sharing import Sharing
from gpufleet.scheduling.matching import FreeResources, JobView
from gpufleet.scheduling.preemption import Decision, Holder, Room, Slots, plan
from gpufleet.server.fleet import Fleet, OnEvent, WorkerState
from gpufleet.server.notices import Notices
from gpufleet.server.sharing import SharingRules
from gpufleet.server.views import owner_state, ts
from gpufleet.store import FleetStore, JobRow, JobStore, Preempt, PreemptionStore
from gpufleet.wire import JobRef, PreemptionOut

log = logging.getLogger("gpufleet.server")

#: Waiting jobs a pool's sweep looks at, at most (the first in claim order).
LOOK_AT = 20
#: Seconds past the victim's grace period and a lease that its freed slot stays the
#: waiting job's (its worker's claims offer it first).
HOLD_MARGIN = 10.0
#: The jobs a job's detail names as preempted by it, at most (the latest).
SHOWN = 20


class PreemptionServiceStore(JobStore, FleetStore, PreemptionStore, Protocol):
    """What preemption reads (jobs, workers) and marks."""


def holder(job: JobRow, rules: Sharing, draining: bool) -> Holder:
    """A claimed or running job as :mod:`gpufleet.scheduling.preemption` sees it."""
    spec = job.spec
    started = job.started_at if job.status == JobStatus.RUNNING else None
    asked = (job.stop_requested_at, job.pause_requested_at, job.preempt_requested_at)
    timeout, _ = caps.run_limit(rules, job.pool, spec.timeout)  # its pool's max_run too
    return Holder(
        job_id=job.id,
        lease=job.lease,
        priority=job.priority,
        gpus=job.gpus,
        started_at=started,
        allows=spec.preemptible or rules.pool(job.pool).preemptible,
        preempted_at=job.preempted_at,
        grace=spec.grace_period,
        ends_by=None if started is None or timeout is None else started + timeout,
        leaving=draining or any(a is not None for a in asked),
        making_way_for=job.preempted_by if job.preempt_requested_at is not None else None,
    )


def _slots(state: WorkerState, rules: Sharing) -> Slots:
    """A worker as preemption sees it. Under an owner policy, what its last heartbeat
    said: a worker that takes no new jobs now (the owner's hours, idle rule, battery,
    ``--yield``) offers no slot, free or freed; the owner's GPUs are no slot either."""
    draining = state.view.status in (WorkerStatus.DRAINING, WorkerStatus.OFFLINE)
    held = tuple(holder(j, rules, draining) for j in state.running)
    said = owner_state(state.row.owner_state)
    if said is None:
        return Slots(state.view, state.free, held)
    if said.reasons:
        return Slots(state.view, FreeResources(cpu_slots=0), ())
    owned = set(said.owned)
    gpus = tuple(g for g in state.free.gpus if g.index not in owned)
    held = tuple(h for h in held if not owned.intersection(h.gpus))
    return Slots(state.view, dataclasses.replace(state.free, gpus=gpus), held)


def said_of(job: JobRow) -> str:
    """How a job is named in another's event log: its id, its owner and its priority."""
    owner = job.owner or "no owner"
    return f"job {job.id} ({owner}, priority {job.priority})"


class Preemption:
    """The sweep's preemption duty; one per server process."""

    def __init__(
        self,
        store: PreemptionServiceStore,
        fleet: Fleet,
        rules: SharingRules,
        notices: Notices,
        clock: Callable[[], float],
        on_event: OnEvent,
        cuda_grace: float,
    ) -> None:
        self.store = store
        self.fleet = fleet
        self.rules = rules
        self.notices = notices
        self.clock = clock
        self.on_event = on_event
        self.cuda_grace = cuda_grace
        # What the capped users and pools hold now (None: the caps are not applied). A
        # waiting job a cap holds back preempts only a job whose leaving makes it room.
        self.held_now: Callable[[], caps.Holdings] | None = None

    def sweep(self) -> list[tuple[str, str]]:
        """Preempt where the rules say so, now; the (victim, waiting job) pairs marked."""
        rules = self.rules.current()
        if not rules.preemption.enabled:
            return []
        now = self.clock()
        since = now - rules.preemption.min_wait
        least = rules.preemption.min_priority
        marked: list[tuple[str, str]] = []
        for pool in sorted({w.pool for w in self.store.list_workers()}):
            waiting = self.store.preemptors(pool, least, since, LOOK_AT)
            if waiting:
                marked += self._pool(pool, waiting, rules, now)
        if marked:
            self.notices.changed()
        return marked

    def _pool(
        self, pool: str, waiting: list[JobRow], rules: Sharing, now: float
    ) -> list[tuple[str, str]]:
        states = self.fleet.states([pool])
        rows = {j.id: j for s in states for j in s.running}
        rows.update((j.id, j) for j in waiting)
        views = [JobView(j.id, j.spec, j.created_at) for j in waiting]
        slots = [_slots(s, rules) for s in states]
        room = self._room(rules, rows)
        decisions = plan(views, slots, rules.preemption, now, self.cuda_grace, room)
        return [
            (d.victim.job_id, d.job.id)
            for d in decisions
            if d.victim is not None and self._mark(d, rows, now)
        ]

    def _room(self, rules: Sharing, rows: Mapping[str, JobRow]) -> Room:
        """Whether the caps let a waiting job take a slot now, or once a running job has
        left its own (what is held read once, and only if a cap counts a waiting job)."""
        held: list[caps.Holdings] = []
        if self.held_now is None or not caps.any_caps(rules):
            return lambda view, leaving: True

        def room(view: JobView, leaving: Holder | None) -> bool:
            job = rows[view.id]
            if self.held_now is None or not caps.holders(rules, job.owner, job.pool):
                return True
            if not held:
                held.append(self.held_now())
            now = held[0]
            if leaving is not None:
                gone = rows[leaving.job_id]
                now = caps.without(now, gone.owner, gone.pool, len(gone.gpus))
            r = job.spec.requirements
            ask = caps.Ask(job.id, job.owner, job.pool, r.gpus_wanted if r.needs_gpu else 0)
            return caps.refusal(rules, ask, now) is None

        return room

    def _mark(self, d: Decision, rows: Mapping[str, JobRow], now: float) -> bool:
        """Mark the decision's victim; whether it took (another server may have been
        first, or the job ended or was asked something else meanwhile)."""
        assert d.victim is not None and d.worker is not None
        victim, waiting = rows[d.victim.job_id], rows[d.job.id]
        why = (
            f"preempted by {said_of(waiting)}: its grace signal, its checkpoint kept, then "
            "back to the queue (not counted as a failure)"
        )
        said = f"preempted {said_of(victim)} on worker {d.worker.name} to free its slot"
        # the freed slot is the waiting job's: its worker's claims offer it first until
        # the victim has had its grace period and a lease to go
        until = now + victim.spec.grace_period + self.fleet.lease_timeout + HOLD_MARGIN
        ask = Preempt(victim.id, victim.lease, waiting.id, why, said, d.worker.id, until)
        if not self.store.request_preempt(ask, now):
            return False
        detail = f"{said_of(victim)} preempted by {said_of(waiting)} on worker {d.worker.name}"
        log.warning("%s", detail)
        self.on_event("job.preempted", victim.id, detail, None)
        self.notices.written(victim.id)
        self.notices.written(waiting.id)
        return True

    def shown(self, job: JobRow) -> PreemptionOut | None:
        """What ``job``'s detail says of preemption (None: it never preempted or was
        preempted)."""
        preempted = self.store.preempted_for(job.id, SHOWN)
        if job.preempted_at is None and not preempted:
            return None
        by = self.store.get_job(job.preempted_by) if job.preempted_by else None
        active = job.status.active and job.preempt_requested_at is not None
        return PreemptionOut(
            requested_at=ts(job.preempt_requested_at) if active else None,
            preempted_at=ts(job.preempted_at),
            by=None if by is None else _ref(by, job.preempted_at),
            preempted=[_ref(v, v.preempted_at) for v in preempted],
        )


def _ref(job: JobRow, at: float | None) -> JobRef:
    return JobRef(job_id=job.id, name=job.name, owner=job.owner, priority=job.priority, at=ts(at))


__all__ = ["LOOK_AT", "SHOWN", "Preemption", "holder", "said_of"]
