"""Matching a job's requirements against a worker's capability, and ranking workers.

Hard constraints decide who *may* run a job; each check returns the reason it rejects, so
the same code answers "can this worker take it?" and "why is this job still waiting?".
Time comes in as an argument (``now``, seconds since the epoch): nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase

from gpufleet.domain.environments import EnvSpec
from gpufleet.domain.models import (
    MIB_PER_GIB,
    Capability,
    GpuInfo,
    HostPolicy,
    JobSpec,
    WorkerStatus,
    covering_mount,
)


@dataclass(frozen=True)
class WorkerView:
    id: str
    name: str
    status: WorkerStatus
    capability: Capability
    labels: dict[str, str] = field(default_factory=dict)
    pool: str = "default"
    policy: HostPolicy | None = None
    cpu_slots: int = 1
    # The spec keys of the environments the worker has built (domain.environments).
    environments: frozenset[str] = frozenset()


@dataclass(frozen=True)
class JobView:
    id: str
    spec: JobSpec
    created_at: float


@dataclass(frozen=True)
class FreeGpu:
    index: int
    free_mib: int


@dataclass(frozen=True)
class FreeResources:
    """What a worker has free right now: CPU slots and GPUs not given to a job."""

    cpu_slots: int
    gpus: tuple[FreeGpu, ...] = ()


@dataclass(frozen=True)
class Assignment:
    """Where a job would run on a worker: the GPU indices (empty: a CPU slot)."""

    gpus: tuple[int, ...]
    vram_mib: int = 0


def _glob(value: str, pattern: str) -> bool:
    v, p = value.lower(), pattern.lower()
    return fnmatchcase(v, p) or fnmatchcase(v.removeprefix("nvidia "), p)


def effective_gpus(worker: WorkerView) -> tuple[GpuInfo, ...]:
    """Detected GPUs intersected with what the host's manifest entry declares."""
    gpus = worker.capability.gpus
    declared = worker.policy.declared if worker.policy else None
    if declared is None:
        return gpus
    if declared.cuda is False:
        return ()
    if declared.gpus is not None:
        gpus = gpus[: declared.gpus]
    if declared.vram_gib is not None:
        cap = int(declared.vram_gib * MIB_PER_GIB)
        gpus = tuple(
            GpuInfo(
                g.index,
                g.name,
                min(g.total_mib, cap),
                min(g.free_mib, cap),
                g.uuid,
                g.compute_capability,
                g.simulated,
            )
            for g in gpus
        )
    return gpus


def effective_ram_gib(worker: WorkerView) -> float:
    ram = worker.capability.ram_mib / MIB_PER_GIB
    declared = worker.policy.declared if worker.policy else None
    if declared is not None and declared.ram_gib is not None:
        ram = min(ram, declared.ram_gib)
    return ram


def memory_text(gib: float) -> str:
    """GPU memory a job asks for, as the user gave it: whole or tenths of a GiB in GiB
    ("40 GiB"); else in MiB, as ``--min-gpu-memory`` takes it, with the GiB beside it
    ("100000 MiB (97.7 GiB)", not "97.6562 GiB")."""
    if round(gib, 1) == gib:
        return f"{gib:g} GiB"
    mib = gib * MIB_PER_GIB
    if mib == round(mib):
        return f"{round(mib)} MiB ({gib:.1f} GiB)"
    return f"{gib:.1f} GiB"


def _gpu_fits(job: JobSpec, gpu: GpuInfo) -> bool:
    req = job.requirements
    if req.gpu_name and not _glob(gpu.name, req.gpu_name):
        return False
    return gpu.total_mib >= req.min_vram_gib * MIB_PER_GIB


def _must_use_gpu(job: JobSpec, worker: WorkerView) -> bool:
    """Whether the job may run on this worker only on its GPUs: it names a GPU, or it was
    aimed at this worker (picked for its GPUs) and the worker has some."""
    req = job.requirements
    if req.cpu_only:
        return False
    return req.needs_gpu or (req.worker is not None and bool(effective_gpus(worker)))


def _gpu_job(job: JobSpec, worker: WorkerView) -> bool:
    """Whether the job runs on this worker's GPUs (else in a CPU slot)."""
    req = job.requirements
    if _must_use_gpu(job, worker):
        return True
    if req.cpu_only or not req.prefer_cuda:
        return False
    # prefer_cuda: a GPU job where a fitting GPU exists, a CPU job elsewhere.
    fitting = [g for g in effective_gpus(worker) if _gpu_fits(job, g)]
    return len(fitting) >= req.gpus_wanted


