"""Queue policy: what submit, claim, heartbeat, finish and the sweep *mean*.

The store only persists; the lifecycle table in :mod:`gpufleet.domain.lifecycle` decides
every state change, and :mod:`gpufleet.scheduling` decides who may run what. Time comes
from an injected clock so the policy is testable without sleeping.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from gpufleet.domain.ids import manifest_job_id, new_job_id, new_worker_id
from gpufleet.domain.lifecycle import Event, backoff_seconds, failure_event, sources, transition
from gpufleet.domain.models import HostPolicy, JobSpec, JobStatus, WorkerStatus
from gpufleet.errors import Conflict, Forbidden, NotFound, ValidationFailed
from gpufleet.scheduling.matching import (
    Assignment,
    FreeGpu,
    FreeResources,
    JobView,
    WorkerView,
    effective_gpus,
    ever_reason,
    explain,
    now_reason,
    rank_key,
)
from gpufleet.server.blobs import BlobService
from gpufleet.server.dataflow import DataFlow
from gpufleet.store import JobRow, SqlStore, WorkerRow
from gpufleet.wire import (
    ApplyResult,
    HeartbeatRequest,
    HeartbeatResponse,
    HostModel,
    JobSpecModel,
    Lease,
    LeaseOrder,
    ManifestApply,
    WorkerRegister,
)

Clock = Callable[[], float]


def printable(text: str) -> str:
    """Job output is arbitrary bytes; a NUL cannot be stored in PostgreSQL text."""
    return text.replace("\x00", "\ufffd")


@dataclass(frozen=True)
class QueueSettings:
    lease_timeout: float = 120.0
    prefer_cuda_grace: float = 300.0
    retry_backoff: float = 10.0
    candidates: int = 200


class QueueService:
    """The server's queue: one instance per server process, shared by every request."""

    def __init__(
        self,
        store: SqlStore,
        settings: QueueSettings,
        blobs: BlobService,
        clock: Clock = time.time,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock
        self.on_change = on_change
        self.blobs = blobs
        self.flow = DataFlow(store, blobs, clock, self._changed)
        self._waiting: dict[str, tuple[WorkerView, FreeResources]] = {}
        self._waiting_lock = threading.Lock()
        self._policies: tuple[float, dict[str, HostPolicy]] = (0.0, {})
        self._claimers: dict[str, tuple[float, WorkerRow]] = {}

    def _changed(self) -> None:
        self.on_change()

    # ---- host policies ----------------------------------------------------------------

    def policies(self) -> dict[str, HostPolicy]:
        """Host policies from the last applied manifests (cached for a second)."""
        loaded_at, cached = self._policies
        if time.monotonic() - loaded_at < 1.0:
            return cached
        fresh = {
            name: HostModel.model_validate_json(raw).to_domain()
            for name, raw in self.store.host_policies().items()
        }
        self._policies = (time.monotonic(), fresh)
        return fresh

    def view(self, w: WorkerRow) -> WorkerView:
        return WorkerView(
            id=w.id,
            name=w.name,
            status=self.worker_status(w),
            capability=w.capability,
            labels=w.labels,
            pool=w.pool,
            policy=self.policies().get(w.name),
        )

    def worker_status(self, w: WorkerRow, active: int | None = None) -> WorkerStatus:
        if w.status == WorkerStatus.OFFLINE:
            return WorkerStatus.OFFLINE
        if w.drain:
            return WorkerStatus.DRAINING
        if active is None:
            return w.status
        return WorkerStatus.BUSY if active else WorkerStatus.IDLE

    def availability(self, w: WorkerRow, active: list[JobRow]) -> str:
        """What a user choosing a machine needs: available (a GPU is free, or on a machine
        without GPUs a CPU slot), reserved (not available, and a job is claimed but not yet
        started), busy, draining, offline, connecting."""
        status = self.worker_status(w)
        if status in (WorkerStatus.OFFLINE, WorkerStatus.DRAINING, WorkerStatus.CONNECTING):
            return status.value
        free = self.free_resources(w, active)
        # A GPU machine is for GPU work: with every GPU taken it is busy, CPU slot or not.
        if free.gpus or (free.cpu_slots and not effective_gpus(self.view(w))):
            return "available"
        if any(j.status == JobStatus.CLAIMED for j in active):
            return "reserved"
        return "busy"

    # ---- submitting -------------------------------------------------------------------

    def unrunnable_reason(self, spec: JobSpec, views: list[WorkerView] | None = None) -> str | None:
        """Why no registered worker could ever run ``spec`` (None: some worker could)."""
        if views is None:
            views = [self.view(w) for w in self.store.list_workers([spec.pool])]
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
    ) -> JobRow:
        """Queue ``spec`` in ``pool`` (None: its own). A job aimed at one worker
        (requirements.worker) that cannot take it now is refused (409) unless
        ``wait_for_target``. Its packages must be blobs the pools in ``readable`` may
        read (None: any); the job's pool may read them from then on."""
        spec = replace(spec, pool=pool or spec.pool)
        if spec.requirements.worker:
            self._check_target(spec, wait_for_target)
        job_id = new_job_id()
        spec = self.flow.resolve(spec, readable=readable)
        self.flow.grant_packages([spec])
        deps = {job_id: spec.dependencies}
        self.store.insert_jobs(
            [(job_id, spec, self.unrunnable_reason(spec))], self.clock(), deps=deps
        )
        self.flow.after_insert([job_id])
        self.on_change()
        return self.job(job_id)

    def _check_target(self, spec: JobSpec, wait: bool) -> None:
        ref = spec.requirements.worker
        assert ref is not None
        w = self.store.get_worker(ref)
        if w is None or w.pool != spec.pool:
            raise NotFound(
                f"no worker {ref!r} in pool {spec.pool!r} (gpufleet workers lists them)",
                detail={"worker": ref, "field": "requirements.worker"},
            )
        active = self.store.active_jobs(w.id)
        job = JobView("(new)", spec, self.clock())
        verdict = now_reason(job, self.view(w), self.free_resources(w, active), job.created_at, 0.0)
        state = self.availability(w, active)
        if wait or (state == "available" and isinstance(verdict, Assignment)):
            return
        running = ", ".join(j.id for j in active)
        doing = f" (running {running})" if running else ""
        why = f": {verdict}" if isinstance(verdict, str) else ""
        raise Conflict(
            f"worker {w.name} is {state}{doing} and will not start this job now{why}. "
            "See who is free with 'gpufleet workers', let the server pick with "
            "--auto-select, or add --queue to wait for this worker",
            detail={"worker": w.id, "status": state, "reason": why[2:] or state},
        )

    def apply(self, req: ManifestApply) -> ApplyResult:
        specs = [j.to_domain() for j in req.jobs]
        for spec in specs:
            if spec.manifest != req.name:
                raise ValidationFailed(
                    f"job {spec.name!r}: manifest is {spec.manifest!r}, expected {req.name!r}",
                    detail={"job": spec.name, "field": "manifest"},
                )
        ids = [manifest_job_id(s) for s in specs]
        if len(set(ids)) != len(ids):
            raise ValidationFailed("the manifest has two identical jobs", detail={"field": "jobs"})
        specs = self._resolve_batch(specs, ids)
        self.flow.grant_packages(specs)
        policies = {h.name: h.model_dump_json() for h in req.hosts}
        now = self.clock()
        self.store.replace_hosts(req.name, policies, now)
        self._policies = (0.0, {})
        views = [self.view(w) for w in self.store.list_workers()]
        unrunnable = {i: self.unrunnable_reason(s, views) for i, s in zip(ids, specs, strict=True)}
        created = self.store.insert_jobs(
            [(i, s, unrunnable[i]) for i, s in zip(ids, specs, strict=True)],
            now,
            deps={i: s.dependencies for i, s in zip(ids, specs, strict=True)},
        )
        self.flow.after_insert(created)
        fresh = set(created)
        updated = self.store.update_pending(
            [(i, s, unrunnable[i]) for i, s in zip(ids, specs, strict=True) if i not in fresh]
        )
        if created or updated:
            self.on_change()
        names = {v.name for v in views}
        changed = fresh | set(updated)
        return ApplyResult(
            manifest=req.name,
            created=created,
            updated=updated,
            unchanged=[i for i in ids if i not in changed],
            hosts=sorted(policies),
            unknown_hosts=sorted(h for h in policies if h not in names),
            unrunnable={i: r for i, r in unrunnable.items() if r and i in changed},
        )

    def _resolve_batch(self, specs: list[JobSpec], ids: list[str]) -> list[JobSpec]:
        """Point ``job:NAME`` inputs at ids (names of this manifest first) and refuse
        jobs that would wait for each other."""
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
        resolved = [self.flow.resolve(s, batch) for s in specs]
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

    def claimer(self, worker_id: str) -> WorkerRow:
        """A polling worker's row, cached for a second: claims are the hot path. Changes
        made through this service (register, heartbeat, drain) drop the cached row."""
        hit = self._claimers.get(worker_id)
        if hit and time.monotonic() - hit[0] < 1.0:
            return hit[1]
        w = self.worker(worker_id)
        self._claimers[worker_id] = (time.monotonic(), w)
        return w

    def forget(self, worker_id: str) -> None:
        self._claimers.pop(worker_id, None)

    def worker(self, ref: str, pools: Sequence[str] | None = None) -> WorkerRow:
        w = self.store.get_worker(ref)
        if w is None or (pools is not None and w.pool not in pools):
            raise NotFound(f"no worker {ref!r}", detail={"worker": ref})
        return w

    def own(self, worker_id: str, token_id: str, pools: Sequence[str] | None = None) -> WorkerRow:
        """The worker, if ``token_id`` enrolled it: only that token may act as it. A worker
        of a pool outside ``pools`` is unknown (404). A worker registered before workers
        were bound to tokens is bound to the first token of its pool that acts as it."""
        w = self.claimer(worker_id)
        if pools is not None and w.pool not in pools:
            raise NotFound(f"no worker {worker_id!r}", detail={"worker": worker_id})
        if w.token_id is None and self.store.bind_worker(w.id, token_id):
            self.forget(w.id)
            w = self.claimer(worker_id)
        if w.token_id != token_id:
            raise Forbidden(
                f"worker {w.name} ({w.id}) was enrolled with another token; "
                "a token acts only as the workers it registered",
                detail={"worker": w.id},
            )
        return w

    def check_holder(
        self, job_id: str, attempt: int, token_id: str, pools: Sequence[str] | None
    ) -> JobRow:
        """The job, if (job_id, attempt) is its current lease and the worker holding it was
        enrolled with ``token_id``: 404 for a job of a pool the caller cannot see, 409 for a
        stale lease, 403 for a lease another token's worker holds."""
        job = self._held(job_id, attempt, pools)
        holder = self.claimer(job.worker_id) if job.worker_id else None
        if holder is None or holder.token_id != token_id:
            raise Forbidden(
                f"job {job_id} attempt {attempt} is held by worker "
                f"{holder.name if holder else '?'}, not by a worker of this token",
                detail={"job": job_id, "attempt": attempt},
            )
        return job

    def free_resources(self, w: WorkerRow, active: list[JobRow]) -> FreeResources:
        """A worker's free slots as the server sees them (for ``why``)."""
        used_gpus = {g for j in active for g in j.gpus}
        cpu_used = sum(1 for j in active if not j.gpus)
        live = {g.index: g.free_mib for g in w.gpu_stats}
        gpus = tuple(
            FreeGpu(g.index, live.get(g.index, g.free_mib))
            for g in effective_gpus(self.view(w))
            if g.index not in used_gpus
        )
        return FreeResources(cpu_slots=max(0, w.cpu_slots - cpu_used), gpus=gpus)

    def why(
        self, ref: str, pools: Sequence[str] | None = None
    ) -> tuple[JobRow, str, list[tuple[WorkerView, str | None]]]:
        """The job, a one-line summary, and every worker's reason not to take it now (of
        the workers in ``pools``; None: every worker)."""
        job = self.job(ref, pools)
        now = self.clock()
        active = self.store.active_jobs()
        fleet = [
            (self.view(w), self.free_resources(w, [j for j in active if j.worker_id == w.id]))
            for w in self.store.list_workers(pools)
        ]
        jv = JobView(job.id, job.spec, job.created_at)
        verdicts = explain(jv, fleet, now, self.settings.prefer_cuda_grace)
        return job, self._why_summary(job, verdicts, now), verdicts

    def _why_summary(
        self, job: JobRow, verdicts: list[tuple[WorkerView, str | None]], now: float
    ) -> str:
        if job.status != JobStatus.PENDING:
            where = f" on {job.worker_id}" if job.worker_id and job.status.active else ""
            return f"job is {job.status.value}{where}, not waiting"
        if job.not_before and job.not_before > now:
            return f"retry backoff: claimable in {job.not_before - now:.0f}s"
        if not verdicts:
            return "no workers are registered"
        ready = [v.name for v, r in verdicts if r is None]
        if ready:
            return "claimable now by " + ", ".join(ready) + " (at their next poll)"
        if job.unrunnable or all(ever_reason(job.spec, v) for v, _ in verdicts):
            return "no registered worker could ever run this job"
        return "waiting: every worker that could run it is busy, draining or offline"

    # ---- operators --------------------------------------------------------------------

    def cancel(self, ref: str, pools: Sequence[str] | None = None) -> JobRow:
        job = self.job(ref, pools)
        now = self.clock()
        done = self.store.set_status(
            job.id,
            sources(Event.CANCEL),
            JobStatus.CANCELLED,
            finished_at=now,
            lease_expires_at=None,
            error="cancelled",
        )
        if not done:
            raise Conflict(
                f"job {job.id} is {job.status.value}; "
                "only a pending, claimed or running job can be cancelled",
                detail={"job": job.id, "status": job.status.value},
            )
        # The job's current attempt, read after the change: a claim may have slipped in
        # between our read and the cancel.
        cancelled = self.job(job.id)
        self.store.end_open_attempt(
            job.id, cancelled.lease, finished_at=now, outcome="cancelled", error="cancelled"
        )
        self.flow.ended(cancelled, JobStatus.CANCELLED)
        return cancelled

    def requeue(self, ref: str, pools: Sequence[str] | None = None) -> JobRow:
        job = self.job(ref, pools)
        self.flow.check_requeue(job)
        done = self.store.set_status(
            job.id,
            sources(Event.REQUEUE),
            JobStatus.PENDING,
            attempts=0,
            not_before=None,
            worker_id=None,
            gpus="[]",
            finished_at=None,
            started_at=None,
            exit_code=None,
            error=None,
        )
        if not done:
            raise Conflict(
                f"job {job.id} is {job.status.value}; "
                "only a failed or cancelled job can be requeued",
                detail={"job": job.id, "status": job.status.value},
            )
        self.flow.after_requeue(job.id)
        self.on_change()
        return self.job(job.id)

    def retire(self, token_id: str) -> list[str]:
        """A revoked token's workers go offline and their jobs back to the queue (the
        attempt is not counted: the job did not fail). Returns the requeued job ids."""
        requeued = []
        for w in self.store.list_workers():
            if w.token_id != token_id:
                continue
            for job in self.store.active_jobs(w.id):
                if self._hand_back(job, job.lease):
                    requeued.append(job.id)
            # drain too: a claim already past the token check cannot revive it; only
            # registering again (with a valid token) clears it.
            self.store.update_worker(w.id, status=WorkerStatus.OFFLINE.value, drain=True)
            self.forget(w.id)
        if requeued:
            self.on_change()
        return requeued

    def drain(self, ref: str) -> WorkerRow:
        w = self.worker(ref)
        self.store.update_worker(w.id, drain=True)
        self.forget(w.id)
        return self.worker(w.id)

    # ---- the worker protocol ----------------------------------------------------------

    def register(
        self, req: WorkerRegister, pool: str | None = None, token_id: str | None = None
    ) -> WorkerRow:
        """Register (or re-register) a worker by name into ``pool`` (None: the one it asks
        for, else ``default``), bound to the token enrolling it."""
        pool = pool or req.pool or "default"
        known = self.store.get_worker(req.name)
        if known is not None and known.name == req.name:
            self._check_reregister(known, req.name, pool, token_id)
        now = self.clock()
        values = {
            "name": req.name,
            "pool": pool,
            "token_id": token_id,
            "labels": json.dumps(req.labels),
            "capability": req.capability.model_dump_json(),
            "cpu_slots": req.cpu_slots,
            "ephemeral": req.ephemeral,
            "status": WorkerStatus.IDLE.value,
            "drain": False,
            "gpu_stats": json.dumps([g.model_dump() for g in req.capability.gpus]),
            "registered_at": now,
            "last_heartbeat": now,
        }
        worker_id = self.store.upsert_worker(new_worker_id(), values)
        self.forget(worker_id)
        if req.running:
            self.store.extend_leases(
                [(r.job_id, r.attempt) for r in req.running],
                now + self.settings.lease_timeout,
                worker_id,
            )
        self.on_change()
        return self.worker(worker_id)

    def _check_reregister(
        self, known: WorkerRow, name: str, pool: str, token_id: str | None
    ) -> None:
        """A name stays with the token that enrolled it (until that token is revoked or
        expires), and a worker changes pool only with no job running."""
        owner = self.store.get_token(known.token_id) if known.token_id else None
        live = (
            owner is not None
            and owner.revoked_at is None
            and (owner.expires_at is None or owner.expires_at > self.clock())
        )
        if live and known.token_id != token_id:
            raise Forbidden(
                f"worker name {name!r} is enrolled with another token; pick another "
                "--name, or revoke that token first",
                detail={"worker": known.id, "field": "name"},
            )
        if known.token_id is None and known.pool != pool:
            raise Forbidden(
                f"worker name {name!r} is in pool {known.pool!r}, not {pool!r}",
                detail={"worker": known.id, "field": "pool"},
            )
        if known.pool != pool and self.store.active_jobs(known.id):
            raise Conflict(
                f"worker {name!r} runs jobs of pool {known.pool!r}; it can move to pool "
                f"{pool!r} once they end",
                detail={"worker": known.id, "field": "pool"},
            )

    def _better_waiting(self, job: JobView, me: WorkerView, mine: Assignment, now: float) -> bool:
        """Whether another polling worker ranks better for ``job`` (host priority, best fit)."""
        my_rank = rank_key(job.spec, me, mine)
        with self._waiting_lock:
            others = [v for k, v in self._waiting.items() if k != me.id]
        for view, free in others:
            # The best rank this worker could have; most of the time it cannot beat ours and
            # the full check is skipped.
            priority = view.policy.priority if view.policy else 0
            if not (-priority, 0, 0) < my_rank:
                continue
            verdict = now_reason(job, view, free, now, self.settings.prefer_cuda_grace)
            if isinstance(verdict, Assignment) and rank_key(job.spec, view, verdict) < my_rank:
                return True
        return False

    def poll(
        self,
        worker_id: str,
        free: FreeResources,
        wait: float,
        token_id: str | None = None,
        pools: Sequence[str] | None = None,
    ) -> Lease | None:
        """Start a poll and try once. A worker that will wait counts as waiting, so better
        ranked jobs are left for it; one that will not wait is nobody to leave a job for.
        With ``token_id``, only the token that enrolled the worker may poll for it."""
        if token_id is not None:
            self.own(worker_id, token_id, pools)
        if wait > 0:
            self.wait_begin(worker_id, free)
        else:
            self.revive(self.claimer(worker_id))
        return self.try_claim(worker_id, free)

    def revive(self, w: WorkerRow) -> WorkerRow:
        """A polling worker is alive, heartbeat or not."""
        if w.status != WorkerStatus.OFFLINE:
            return w
        self.store.update_worker(w.id, status=WorkerStatus.IDLE.value, last_heartbeat=self.clock())
        self.forget(w.id)
        return self.claimer(w.id)

    def wait_begin(self, worker_id: str, free: FreeResources) -> None:
        w = self.revive(self.claimer(worker_id))
        with self._waiting_lock:
            self._waiting[worker_id] = (self.view(w), free)

    def wait_end(self, worker_id: str) -> None:
        with self._waiting_lock:
            self._waiting.pop(worker_id, None)

    def try_claim(self, worker_id: str, free: FreeResources) -> Lease | None:
        """Claim the best job this worker may run now, or None."""
        w = self.claimer(worker_id)
        if w.drain or w.status in (WorkerStatus.OFFLINE, WorkerStatus.DRAINING):
            return None
        me = self.view(w)
        now = self.clock()

        def choose(job: JobRow) -> tuple[int, ...] | None:
            jv = JobView(job.id, job.spec, job.created_at)
            verdict = now_reason(jv, me, free, now, self.settings.prefer_cuda_grace)
            if isinstance(verdict, str) or self._better_waiting(jv, me, verdict, now):
                return None
            return verdict.gpus

        expires = now + self.settings.lease_timeout
        claimed = self.store.claim_next(w, now, expires, choose, self.settings.candidates)
        if claimed is None:
            return None
        job, lease, gpus = claimed
        return Lease(
            job_id=job.id,
            attempt=lease,
            spec=JobSpecModel.from_domain(job.spec),
            gpus=list(gpus),
            lease_timeout=self.settings.lease_timeout,
            inputs=self.flow.staged(job.spec) if job.spec.inputs else [],
        )

    def _held(self, job_id: str, attempt: int, pools: Sequence[str] | None = None) -> JobRow:
        """The job if (job_id, attempt) is its current lease: 404 for no job (or one of a
        pool outside ``pools``), 409 for a stale lease."""
        job = self.store.get_job(job_id)
        if job is None or (pools is not None and job.pool not in pools):
            raise NotFound(f"no job {job_id!r}", detail={"job": job_id})
        if job.lease != attempt or not job.status.active:
            raise Conflict(
                f"stale lease: job {job_id} attempt {attempt} is no longer yours "
                f"(job is {job.status.value}, current attempt {job.lease}); stop it",
                detail={"job": job_id, "attempt": attempt, "status": job.status.value},
            )
        return job

    def start(self, job_id: str, attempt: int) -> None:
        self._held(job_id, attempt)
        now = self.clock()
        if not self.store.start(job_id, attempt, now, now + self.settings.lease_timeout):
            job = self._held(job_id, attempt)
            if job.status == JobStatus.RUNNING:  # a retried start whose answer was lost
                return
            raise Conflict(
                f"job {job_id} attempt {attempt} was already started",
                detail={"job": job_id, "attempt": attempt},
            )

    def heartbeat(self, worker_id: str, req: HeartbeatRequest) -> HeartbeatResponse:
        w = self.worker(worker_id)
        now = self.clock()
        held = self.store.extend_leases(
            [(r.job_id, r.attempt) for r in req.leases], now + self.settings.lease_timeout, w.id
        )
        status = (
            WorkerStatus.DRAINING
            if (w.drain or req.draining)
            else (WorkerStatus.BUSY if req.leases else WorkerStatus.IDLE)
        )
        values: dict[str, object] = {"last_heartbeat": now, "status": status.value}
        if req.gpus:
            values["gpu_stats"] = json.dumps([g.model_dump() for g in req.gpus])
        self.store.update_worker(w.id, **values)
        self.forget(w.id)
        orders = [
            LeaseOrder(
                job_id=r.job_id,
                attempt=r.attempt,
                order="continue" if (r.job_id, r.attempt) in held else "cancel",
            )
            for r in req.leases
        ]
        return HeartbeatResponse(orders=orders, drain=w.drain)

    def append_logs(self, job_id: str, attempt: int, lines: Sequence[tuple[str, str]]) -> None:
        lines = [(stream, printable(line)) for stream, line in lines]
        if not self.store.append_logs(job_id, attempt, lines, self.clock()):
            self._held(job_id, attempt)

    def finish(self, job_id: str, attempt: int, exit_code: int | None, error: str | None) -> JobRow:
        """Record the end of an attempt: success, a retry after backoff, or failure."""
        job = self._held(job_id, attempt)
        now = self.clock()
        used = job.attempts + 1
        if exit_code == 0 and error is None:
            event, outcome = Event.SUCCEED, "succeeded"
        else:
            event, outcome = failure_event(used, job.max_attempts), "failed"
            error = printable(error) if error else f"exit code {exit_code}"
        status = transition(job.status, event)
        not_before = (
            now + backoff_seconds(used, self.settings.retry_backoff)
            if event == Event.RETRY
            else None
        )
        ok = self.store.finish(
            job,
            attempt,
            sources(event),
            status,
            now=now,
            attempts=used,
            outcome=outcome,
            exit_code=exit_code,
            error=error,
            not_before=not_before,
        )
        if not ok:
            self._held(job_id, attempt)
            raise Conflict(f"job {job_id} changed while finishing; retry", detail={"job": job_id})
        if status == JobStatus.PENDING:
            self.on_change()
        finished = self.job(job_id)
        if status.terminal:
            self.flow.ended(finished, status)
        return finished

    def attach_artifact(self, job_id: str, attempt: int, sha256: str) -> None:
        self.flow.attach(self._held(job_id, attempt), attempt, sha256)

    def release(self, job_id: str, attempt: int, reason: str) -> JobRow:
        """A draining worker hands a job back; the attempt is not counted."""
        job = self._held(job_id, attempt)
        if not self._hand_back(job, attempt):
            self._held(job_id, attempt)
        self.on_change()
        return self.job(job_id)

    def _hand_back(self, job: JobRow, attempt: int) -> bool:
        return self.store.finish(
            job,
            attempt,
            sources(Event.RELEASE),
            JobStatus.PENDING,
            now=self.clock(),
            attempts=job.attempts,
            outcome="released",
            error=job.error,
        )

    def after_outage(self) -> int:
        """At server start: if no worker heartbeated within a third of the lease, extend
        every active lease by one lease timeout. Returns how many were extended."""
        now = self.clock()
        beats = [w.last_heartbeat for w in self.store.list_workers() if w.last_heartbeat]
        if beats and now - max(beats) < self.settings.lease_timeout / 3:
            return 0
        return self.store.extend_all_leases(now + self.settings.lease_timeout)

    def sweep(self) -> tuple[list[str], list[str]]:
        """Expire leases of silent workers and mark those workers offline."""
        now = self.clock()
        names = {w.id: w.name for w in self.store.list_workers()}
        requeued: list[str] = []
        for job in self.store.expired_leases(now):
            used = job.attempts + 1
            event = failure_event(used, job.max_attempts, lost=True)
            who = names.get(job.worker_id or "", job.worker_id)
            error = f"lease expired: worker {who} stopped heartbeating"
            if self.store.finish(
                job,
                job.lease,
                sources(event),
                transition(job.status, event),
                now=now,
                attempts=used,
                outcome="lost",
                error=error,
                expired_before=now,
            ):
                requeued.append(job.id)
                if event == Event.LOSE_FINAL:
                    self.flow.ended(job, JobStatus.FAILED)
        if self.store.refresh_waiting():  # dependencies met by another replica
            self.on_change()
        offline = self.store.mark_offline(now - self.settings.lease_timeout)
        for worker_id in offline:
            self.forget(worker_id)
        if requeued:
            self.on_change()
        return requeued, offline
