"""The queue's front: submitting jobs and manifests, finding them, explaining why one
waits, and what owners and operators may do to them (cancel, requeue).

The store only persists; the lifecycle table in :mod:`gpufleet.domain.lifecycle` decides
every state change, and :mod:`gpufleet.scheduling` decides who may run what. The lease
protocol is :class:`gpufleet.server.leases.Leases`, workers' own lifecycle
:class:`gpufleet.server.fleet.Fleet`; one ``QueueService`` holds both. Time comes from an
injected clock so the policy is testable without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from gpufleet.domain import lifecycle
from gpufleet.domain.ids import manifest_job_id, new_job_id
from gpufleet.domain.models import JobSpec, JobStatus, WorkerStatus
from gpufleet.errors import Conflict, Forbidden, NotFound, ValidationFailed
from gpufleet.scheduling.matching import (
    Assignment,
    JobView,
    WorkerView,
    ever_reason,
    explain,
    now_reason,
)
from gpufleet.server.blobs import BlobService
from gpufleet.server.dataflow import DataFlow
from gpufleet.server.fleet import Fleet, OnEvent, WorkerState, no_event
from gpufleet.server.leases import Leases
from gpufleet.server.settings import QueueSettings
from gpufleet.store import Hold, JobRow, Store, WorkerRow
from gpufleet.wire import (
    ApplyResult,
    ManifestApply,
)

Clock = Callable[[], float]


class QueueService:
    """The server's queue: one instance per server process, shared by every request."""

    def __init__(
        self,
        store: Store,
        settings: QueueSettings,
        blobs: BlobService,
        clock: Clock = time.time,
        on_change: Callable[[], None] = lambda: None,
        on_event: OnEvent = no_event,
    ) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock
        self.on_change = on_change
        self.on_event = on_event
        self.blobs = blobs
        self.fleet = Fleet(
            store, settings.lease_timeout, settings.ephemeral_ttl, clock=clock, on_event=on_event
        )
        self.flow = DataFlow(store, blobs, clock, self._changed)
        self.leases = Leases(store, settings, self.fleet, self.flow, clock, on_change, on_event)

    def _changed(self) -> None:
        self.on_change()

    # ---- submitting -------------------------------------------------------------------

    def unrunnable_reason(self, spec: JobSpec, views: list[WorkerView] | None = None) -> str | None:
        """Why no registered worker could ever run ``spec`` (None: some worker could)."""
        if views is None:
            views = [self.fleet.view(w) for w in self.store.list_workers([spec.pool])]
        views = [v for v in views if v.pool == spec.pool]  # other pools are not its business
        if not views:
            return None
        reasons = []
        for view in views:
            reason = ever_reason(spec, view)
            if reason is None:
                return None
            reasons.append(f"{view.name}: {reason}")
        return "no registered worker could ever run this job (" + "; ".join(reasons) + ")"

    def submit(
        self,
        spec: JobSpec,
        pool: str | None = None,
        wait_for_target: bool = True,
        readable: Sequence[str] | None = None,
        submitted_by: str | None = None,
    ) -> JobRow:
        """Queue ``spec`` in ``pool`` (None: its own), as submitted by the token
        ``submitted_by``. A job aimed at one worker (requirements.worker) that cannot take
        it now is refused (409) unless ``wait_for_target``; accepted, it holds that
        worker's slot until the worker claims it. Its packages must be blobs the pools in
        ``readable`` may read (None: any); the job's pool may read them from then on."""
        spec = replace(spec, pool=pool or spec.pool)
        hold = self._target(spec, wait_for_target) if spec.requirements.worker else None
        job_id = new_job_id()
        spec = self.flow.resolve(spec, readable=readable)
        self.flow.grant_packages([spec])
        self.store.insert_jobs(
            [(job_id, spec, self.unrunnable_reason(spec))],
            self.clock(),
            deps={job_id: spec.dependencies},
            submitted_by=submitted_by,
            hold=hold,
        )
        self.on_change()
        return self.job(job_id)

    def _target(self, spec: JobSpec, wait: bool) -> Hold | None:
        """The worker ``spec`` is aimed at must exist in its pool; unless ``wait``, it
        must be able to start the job now, judged in the insert's own transaction."""
        ref = spec.requirements.worker
        assert ref is not None
        w = self.store.get_worker(ref)
        if w is None or w.pool != spec.pool:
            raise NotFound(
                _no_worker(ref, spec.pool), detail={"worker": ref, "field": "requirements.worker"}
            )
        if wait:
            return None

        def check(holding: list[JobRow]) -> None:
            state = self.fleet.state(w, holding)
            now = self.clock()
            verdict = now_reason(JobView("(new)", spec, now), state.view, state.free, now, 0.0)
            if isinstance(verdict, Assignment) and state.view.status in (
                WorkerStatus.AVAILABLE,
                WorkerStatus.CONNECTING,
            ):
                return
            raise _not_now(state, verdict)

        return Hold(w, check)

    def apply(
        self,
        req: ManifestApply,
        pools: Sequence[str] | None = None,
        submitted_by: str | None = None,
    ) -> ApplyResult:
        """Apply a manifest: new jobs are queued, pending ones take its changes, and the
        jobs it no longer has are named (they stay until cancelled). An operator of some
        pools (``pools``) applies jobs of those pools and hosts entries for their workers."""
        specs = [j.to_domain() for j in req.jobs]
        workers = self.store.list_workers()
        self._check_plan(req, specs, pools, workers)
        ids = [manifest_job_id(s) for s in specs]
        if len(set(ids)) != len(ids):
            raise ValidationFailed("the manifest has two identical jobs", detail={"field": "jobs"})
        self._check_ids(req.name, ids, pools)
        specs = self._resolve_batch(specs, ids, pools)
        self.flow.grant_packages(specs)
        policies = {h.name: h.model_dump_json() for h in req.hosts}
        now = self.clock()
        # A pool's operator replaces only what the manifest said about its own workers.
        mine = None if pools is None else [w.name for w in workers if w.pool in pools]
        self.store.replace_hosts(req.name, policies, now, within=mine)
        self.fleet.policies_changed()
        views = [self.fleet.view(w) for w in workers]
        unrunnable = {i: self.unrunnable_reason(s, views) for i, s in zip(ids, specs, strict=True)}
        created = self.store.insert_jobs(
            [(i, s, unrunnable[i]) for i, s in zip(ids, specs, strict=True)],
            now,
            deps={i: s.dependencies for i, s in zip(ids, specs, strict=True)},
            submitted_by=submitted_by,
        )
        fresh = set(created)
        updated = self.store.update_pending(
            [(i, s, unrunnable[i]) for i, s in zip(ids, specs, strict=True) if i not in fresh]
        )
        if created or updated:
            self.on_change()
        names = {v.name for v in views}
        changed = fresh | set(updated)
        planned = set(ids)
        return ApplyResult(
            manifest=req.name,
            created=created,
            updated=updated,
            unchanged=[i for i in ids if i not in changed],
            absent=[i for i, _ in self.store.manifest_jobs(req.name, pools) if i not in planned],
            hosts=sorted(policies),
            unknown_hosts=sorted(h for h in policies if h not in names),
            unrunnable={i: r for i, r in unrunnable.items() if r and i in changed},
        )

    def _check_plan(
        self,
        req: ManifestApply,
        specs: list[JobSpec],
        pools: Sequence[str] | None,
        workers: list[WorkerRow],
    ) -> None:
        for spec in specs:
            if spec.manifest != req.name:
                raise ValidationFailed(
                    f"job {spec.name!r}: manifest is {spec.manifest!r}, expected {req.name!r}",
                    detail={"job": spec.name, "field": "manifest"},
                )
            if pools is not None and spec.pool not in pools:
                raise Forbidden(
                    f"job {spec.name!r} is for pool {spec.pool!r}; this operator token "
                    f"acts on pool {', '.join(pools)} only",
                    detail={"job": spec.name, "field": "pool"},
                )
            _check_aim(spec, workers)
        if pools is None:
            return
        pooled = {w.name for w in workers if w.pool in pools}
        for host in req.hosts:
            if host.name not in pooled:
                raise Forbidden(
                    f"[hosts.{host.name}]: not a worker of pool {', '.join(pools)}; a host "
                    "policy of another pool (or of a worker not registered yet) needs an "
                    "operator of every pool",
                    detail={"host": host.name, "field": "hosts"},
                )

    def _check_ids(self, manifest: str, ids: list[str], pools: Sequence[str] | None) -> None:
        """A job's id is its identity, not its pool: a pool's operator may not apply a
        plan whose jobs exist in another pool (it would rewrite them)."""
        if pools is None:
            return
        if any(pool not in pools for pool in self.store.pools_of(ids).values()):
            raise Forbidden(
                f"manifest {manifest!r} has jobs in a pool this operator token does not act "
                "on; give this plan another name",
                detail={"field": "name"},
            )

    def _resolve_batch(
        self, specs: list[JobSpec], ids: list[str], pools: Sequence[str] | None = None
    ) -> list[JobSpec]:
        """Point ``job:NAME`` inputs at ids (names of this manifest first) and refuse
        jobs that would wait for each other. Packages must be blobs ``pools`` may read
        (None: any), as for a submit."""
        by_name: dict[str, list[str]] = {}
        for job_id, spec in zip(ids, specs, strict=True):
            by_name.setdefault(spec.name, []).append(job_id)
        for spec in specs:
            for ref in spec.dependencies:
                if len(by_name.get(ref, [])) > 1:
                    raise ValidationFailed(
                        f"job {spec.name!r}: input job:{ref}: several jobs of this manifest "
                        f"are named {ref!r}; give them distinct names",
                        detail={"job": spec.name, "field": "inputs"},
                    )
        batch = {name: found[0] for name, found in by_name.items()}
        resolved = [self.flow.resolve(s, batch, readable=pools) for s in specs]
        names = {i: s.name for i, s in zip(ids, specs, strict=True)}
        deps = {i: s.dependencies for i, s in zip(ids, resolved, strict=True)}
        self.flow.check_cycles(deps, names)
        return resolved

    # ---- reading ----------------------------------------------------------------------

    def job(self, ref: str, pools: Sequence[str] | None = None) -> JobRow:
        """A job by id, or by name when exactly one job has it; of ``pools`` only (None:
        every pool). A job in another pool is answered as unknown."""
        job = self.store.get_job(ref)
        if job is not None and (pools is None or job.pool in pools):
            return job
        named = self.store.find_jobs_by_name(ref, pools=pools)
        if len(named) == 1:
            return named[0]
        if named:
            raise NotFound(f"several jobs are named {ref!r}; use the job id", detail={"job": ref})
        raise NotFound(f"no job {ref!r}", detail={"job": ref})

    def why(
        self, ref: str, pools: Sequence[str] | None = None
    ) -> tuple[JobRow, str, list[tuple[WorkerState, str | None]]]:
        """The job, a one-line summary, and every worker's reason not to take it now (of
        the workers in ``pools``; None: every worker), each with its status."""
        job = self.job(ref, pools)
        now = self.clock()
        # The job does not hold a slot against itself.
        states = [
            self.fleet.state(s.row, [j for j in self.store.holding(s.row) if j.id != job.id])
            if job.target
            else s
            for s in self.fleet.states(pools)
        ]
        jv = JobView(job.id, job.spec, job.created_at)
        verdicts = explain(
            jv, [(s.view, s.free) for s in states], now, self.settings.prefer_cuda_grace
        )
        rows = [(s, reason) for s, (_, reason) in zip(states, verdicts, strict=True)]
        return job, self._why_summary(job, verdicts, now), rows

    def _why_summary(
        self, job: JobRow, verdicts: list[tuple[WorkerView, str | None]], now: float
    ) -> str:
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
        ready = [v.name for v, r in verdicts if r is None]
        if ready:
            return "claimable now by " + ", ".join(ready)
        if job.unrunnable or all(ever_reason(job.spec, v) for v, _ in verdicts):
            return "no registered worker could ever run this job"
        return "waiting: every worker that could run it is busy, reserved, draining or offline"

    # ---- operators and owners ---------------------------------------------------------

    def cancel(
        self, ref: str, pools: Sequence[str] | None = None, owner: str | None = None
    ) -> JobRow:
        """Cancel a job (of ``pools``; submitted by the token ``owner`` when given)."""
        job = self._steerable(ref, pools, owner, "cancel")
        for _ in range(3):  # a claim or a start may slip in between the read and the change
            done = self.store.cancel(lifecycle.cancel(job, self.clock()))
            if done is not None or job.status.terminal:
                break
            job = self.job(job.id)
        if done is None:
            raise Conflict(
                f"job {job.id} is {job.status.value}; "
                "only a pending, claimed or running job can be cancelled",
                detail={"job": job.id, "status": job.status.value},
            )
        if job.target:
            self.on_change()  # a slot it held for its worker is free for others
        return done.job

    def stop(
        self,
        ref: str,
        pools: Sequence[str] | None = None,
        owner: str | None = None,
        grace: float = 60.0,
    ) -> JobRow:
        """Ask a claimed or running job to finish early and keep what it made: its worker
        sends it SIGINT at its next heartbeat or log upload, and SIGTERM then SIGKILL if it
        is still running ``grace`` seconds later. Asking again changes nothing."""
        job = self._steerable(ref, pools, owner, "stop")
        if job.status.active and job.stop_requested_at is None:
            self.store.request_stop(job.id, self.clock(), grace)
            job = self.job(job.id)
        if not job.status.active:
            advice = "cancel it instead" if job.status == JobStatus.PENDING else "it has ended"
            raise Conflict(
                f"job {job.id} is {job.status.value}: nothing runs to stop early ({advice})",
                detail={"job": job.id, "status": job.status.value},
            )
        return job

    def requeue(
        self, ref: str, pools: Sequence[str] | None = None, owner: str | None = None
    ) -> JobRow:
        """Queue a failed or cancelled job again (of ``pools``; ``owner``'s when given)."""
        job = self._steerable(ref, pools, owner, "requeue")
        self.flow.check_requeue(job)
        done = self.store.requeue(lifecycle.requeue(job))
        if done is None:
            raise Conflict(
                f"job {job.id} is {job.status.value}; "
                "only a failed or cancelled job can be requeued",
                detail={"job": job.id, "status": job.status.value},
            )
        self.on_change()
        return done.job

    def _steerable(
        self, ref: str, pools: Sequence[str] | None, owner: str | None, what: str
    ) -> JobRow:
        """The job, if the caller may steer it: a submitter (``owner``: its token id)
        cancels, stops and requeues only the jobs it submitted; an operator any job of
        its pools."""
        job = self.job(ref, pools)
        if owner is not None and job.submitted_by != owner:
            raise Forbidden(
                f"job {job.id} was submitted by another token; a submitter may {what} only "
                "its own jobs (an operator of the pool may act on any: gpufleet tokens "
                "create --role operator --pool POOL)",
                detail={"job": job.id},
            )
        return job


