"""Why a job waits: for each worker, the reason it does not take the job now, and one line
that says what the job waits for (``gpufleet why``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Protocol

from gpufleet.domain.models import JobStatus
from gpufleet.domain.owner import owner_reasons
from gpufleet.scheduling.matching import (
    Assignment,
    JobView,
    WorkerView,
    ever_reason,
    explain,
    now_reason,
    runs_on_gpus,
)
from gpufleet.server.caps import Caps
from gpufleet.server.fleet import Fleet, WorkerState
from gpufleet.server.reads import Reads
from gpufleet.server.views import owner_state
from gpufleet.store import JobRow, JobStore, PreemptionStore

# Jobs ahead a position counts, at most: each is read and matched, so a job deep in a
# long queue would cost ``why`` time in proportion (bench/growth.py).
AHEAD = 1_000


class ExplainStore(JobStore, PreemptionStore, Protocol):
    """What ``why`` reads: jobs, and the jobs making way for one."""


class Explain:
    """``why``; one per server process."""

    def __init__(
        self,
        store: ExplainStore,
        reads: Reads,
        fleet: Fleet,
        prefer_cuda_grace: float,
        clock: Callable[[], float],
        caps: Caps | None = None,
    ) -> None:
        self.caps = caps
        self.store = store
        self.reads = reads
        self.fleet = fleet
        self.prefer_cuda_grace = prefer_cuda_grace
        self.clock = clock

    def why(
        self, ref: str, pools: Sequence[str] | None = None
    ) -> tuple[JobRow, str, list[tuple[WorkerState, list[str]]], int | None]:
        """The job, a one-line summary, every worker's reasons not to take it now (of the
        workers in ``pools``; None: every worker), each with its status, and (pending) its
        place in the queue among the jobs the workers that could run it could run too."""
        job = self.reads.job(ref, pools)
        now = self.clock()
        # The job does not hold a slot against itself.
        states = [
            self.fleet.state(s.row, [j for j in self.store.holding(s.row) if j.id != job.id])
            if job.target
            else s
            for s in self.fleet.states(pools)
        ]
        jv = JobView(job.id, job.spec, job.created_at)
        verdicts = explain(jv, [(s.view, s.free) for s in states], now, self.prefer_cuda_grace)
        verdicts = [
            (v, r or _owner_why(s, job)) for (v, r), s in zip(verdicts, states, strict=True)
        ]
        capped = self._capped(job, states, verdicts, now)
        rows = [(s, reasons) for s, (_, reasons) in zip(states, verdicts, strict=True)]
        position, exact = self._position(job, [s.view for s in states])
        summary = self._why_summary(job, verdicts, now, capped)
        if job.raised and job.status == JobStatus.PENDING:
            summary += f"; its memory requirement was raised: {json.loads(job.raised)['why']}"
        if position is not None and job.status == JobStatus.PENDING and not job.waiting:
            if exact:
                summary += f" (place {position} in its queue)"
            else:
                summary += (
                    f" (over {AHEAD:,} jobs ahead of it in its queue; {position - 1:,} of "
                    f"the first {AHEAD:,} compete with it)"
                )
        return job, summary, rows, position if exact else None

    def _position(self, job: JobRow, workers: list[WorkerView]) -> tuple[int | None, bool]:
        """1 + the pending jobs ranked before ``job`` (priority, then age) that one of the
        workers able to run ``job`` could run too (None unless it is pending), and whether
        that is exact: only the first ``AHEAD`` jobs ahead are looked at."""
        if job.status != JobStatus.PENDING:
            return None, True
        able = [w for w in workers if ever_reason(job.spec, w) is None]
        if not able:
            return None, True
        ahead = self.store.queue_ahead(job, AHEAD + 1)
        before = sum(1 for j in ahead[:AHEAD] if any(ever_reason(j.spec, w) is None for w in able))
        return 1 + before, len(ahead) <= AHEAD

    def _capped(
        self,
        job: JobRow,
        states: list[WorkerState],
        verdicts: list[tuple[WorkerView, list[str]]],
        now: float,
    ) -> str | None:
        """Why a cap holds the pending ``job`` back (None: none does); the reason is added
        to each worker that would take it now but for the cap. With no such worker, the
        cap is judged on what the job asks (its GPUs, else a CPU slot)."""
        if self.caps is None or job.status != JobStatus.PENDING or job.waiting:
            return None
        jv = JobView(job.id, job.spec, job.created_at)
        ready, asks = [], []
        for s, (_, reasons) in zip(states, verdicts, strict=True):
            if not reasons:
                got = now_reason(jv, s.view, s.free, now, self.prefer_cuda_grace)
                ready.append(reasons)
                asks.append(len(got.gpus) if isinstance(got, Assignment) else 0)
        if not ready:
            r = job.spec.requirements
            return self.caps.holding_back(job, [r.gpus_wanted if r.needs_gpu else 0])[0]
        found = self.caps.holding_back(job, asks)
        for reasons, held in zip(ready, found, strict=True):
            if held is not None:
                reasons.append(held)
        return None if any(h is None for h in found) else found[0]

    def _why_summary(
        self,
        job: JobRow,
        verdicts: list[tuple[WorkerView, list[str]]],
        now: float,
        capped: str | None = None,
    ) -> str:
        if job.status == JobStatus.PAUSED:
            return f"paused: it waits for `gpufleet resume {job.id}`, then its checkpoint"
        if job.status != JobStatus.PENDING:
            where = f" on {job.worker_id}" if job.worker_id and job.status.active else ""
            return f"job is {job.status.value}{where}, not waiting"
        if job.waiting:
            unmet = [d for d in self.store.dependencies(job.id) if d.status != JobStatus.SUCCEEDED]
            named = ", ".join(f"job:{d.name} ({d.id}, {d.status.value})" for d in unmet)
            return f"waiting for {named or 'its dependencies'} to succeed"
        if job.not_before and job.not_before > now:
            return f"retry backoff: claimable in {job.not_before - now:.0f}s"
        if not verdicts:
            return "no workers are registered"
        ready = [v.name for v, r in verdicts if not r]
        if ready:
            return "claimable now by " + ", ".join(ready)
        if job.unrunnable or all(ever_reason(job.spec, v) for v, _ in verdicts):
            return "no registered worker could ever run this job"
        if capped is not None:
            return f"held back by a cap: {capped}"
        busy = "waiting: every worker that could run it is busy, reserved, draining or offline"
        return busy + self._making_way(job)

    def _making_way(self, job: JobRow) -> str:
        """What a job preempted for ``job`` is doing, if it still runs: making way."""
        for v in self.store.preempted_for(job.id, 1):
            if v.status.active and v.preempt_requested_at is not None:
                return f"; job {v.id} ({v.name}) is making way for it (preempted)"
        return ""


def _owner_why(s: WorkerState, job: JobRow) -> list[str]:
    """Why the worker does not take the job by its owner's rules (its owner policy, as
    its last heartbeat said it): it takes no jobs now, or the GPUs the job would get are
    the owner's."""
    said = owner_state(s.row.owner_state)
    if said is None:
        return []
    free = {g.index for g in s.free.gpus}
    gpu_job = runs_on_gpus(job.spec, s.view)
    return owner_reasons(said.to_domain(), gpu_job, job.spec.requirements.gpus_wanted, free)