def runs_on_gpus(job: JobSpec, worker: WorkerView) -> bool:
    """Whether the job would run on this worker's GPUs (else in a CPU slot)."""
    return _gpu_job(job, worker)


def _policy_reasons(job: JobSpec, worker: WorkerView) -> Iterator[str]:
    policy = worker.policy
    if policy is None:
        return
    model = job.model or job.name
    if any(_glob(model, p) for p in policy.deny_jobs):
        yield f"host {worker.name} denies model {model!r} (deny_jobs)"
    if policy.allow_jobs is not None and not any(_glob(model, p) for p in policy.allow_jobs):
        allowed = ", ".join(policy.allow_jobs) or "nothing"
        yield f"host {worker.name} allows only {allowed} (allow_jobs), not {model!r}"


def _placement_reasons(job: JobSpec, worker: WorkerView) -> Iterator[str]:
    """Every placement constraint the worker fails, one reason each, cheapest first (a
    caller that wants the first stops there)."""
    req = job.requirements
    if job.pool != worker.pool:
        yield f"job is in pool {job.pool!r}, worker in pool {worker.pool!r}"
    if req.worker and req.worker not in (worker.id, worker.name):
        yield f"job targets worker {req.worker!r}"
    if req.allowed_hosts and not any(_glob(worker.name, p) for p in req.allowed_hosts):
        yield f"host {worker.name} is not in allowed_hosts ({', '.join(req.allowed_hosts)})"
    for key, pattern in req.labels.items():
        have = worker.labels.get(key)
        if have is None:
            yield f"worker has no label {key!r} (job wants {key}={pattern})"
        elif not _glob(have, pattern):
            yield f"label {key}={have!r} does not match {pattern!r}"
    for path in job.shared_paths:
        if covering_mount(path, worker.capability.mounts) is None:
            yield f"reads {path} in place; no --mount of this worker holds it"
    for tool in req.tools:
        if tool not in worker.capability.tools:
            have = ", ".join(worker.capability.tools) or "none"
            yield f"needs {tool} on the worker's PATH (tools); worker has {have}"
    python = _python_reason(job, worker)
    if python:
        yield python
    yield from _policy_reasons(job, worker)


def _gpu_reason(job: JobSpec, worker: WorkerView) -> str | None:
    req = job.requirements
    gpus = effective_gpus(worker)
    if not gpus:
        return f"needs a GPU ({', '.join(req.gpu_constraints)}); worker has none"
    if len(gpus) < req.gpus_wanted:
        return f"needs {req.gpus_wanted} GPUs; worker has {len(gpus)}"
    named = [g for g in gpus if not req.gpu_name or _glob(g.name, req.gpu_name)]
    if len(named) < req.gpus_wanted:
        names = ", ".join(sorted({g.name for g in gpus}))
        return (
            f"needs {req.gpus_wanted} GPU(s) matching {req.gpu_name!r}; "
            f"{len(named)} of the worker's GPUs match ({names})"
        )
    fitting = [g for g in named if _gpu_fits(job, g)]
    if len(fitting) < req.gpus_wanted:
        largest = max(g.total_gib for g in named)
        need = memory_text(req.min_vram_gib)
        return f"needs {need} VRAM per GPU; largest GPU has {largest:.1f} GiB"
    return None


def ever_reasons(job: JobSpec, worker: WorkerView) -> Iterator[str]:
    """Every reason ``worker`` could never run ``job`` whatever its load (none: it could),
    lazily: the first costs only the checks before it."""
    yield from _placement_reasons(job, worker)
    req = job.requirements
    ram = effective_ram_gib(worker)
    if req.min_ram_gib > ram:
        yield f"needs {req.min_ram_gib:g} GiB RAM; worker has {ram:.1f} GiB"
    if _must_use_gpu(job, worker):
        gpu = _gpu_reason(job, worker)
        if gpu:
            yield gpu
    elif worker.cpu_slots == 0 and not (req.prefer_cuda and not req.cpu_only):
        yield "runs in a CPU slot; worker has none (--slots 0)"


def ever_reason(job: JobSpec, worker: WorkerView) -> str | None:
    """Why ``worker`` could never run ``job`` whatever its load, or None if it could."""
    return next(ever_reasons(job, worker), None)