def _no_worker(ref: str, pool: str) -> str:
    return f"no worker {ref!r} in pool {pool!r} (gpufleet workers lists them)"


def _check_aim(spec: JobSpec, workers: list[WorkerRow]) -> None:
    """A manifest job aimed at a worker names one of its own pool (or one not registered
    yet): one of another pool could never run it, and would look held. The worker is
    found as :meth:`Store.get_worker` finds it: by id, else by name."""
    ref = spec.requirements.worker
    if not ref:
        return
    w = next((w for w in workers if w.id == ref), None) or next(
        (w for w in workers if w.name == ref), None
    )
    if w is not None and w.pool != spec.pool:
        raise ValidationFailed(
            f"job {spec.name!r}: {_no_worker(ref, spec.pool)}",
            detail={"job": spec.name, "field": "worker"},
        )


def _not_now(state: WorkerState, verdict: Assignment | str) -> Conflict:
    """Why a worker a job is aimed at will not start it now, and what to do instead (the
    jobs named are of the worker's own pool)."""
    w = state.row
    running = [j.id for j in state.running]
    waiting = [j.id for j in state.waiting]
    doing = "; ".join(
        part
        for part in (
            f"running {', '.join(running)}" if running else "",
            f"{', '.join(waiting)} waits for it" if waiting else "",
        )
        if part
    )
    why = f": {verdict}" if isinstance(verdict, str) else ""
    return Conflict(
        f"worker {w.name} is {state.status.value}{f' ({doing})' if doing else ''} and will not "
        f"start this job now{why}. See who is free with 'gpufleet workers', let the server "
        "pick with --auto-select, or add --queue to wait for this worker",
        detail={"worker": w.id, "status": state.status.value, "reason": why[2:] or "busy"},
    )
