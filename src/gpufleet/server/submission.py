"""Submitting jobs and applying manifests: each job checked (its packages, its
dependencies, the worker it is aimed at) and inserted in one transaction with its
dependencies; a manifest's new jobs, its changes to pending ones and its host policies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from gpufleet.domain.environments import EnvSpec
from gpufleet.domain.ids import manifest_job_id, new_job_id
from gpufleet.domain.models import HostPolicy, JobSpec, WorkerStatus
from gpufleet.errors import Conflict, Forbidden, NotFound, ValidationFailed
from gpufleet.scheduling.matching import (
    Assignment,
    JobView,
    WorkerView,
    ever_reason,
    now_reason,
    python_matches,
)
from gpufleet.server.dataflow import DataFlow
from gpufleet.server.fleet import Fleet, WorkerState
from gpufleet.server.metrics import Metrics
from gpufleet.server.reads import Reads
from gpufleet.store import Batch, Hosts, JobRow, Store, Submitted, WorkerRow, json_columns
from gpufleet.wire import ApplyResult, ManifestApply


def check_python(spec: JobSpec, workers: Sequence[WorkerRow]) -> None:
    """Refuse (422) a job whose environment asks for a Python that no worker of its pool
    can provide, naming the version and what the workers have. Workers that report no
    Pythons (from before environments) are not judged; with none judged, it is taken."""
    env = spec.environment
    wanted = env.python if isinstance(env, EnvSpec) else None
    if wanted is None:
        return
    judged = [
        w
        for w in workers
        if w.pool == spec.pool and (w.capability.pythons or w.capability.python_downloads)
    ]
    if not judged:
        return
    for w in judged:
        cap = w.capability
        if cap.python_downloads or any(python_matches(wanted, p) for p in cap.pythons):
            return
    have = "; ".join(f"{w.name}: {', '.join(w.capability.pythons)}" for w in judged[:10])
    raise ValidationFailed(
        f"job {spec.name!r}: environment: no worker of pool {spec.pool!r} can provide "
        f"Python {wanted} ({have})",
        detail={"job": spec.name, "field": "environment.python", "python": wanted},
    )


class Submission:
    """Submit and apply; one per server process."""

    def __init__(
        self,
        store: Store,
        reads: Reads,
        fleet: Fleet,
        flow: DataFlow,
        clock: Callable[[], float],
        on_change: Callable[[], None],
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics or Metrics()
        self.reads = reads
        self.fleet = fleet
        self.flow = flow
        self.clock = clock
        self.on_change = on_change

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
        by: str | None = None,
    ) -> JobRow:
        """Queue ``spec`` in ``pool`` (None: its own), as submitted by the token
        ``submitted_by``. A job aimed at one worker (requirements.worker) that cannot take
        it now is refused (409) unless ``wait_for_target``; accepted, it holds that
        worker's slot until the worker claims it. Its packages must be blobs the pools in
        ``readable`` may read (None: any); the job's pool may read them from then on."""
        spec = replace(spec, pool=pool or spec.pool)
        check_python(spec, self.store.list_workers([spec.pool]))
        target = self._target(spec) if spec.requirements.worker else None
        job_id = new_job_id()
        spec = self.flow.resolve(spec, readable=readable)
        batch = Batch(
            [(job_id, spec, self.unrunnable_reason(spec))],
            deps={job_id: spec.dependencies},
            submitted_by=submitted_by,
            by=by,
            grants=self.flow.package_grants([spec]),
        )
        if target is None or wait_for_target:
            self.store.submit(batch, self.clock())
        else:
            # Judged in the insert's own transaction, the worker held: two submits aimed
            # at one worker cannot both find it free. (The host policies are read before.)
            policies = self.fleet.policies()
            with self.store.transaction() as tx:
                self._check_free(spec, target, tx.store.hold_worker(target), policies)
                tx.store.submit(batch, self.clock())
        self.metrics.submitted.inc()
        self.on_change()
        return self.reads.job(job_id)

    def _target(self, spec: JobSpec) -> WorkerRow:
        """The worker ``spec`` is aimed at: it must exist in the job's pool."""
        ref = spec.requirements.worker
        assert ref is not None
        w = self.store.get_worker(ref)
        if w is None or w.pool != spec.pool:
            raise NotFound(
                _no_worker(ref, spec.pool), detail={"worker": ref, "field": "requirements.worker"}
            )
        return w

    def _check_free(
        self,
        spec: JobSpec,
        w: WorkerRow,
        holding: list[JobRow],
        policies: Mapping[str, HostPolicy],
    ) -> None:
        """Refuse (409) ``spec`` unless ``w``, holding ``holding``, can start it now under
        the host ``policies``."""
        state = self.fleet.state(w, holding, policies)
        now = self.clock()
        verdict = now_reason(JobView("(new)", spec, now), state.view, state.free, now, 0.0)
        if isinstance(verdict, Assignment) and state.view.status in (
            WorkerStatus.AVAILABLE,
            WorkerStatus.CONNECTING,
        ):
            return
        raise _not_now(state, verdict)

    def apply(
        self,
        req: ManifestApply,
        pools: Sequence[str] | None = None,
        submitted_by: str | None = None,
        by: str | None = None,
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
        hosts = _manifest_hosts(req, workers, pools, by)
        policies = self.fleet.policies_after(hosts)
        views = [self.fleet.view(w, policies) for w in workers]
        unrunnable = {i: self.unrunnable_reason(s, views) for i, s in zip(ids, specs, strict=True)}
        batch = Batch(
            [(i, s, unrunnable[i]) for i, s in zip(ids, specs, strict=True)],
            deps={i: s.dependencies for i, s in zip(ids, specs, strict=True)},
            submitted_by=submitted_by,
            by=by,
            grants=self.flow.package_grants(specs),
            hosts=hosts,
            update=True,
        )
        written = self.store.submit(batch, self.clock())  # one transaction, all or nothing
        self.fleet.policies_changed()
        created, updated = written.created, written.updated
        self.metrics.submitted.inc(len(created))
        if created or updated:
            self.on_change()
        return self._applied(req, pools, ids, written, hosts, views, unrunnable)

    def _applied(
        self,
        req: ManifestApply,
        pools: Sequence[str] | None,
        ids: list[str],
        written: Submitted,
        hosts: Hosts,
        views: list[WorkerView],
        unrunnable: dict[str, str | None],
    ) -> ApplyResult:
        """What :meth:`apply` answers: the jobs created, updated, unchanged and absent, the
        hosts it names (and those no worker has), the changed jobs no worker can run."""
        created, updated = written.created, written.updated
        names = {v.name for v in views}
        changed = set(created) | set(updated)
        planned = set(ids)
        return ApplyResult(
            manifest=req.name,
            created=created,
            updated=updated,
            unchanged=[i for i in ids if i not in changed],
            absent=[i for i, _ in self.store.manifest_jobs(req.name, pools) if i not in planned],
            hosts=sorted(hosts.policies),
            unknown_hosts=sorted(h for h in hosts.policies if h not in names),
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
            check_python(spec, workers)
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


def _no_worker(ref: str, pool: str) -> str:
    return f"no worker {ref!r} in pool {pool!r} (gpufleet workers lists them)"


def _manifest_hosts(
    req: ManifestApply, workers: list[WorkerRow], pools: Sequence[str] | None, by: str | None
) -> Hosts:
    """The manifest's hosts entries; a pool's operator replaces only what the manifest
    said about its own workers."""
    mine = None if pools is None else [w.name for w in workers if w.pool in pools]
    origin = json_columns.HostOrigin(file=req.file, applied_by=by)
    entries = {
        h.name: json_columns.host_entry(h.model_dump(mode="json"), origin) for h in req.hosts
    }
    return Hosts(req.name, entries, within=mine)


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