def assign(job: JobSpec, worker: WorkerView, free: FreeResources) -> Assignment | str:
    """Where the job would run on this worker now (best fit), or why it cannot."""
    if not _gpu_job(job, worker):
        if free.cpu_slots <= 0:
            return "no free CPU slot"
        return Assignment(gpus=())
    usable = {g.index: g for g in effective_gpus(worker) if _gpu_fits(job, g)}
    need_mib = int(job.requirements.min_vram_gib * MIB_PER_GIB)
    candidates = sorted(
        (f for f in free.gpus if f.index in usable and f.free_mib >= need_mib),
        key=lambda f: (usable[f.index].total_mib, f.free_mib, f.index),
    )
    wanted = job.requirements.gpus_wanted
    if len(candidates) < wanted:
        if need_mib:
            return (
                f"needs {wanted} free GPU(s) with {memory_text(job.requirements.min_vram_gib)} free"
            )
        return f"needs {wanted} free GPU(s); {len(candidates)} free"
    chosen = candidates[:wanted]
    return Assignment(
        gpus=tuple(sorted(c.index for c in chosen)),
        vram_mib=sum(usable[c.index].total_mib for c in chosen),
    )


def now_reasons(
    job: JobView, worker: WorkerView, free: FreeResources, now: float, prefer_cuda_grace: float
) -> Assignment | list[str]:
    """Whether ``worker`` may take ``job`` right now: an assignment, or every reason it may
    not (its state, and each constraint it fails; what it lacks now only when nothing
    else stands in the way)."""
    reasons = list(ever_reasons(job.spec, worker))
    if worker.status in (WorkerStatus.DRAINING, WorkerStatus.OFFLINE):
        reasons.insert(0, f"worker is {worker.status.value}")
    if reasons:
        return reasons
    fit = _fit_now(job, worker, free, now, prefer_cuda_grace)
    return [fit] if isinstance(fit, str) else fit


def now_reason(
    job: JobView, worker: WorkerView, free: FreeResources, now: float, prefer_cuda_grace: float
) -> Assignment | str:
    """Whether ``worker`` may take ``job`` right now: an assignment, or the reason it may not."""
    if worker.status in (WorkerStatus.DRAINING, WorkerStatus.OFFLINE):
        return f"worker is {worker.status.value}"
    return ever_reason(job.spec, worker) or _fit_now(job, worker, free, now, prefer_cuda_grace)


def _fit_now(
    job: JobView, worker: WorkerView, free: FreeResources, now: float, prefer_cuda_grace: float
) -> Assignment | str:
    """For a worker that could run ``job``: where it would run now, or why not yet (the
    CUDA grace window, or no free slot)."""
    req = job.spec.requirements
    if req.prefer_cuda and not _gpu_job(job.spec, worker):
        waited = now - job.created_at
        if waited < prefer_cuda_grace:
            left = prefer_cuda_grace - waited
            return (
                f"prefers CUDA; a CPU worker may take it after the grace window ({left:.0f}s left)"
            )
    return assign(job.spec, worker, free)


def rank_key(job: JobSpec, worker: WorkerView, assignment: Assignment) -> tuple[int, int, int, int]:
    """Lower ranks first: higher host priority, then the smallest GPU that is big enough,
    then the worker that has the job's environment built, then (for CPU jobs) the worker
    with fewer GPUs, so GPU boxes stay free for GPU work."""
    priority = worker.policy.priority if worker.policy else 0
    return (
        -priority,
        assignment.vram_mib,
        0 if warm(job, worker) else 1,
        len(effective_gpus(worker)),
    )


def warm(job: JobSpec, worker: WorkerView) -> bool:
    """Whether ``worker`` has ``job``'s environment built (a job without one: always)."""
    env = job.environment
    return not isinstance(env, EnvSpec) or env.key() in worker.environments


def python_matches(wanted: str, have: str) -> bool:
    """Whether a Python of version ``have`` (3.12.4) is one ``wanted`` (3, 3.12, 3.12.4)."""
    return have == wanted or have.startswith(wanted + ".")


def _python_reason(job: JobSpec, worker: WorkerView) -> str | None:
    env = job.environment
    wanted = env.python if isinstance(env, EnvSpec) else None
    cap = worker.capability
    if wanted is None or cap.python_downloads or not cap.pythons:
        return None  # a worker that reports none is from before environments: not judged
    if any(python_matches(wanted, have) for have in cap.pythons):
        return None
    return f"needs Python {wanted}; worker has {', '.join(cap.pythons)}"


