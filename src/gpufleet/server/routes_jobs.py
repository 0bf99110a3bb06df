"""Client-facing routes: jobs, manifests, fleet status, tokens."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from starlette.concurrency import run_in_threadpool

from gpufleet import __version__
from gpufleet.domain.models import JobStatus, Role
from gpufleet.errors import NotFound, ValidationFailed
from gpufleet.server import deps, views
from gpufleet.server.deps import state
from gpufleet.store import TokenRow
from gpufleet.wire import (
    ERRORS,
    ApplyResult,
    ArtifactOut,
    Health,
    JobDetail,
    JobOut,
    JobSpecModel,
    LogsOut,
    ManifestApply,
    StatusOut,
    SubmitResult,
    TokenCreate,
    TokenCreated,
    TokenOut,
    WhyOut,
    WhyWorker,
)

router = APIRouter(prefix="/v1", responses=ERRORS)
Reader = Annotated[TokenRow, Depends(deps.reader)]
Submitter = Annotated[TokenRow, Depends(deps.submitter)]
Operator = Annotated[TokenRow, Depends(deps.operator)]
Admin = Annotated[TokenRow, Depends(deps.admin)]
STATUSES = {"pending", "claimed", "running", "succeeded", "failed", "cancelled"}


def _names(request: Request) -> dict[str, str]:
    return {w.id: w.name for w in state(request).queue.store.list_workers()}


@router.get("/health", response_model=Health, tags=["meta"])
async def health(request: Request) -> Health:
    """Liveness and database reachability; needs no token."""
    db = await run_in_threadpool(state(request).queue.store.ping)
    return Health(status="ok", version=__version__, database=db)


@router.post("/jobs", response_model=SubmitResult, status_code=201, tags=["jobs"])
def submit(spec: JobSpecModel, request: Request, _: Submitter) -> SubmitResult:
    """Queue one job. ``warning`` says when no registered worker could ever run it."""
    job = state(request).queue.submit(spec.to_domain())
    return SubmitResult(job=views.job_out(job, _names(request)), warning=job.unrunnable)


@router.get("/jobs", response_model=list[JobOut], tags=["jobs"])
def list_jobs(
    request: Request,
    _: Reader,
    status: Annotated[str | None, Query(description="comma-separated statuses")] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> list[JobOut]:
    wanted = [s.strip() for s in status.split(",") if s.strip()] if status else []
    bad = [s for s in wanted if s not in STATUSES]
    if bad:
        raise ValidationFailed(
            f"unknown status {bad[0]!r}; expected one of {', '.join(sorted(STATUSES))}",
            detail={"field": "status"},
        )
    names = _names(request)
    jobs = state(request).queue.store.list_jobs(wanted, limit)
    return [views.job_out(j, names) for j in jobs]


@router.get("/jobs/{ref}", response_model=JobDetail, tags=["jobs"])
def show_job(ref: str, request: Request, _: Reader) -> JobDetail:
    q = state(request).queue
    job = q.job(ref)
    artifact = q.store.artifact(job.id)
    deps = q.store.dependencies(job.id) if job.spec.dependencies else []
    return views.job_detail(job, _names(request), q.store.attempts(job.id), artifact, deps)


@router.get("/jobs/{ref}/artifact", response_model=ArtifactOut, tags=["jobs"])
def job_artifact(ref: str, request: Request, _: Reader) -> ArtifactOut:
    """The job's artifact (its outputs, archived): of the attempt that succeeded, else of
    the latest attempt that left one. Download its bytes from ``/v1/blobs/{sha256}``."""
    q = state(request).queue
    job = q.job(ref)
    found = q.store.artifact(job.id, job.lease if job.status == JobStatus.SUCCEEDED else None)
    if found is None:
        raise NotFound(
            f"job {job.id} has no artifact (status {job.status.value}; outputs "
            f"{', '.join(job.spec.outputs) or 'none'} matched no files, or it has not ended)",
            detail={"job": job.id},
        )
    return views.artifact_out(found)


@router.post("/jobs/{ref}/cancel", response_model=JobOut, tags=["jobs"])
def cancel_job(ref: str, request: Request, _: Operator) -> JobOut:
    """Cancel a job; a running one is killed (its whole process group) within a heartbeat."""
    return views.job_out(state(request).queue.cancel(ref), _names(request))


@router.post("/jobs/{ref}/requeue", response_model=JobOut, tags=["jobs"])
def requeue_job(ref: str, request: Request, _: Operator) -> JobOut:
    """Put a failed or cancelled job back in the queue with a fresh attempt budget."""
    return views.job_out(state(request).queue.requeue(ref), _names(request))


@router.get("/jobs/{ref}/why", response_model=WhyOut, tags=["jobs"])
def why_job(ref: str, request: Request, _: Reader) -> WhyOut:
    """For every worker, the constraint that keeps it from taking this job."""
    job, summary, verdicts = state(request).queue.why(ref)
    return WhyOut(
        job_id=job.id,
        status=job.status.value,
        summary=summary,
        workers=[
            WhyWorker(worker_id=v.id, name=v.name, status=v.status.value, reason=r)
            for v, r in verdicts
        ],
    )


@router.get("/jobs/{ref}/logs", response_model=LogsOut, tags=["jobs"])
def job_logs(
    ref: str,
    request: Request,
    _: Reader,
    after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> LogsOut:
    """Output lines (stdout and stderr) after sequence number ``after``."""
    q = state(request).queue
    job = q.job(ref)
    rows = q.store.logs(job.id, after, limit)
    return LogsOut(
        job_id=job.id,
        status=job.status.value,
        lines=[views.log_entry(r) for r in rows],
        next=rows[-1].seq if rows else after,
    )


@router.post("/manifests", response_model=ApplyResult, tags=["jobs"])
def apply_manifest(plan: ManifestApply, request: Request, _: Operator) -> ApplyResult:
    """Apply a parsed manifest: new jobs are queued, existing ones keep their status."""
    return state(request).queue.apply(plan)


@router.get("/status", response_model=StatusOut, tags=["fleet"])
def fleet_status(request: Request, _: Reader) -> StatusOut:
    q = state(request).queue
    active = q.store.active_jobs()
    workers: dict[str, int] = {}
    gpus = gpus_free = cpu = 0
    for w in q.store.list_workers():
        mine = [j for j in active if j.worker_id == w.id]
        status = q.worker_status(w, len(mine)).value
        workers[status] = workers.get(status, 0) + 1
        if status != "offline":
            free = q.free_resources(w, mine)
            gpus += len(w.capability.gpus)
            gpus_free += len(free.gpus)
            cpu += w.cpu_slots
    return StatusOut(
        jobs=q.store.job_counts(), workers=workers, gpus=gpus, gpus_free=gpus_free, cpu_slots=cpu
    )


@router.post("/tokens", response_model=TokenCreated, status_code=201, tags=["tokens"])
def create_token(body: TokenCreate, request: Request, _: Admin) -> TokenCreated:
    """Create a token. The secret is in this response only; the server keeps its hash."""
    row, secret = state(request).auth.create(body.name, Role(body.role), body.pool)
    return TokenCreated(**views.token_out(row).model_dump(), token=secret)


@router.get("/tokens", response_model=list[TokenOut], tags=["tokens"])
def list_tokens(request: Request, _: Admin) -> list[TokenOut]:
    return [views.token_out(t) for t in state(request).queue.store.list_tokens()]


@router.delete("/tokens/{token_id}", status_code=204, tags=["tokens"])
def revoke_token(token_id: str, request: Request, _: Admin) -> None:
    state(request).auth.revoke(token_id)