def explain(
    job: JobView,
    workers: list[tuple[WorkerView, FreeResources]],
    now: float,
    prefer_cuda_grace: float,
) -> list[tuple[WorkerView, list[str]]]:
    """For every worker, every reason it will not take the job now (none: it may)."""
    out: list[tuple[WorkerView, list[str]]] = []
    for worker, free in workers:
        verdict = now_reasons(job, worker, free, now, prefer_cuda_grace)
        out.append((worker, verdict if isinstance(verdict, list) else []))
    return out


def free_gpu_mib(free: FreeResources) -> int:
    """The GPU memory a worker has free now, over the GPUs no job holds."""
    return sum(g.free_mib for g in free.gpus)


@dataclass(frozen=True)
class Choice:
    """A worker as a user choosing one sees it for a job aimed at it: where the job would
    run there now (an assignment) or why it would not, whether it would run on the
    worker's GPUs (else in a CPU slot), and whether it could ever (what stops it now, if
    anything, is only its load)."""

    worker: WorkerView
    free: FreeResources
    verdict: Assignment | str
    on_gpu: bool
    ever: bool

    @property
    def reason(self) -> str | None:
        return self.verdict if isinstance(self.verdict, str) else None

    @property
    def gpus(self) -> tuple[int, ...]:
        return () if isinstance(self.verdict, str) else self.verdict.gpus

    @property
    def gpu_free_mib(self) -> int | None:
        """The free memory of the GPU the job would get now (of several, the least):
        what it has to work with there, not the worker's sum. None: no GPU now."""
        if not self.gpus:
            return None
        free = {g.index: g.free_mib for g in self.free.gpus}
        return min(free.get(i, 0) for i in self.gpus)


def _choice_rank(c: Choice) -> tuple[int, int, int, str]:
    """Those that could start the job now first: on a GPU, the one whose GPU has the most
    free memory leading; then in a CPU slot, machines with fewer GPUs first (GPU boxes stay
    free for GPU work); then those that cannot, by name."""
    priority = c.worker.policy.priority if c.worker.policy else 0
    if c.reason is not None:
        return (2, 0, 0, c.worker.name)
    if c.gpus:
        return (0, -(c.gpu_free_mib or 0), -priority, c.worker.name)
    return (1, -priority, len(effective_gpus(c.worker)), c.worker.name)


def selection(
    job: JobView,
    workers: list[tuple[WorkerView, FreeResources]],
    now: float,
    prefer_cuda_grace: float,
) -> list[Choice]:
    """Workers as a user choosing one sees them, best first (:func:`_choice_rank`). Each
    is judged as if the job were aimed at it, as it will be once chosen (so a GPU worker
    is judged on a free GPU, unless the job is ``cpu_only``)."""
    rows = []
    for worker, free in workers:
        aimed = replace(job.spec, requirements=replace(job.spec.requirements, worker=worker.id))
        verdict = now_reason(replace(job, spec=aimed), worker, free, now, prefer_cuda_grace)
        ever = worker.status != WorkerStatus.DRAINING and ever_reason(aimed, worker) is None
        rows.append(Choice(worker, free, verdict, _gpu_job(aimed, worker), ever))
    rows.sort(key=_choice_rank)
    return rows


def unheld(free: FreeResources, held: list[tuple[int, ...]], cpu_slots: int) -> FreeResources:
    """What a worker said it has free, less what the server knows its jobs hold (``held``:
    the GPUs of each claimed or running job; () a CPU slot). A poll sent before a claim
    answered, or crossing another, can then never hand out one slot twice."""
    taken = {g for gpus in held for g in gpus}
    cpu_left = cpu_slots - sum(1 for gpus in held if not gpus)
    return FreeResources(
        cpu_slots=max(0, min(free.cpu_slots, cpu_left)),
        gpus=tuple(g for g in free.gpus if g.index not in taken),
    )


def reserve(jobs: list[JobSpec], worker: WorkerView, free: FreeResources) -> FreeResources:
    """The worker's free resources once ``jobs`` (pending jobs aimed at it, best first)
    have each taken the slot they would get: a job aimed at a worker holds its place
    before the worker claims it, so a second user aiming at the same slot is told."""
    for spec in jobs:
        got = assign(spec, worker, free)
        if isinstance(got, str):
            continue  # it waits anyway; it takes nothing now
        if got.gpus:
            free = replace(free, gpus=tuple(g for g in free.gpus if g.index not in got.gpus))
        else:
            free = replace(free, cpu_slots=free.cpu_slots - 1)
    return free
