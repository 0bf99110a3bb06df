"""Client-facing routes: jobs, manifests, fleet status, tokens, audit.

Every route names the roles it admits (the ``Annotated`` dependencies); a submitter's token
is confined to its pools, so each route also scopes what it reads and changes to
``caller.pools`` (None: every pool). A job of another pool is answered as unknown (404).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from gpufleet import __version__
from gpufleet.domain.models import Role, WorkerStatus
from gpufleet.domain.sharing import priority_refusal
from gpufleet.errors import Forbidden, NotFound, ValidationFailed
from gpufleet.scheduling.matching import effective_gpus
from gpufleet.server import deps, views
from gpufleet.server.access import Caller
from gpufleet.server.deps import note, state
from gpufleet.wire import (
    ERRORS,
    ApplyResult,
    ArtifactOut,
    AuditOut,
    CheckpointOut,
    Health,
    JobDetail,
    JobOut,
    JobSpecModel,
    LogsOut,
    ManifestApply,
    StatusOut,
    StopRequest,
    SubmitResult,
    TokenCreate,
    TokenCreated,
    TokenOut,
    WhoAmI,
    WhyOut,
    WhyWorker,
)

router = APIRouter(prefix="/v1", responses=ERRORS)
Anyone = Annotated[Caller, Depends(deps.anyone)]
Reader = Annotated[Caller, Depends(deps.reader)]
Submitter = Annotated[Caller, Depends(deps.submitter)]
Operator = Annotated[Caller, Depends(deps.operator)]
Admin = Annotated[Caller, Depends(deps.admin)]
DAY = 86400.0
STATUSES = {"pending", "claimed", "running", "succeeded", "failed", "cancelled", "paused"}


def _names(request: Request) -> dict[str, str]:
    return state(request).services.reads.worker_names()


@router.get("/health", response_model=Health, tags=["meta"])
async def health(request: Request) -> Health:
    """Liveness and database reachability; needs no token. Still 200 when degraded (its
    writes fail for lack of disk): the server answers, and says why in ``problems``."""
    reads = state(request).services.reads
    db = await run_in_threadpool(reads.database)
    problems = reads.problems()
    status: Literal["ok", "degraded"] = "degraded" if problems else "ok"
    return Health(status=status, version=__version__, database=db, problems=problems)


@router.get("/whoami", response_model=WhoAmI, tags=["meta"])
async def whoami(caller: Anyone) -> WhoAmI:
    """The calling token: its id, name, role and pools (never its secret)."""
    t = caller.token
    return WhoAmI(id=t.id, name=t.name, role=t.role, pools=list(t.pools))


@router.post("/jobs", response_model=SubmitResult, status_code=201, tags=["jobs"])
def submit(
    spec: JobSpecModel,
    request: Request,
    caller: Submitter,
    queue: Annotated[
        bool,
        Query(
            description="when the job targets a worker (requirements.worker) that cannot "
            "take it now, queue it for that worker instead of refusing with 409"
        ),
    ] = False,
) -> SubmitResult:
    """Queue one job. ``warning`` says when no registered worker could ever run it, or
    when the worker it is aimed at runs it in a CPU slot because its host declaration
    offers none of its GPUs."""
    pool = spec.pool or caller.default_pool()
    caller.may_use(pool)
    _priority_allowed(request, caller, spec.priority)
    job = state(request).services.submission.submit(
        spec.to_domain(),
        pool,
        wait_for_target=queue,
        readable=caller.pools,
        submitted_by=caller.id,
        by=caller.name,
    )
    note(request, job.id)
    warning = job.unrunnable or state(request).services.fleet.narrowed_note(job.spec)
    return SubmitResult(job=views.job_out(job, _names(request)), warning=warning)


def _priority_allowed(request: Request, caller: Caller, priority: int) -> None:
    """A submitter asks for no priority above what the sharing rules let its user (403)."""
    if caller.role != Role.SUBMITTER:
        return
    why = priority_refusal(state(request).services.sharing.current(), caller.name, priority)
    if why is not None:
        raise Forbidden(why, detail={"field": "priority", "priority": priority})


@router.get("/jobs", response_model=list[JobOut], tags=["jobs"])
def list_jobs(
    request: Request,
    response: Response,
    caller: Reader,
    status: Annotated[str | None, Query(description="comma-separated statuses")] = None,
    pool: Annotated[str | None, Query(max_length=200, description="only this pool's")] = None,
    name: Annotated[str | None, Query(max_length=200, description="names holding this")] = None,
    before: Annotated[
        str | None, Query(max_length=200, description="a job id: the page created before it")
    ] = None,
    order: Annotated[Literal["oldest", "newest"], Query()] = "oldest",
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> list[JobOut]:
    """The newest ``limit`` jobs that match, oldest first (``order=newest``: newest
    first). Page back with ``before`` set to the oldest job of a page. ``X-Total-Count``
    says how many jobs match in all."""
    wanted = [s.strip() for s in status.split(",") if s.strip()] if status else []
    bad = [s for s in wanted if s not in STATUSES]
    if bad:
        raise ValidationFailed(
            f"unknown status {bad[0]!r}; expected one of {', '.join(sorted(STATUSES))}",
            detail={"field": "status"},
        )
    pools = caller.pools
    if pool is not None:
        caller.may_use(pool)
        pools = (pool,)
    reads = state(request).services.reads
    jobs = reads.jobs(wanted, limit, pools, name, before)
    counts = reads.matching(pools, name)
    response.headers["X-Total-Count"] = str(
        sum(n for s, n in counts.items() if not wanted or s in wanted)
    )
    names = _names(request)
    shown = [views.job_out(j, names) for j in jobs]
    return shown[::-1] if order == "newest" else shown


@router.get("/jobs/{ref}", response_model=JobDetail, tags=["jobs"])
def show_job(ref: str, request: Request, caller: Reader) -> JobDetail:
    q = state(request).services
    job = q.reads.job(ref, caller.pools)
    attempts, artifact, deps = q.reads.history(job)
    host = q.fleet.declaration_for(job.worker_id or job.target)
    who = q.reads.token_name(job.submitted_by)
    snaps = [r.snapshot() for r in q.checkpoints.of(job)] if job.spec.checkpoint_dir else []
    detail = views.job_detail(job, _names(request), attempts, artifact, deps, host, who, snaps)
    detail.preemption = q.preemption.shown(job)
    return detail


@router.get("/jobs/{ref}/artifact", response_model=ArtifactOut, tags=["jobs"])
def job_artifact(ref: str, request: Request, caller: Reader) -> ArtifactOut:
    """The job's artifact (its outputs, archived): of the attempt that succeeded, else of
    the latest attempt that left one. Download its bytes from ``/v1/blobs/{sha256}``."""
    q = state(request).services
    job = q.reads.job(ref, caller.pools)
    found = q.reads.result(job)
    if found is None:
        raise NotFound(q.reads.no_result(job), detail={"job": job.id})
    return views.artifact_out(found)


@router.get("/jobs/{ref}/checkpoints", response_model=list[CheckpointOut], tags=["jobs"])
def job_checkpoints(ref: str, request: Request, caller: Reader) -> list[CheckpointOut]:
    """The snapshots of the job's checkpoint folder kept on the server, newest first. A
    snapshot's files are blobs its pool may read (``/v1/blobs/{sha256}``)."""
    q = state(request).services
    job = q.reads.job(ref, caller.pools)
    return [views.checkpoint_out(row.snapshot()) for row in q.checkpoints.of(job)]


@router.post("/jobs/{ref}/cancel", response_model=JobOut, tags=["jobs"])
def cancel_job(ref: str, request: Request, caller: Submitter) -> JobOut:
    """Cancel a job; a running one is killed (its whole process group) within a heartbeat.
    A submitter cancels only the jobs it submitted (403 for others of its pools); an
    operator any job of its pools."""
    job = state(request).services.steering.cancel(ref, caller.pools, caller.owner, caller.name)
    note(request, job.id)
    return views.job_out(job, _names(request))


@router.post("/jobs/{ref}/stop", response_model=JobOut, tags=["jobs"])
def stop_job(
    ref: str, request: Request, caller: Submitter, body: StopRequest | None = None
) -> JobOut:
    """Ask a claimed or running job to finish early and keep what it made: its worker
    sends SIGINT to the job's process group, then, if it still runs after ``grace``
    seconds, SIGTERM and SIGKILL. Its outputs are kept; it ends succeeded
    (``stopped_early``) if it exits 0, failed otherwise, and is not retried. A pending or
    finished job is 409 (cancel a pending one). A submitter stops only its own jobs."""
    grace = (body or StopRequest()).grace
    job = state(request).services.steering.stop(ref, caller.pools, caller.owner, grace, caller.name)
    note(request, job.id)
    return views.job_out(job, _names(request))


@router.post("/jobs/{ref}/pause", response_model=JobOut, tags=["jobs"])
def pause_job(ref: str, request: Request, caller: Submitter) -> JobOut:
    """Hold a job until it is resumed. A pending job is paused at once; a claimed or
    running one at its worker's next heartbeat: the job gets its grace signal, has its
    grace period, its checkpoint folder is kept a last time and its slot is freed; it is
    ``paused`` then. A finished job is 409. A submitter pauses only its own jobs."""
    q = state(request).services.steering
    job = q.pause(ref, caller.pools, caller.owner, caller.name)
    note(request, job.id)
    return views.job_out(job, _names(request))


@router.post("/jobs/{ref}/resume", response_model=JobOut, tags=["jobs"])
def resume_job(ref: str, request: Request, caller: Submitter) -> JobOut:
    """Queue a paused job again: its next attempt, on whichever worker fits, restores its
    latest checkpoint. A job that is not paused is 409."""
    q = state(request).services.steering
    job = q.resume(ref, caller.pools, caller.owner, caller.name)
    note(request, job.id)
    return views.job_out(job, _names(request))


@router.post("/jobs/{ref}/requeue", response_model=JobOut, tags=["jobs"])
def requeue_job(ref: str, request: Request, caller: Submitter) -> JobOut:
    """Put a failed or cancelled job back in the queue with a fresh attempt budget.
    A submitter requeues only the jobs it submitted; an operator any job of its pools."""
    job = state(request).services.steering.requeue(ref, caller.pools, caller.owner, caller.name)
    note(request, job.id)
    return views.job_out(job, _names(request))


@router.get("/jobs/{ref}/why", response_model=WhyOut, tags=["jobs"])
def why_job(ref: str, request: Request, caller: Reader) -> WhyOut:
    """For every worker (a submitter: of its pools), every constraint that keeps it from
    taking this job (``reasons``; ``reason`` joins them), and a pending job's place in its
    queue among the jobs the workers that could run it could run too."""
    job, summary, verdicts, position = state(request).services.explain.why(ref, caller.pools)
    return WhyOut(
        job_id=job.id,
        status=job.status.value,
        summary=summary,
        position=position,
        workers=[
            WhyWorker(
                worker_id=s.row.id,
                name=s.row.name,
                status=s.status.value,
                reason="; ".join(r) or None,
                reasons=r,
                host=views.host_out(s.host) if s.host else None,
                environment_built=views.environment_built(job.spec, s.view),
            )
            for s, r in verdicts
        ],
    )


@router.get("/jobs/{ref}/logs", response_model=LogsOut, tags=["jobs"])
def job_logs(
    ref: str,
    request: Request,
    caller: Reader,
    after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> LogsOut:
    """Output lines (stdout and stderr) after sequence number ``after``: ``limit`` lines
    and a few MiB at most; ``more`` says whether to read on from ``next``. A caller
    confined to some pools sees opaque numbers (``seq``, ``next``), and sends them back."""
    q = state(request).services
    ids = deps.event_ids(request, caller)
    job = q.reads.job(ref, caller.pools)
    page = q.reads.logs(job.id, ids.show(after), limit)
    return LogsOut(
        job_id=job.id,
        status=job.status.value,
        lines=[views.log_entry(r, ids.hide(r.seq)) for r in page.rows],
        next=ids.hide(page.rows[-1].seq) if page.rows else after,
        more=page.more,
    )


@router.post("/manifests", response_model=ApplyResult, tags=["jobs"])
def apply_manifest(plan: ManifestApply, request: Request, caller: Operator) -> ApplyResult:
    """Apply a parsed manifest: new jobs are queued, existing ones keep their status;
    ``absent`` names the jobs of this manifest the plan no longer has. An operator of some
    pools applies jobs of those pools (a job without one goes to its default) and host
    entries for their workers."""
    note(request, plan.name)
    if caller.pools is not None:
        pool = caller.default_pool()
        jobs = [j if j.pool else j.model_copy(update={"pool": pool}) for j in plan.jobs]
        plan = plan.model_copy(update={"jobs": jobs})
    return state(request).services.submission.apply(plan, caller.pools, caller.id, caller.name)


@router.get("/status", response_model=StatusOut, tags=["fleet"])
def fleet_status(request: Request, caller: Reader) -> StatusOut:
    """Jobs by status, workers by status, and the slots of the workers not offline: all
    of them, and those free (no job holds or waits for them). A submitter: of its pools."""
    q = state(request).services
    workers: dict[str, int] = {}
    gpus = gpus_free = cpu = cpu_free = 0
    for s in q.fleet.states(caller.pools):
        workers[s.status.value] = workers.get(s.status.value, 0) + 1
        if s.status != WorkerStatus.OFFLINE:
            gpus += len(effective_gpus(s.view))  # as its host declaration offers them
            gpus_free += len(s.free.gpus)
            cpu += s.row.cpu_slots
            cpu_free += s.free.cpu_slots
    return StatusOut(
        jobs=q.reads.counts(caller.pools),
        workers=workers,
        gpus=gpus,
        gpus_free=gpus_free,
        cpu_slots=cpu,
        cpu_slots_free=cpu_free,
    )


@router.post("/tokens", response_model=TokenCreated, status_code=201, tags=["tokens"])
def create_token(body: TokenCreate, request: Request, _: Admin) -> TokenCreated:
    """Create a token. The secret is in this response only; the server keeps its hash."""
    st = state(request)
    expires = st.services.clock() + body.expires_days * DAY if body.expires_days else None
    row, secret = st.auth.create(body.name, Role(body.role), body.pools, expires, body.labels)
    note(request, row.id)
    return TokenCreated(**views.token_out(row).model_dump(), token=secret)


@router.get("/tokens", response_model=list[TokenOut], tags=["tokens"])
def list_tokens(request: Request, _: Admin) -> list[TokenOut]:
    """Every token, revoked ones included; never a secret (``hint`` tells them apart)."""
    return [views.token_out(t) for t in state(request).services.reads.tokens()]


@router.post("/tokens/{token_id}/rotate", response_model=TokenCreated, tags=["tokens"])
def rotate_token(token_id: str, request: Request, _: Admin) -> TokenCreated:
    """A new secret for the token (same id, role and pools); the old secret fails now."""
    row, secret = state(request).auth.rotate(token_id)
    note(request, row.id)
    return TokenCreated(**views.token_out(row).model_dump(), token=secret)


@router.delete("/tokens/{token_id}", response_model=TokenOut, tags=["tokens"])
def revoke_token(token_id: str, request: Request, _: Admin) -> TokenOut:
    """Revoke a token now. Workers it enrolled go offline; their jobs are requeued without
    counting the attempt. Returns the token as it is now (revoked)."""
    st = state(request)
    row = st.auth.revoke(token_id)
    note(request, token_id)
    st.services.upkeep.retire(token_id)
    return views.token_out(row)


@router.get("/audit", response_model=list[AuditOut], tags=["audit"])
async def audit_log(
    request: Request,
    caller: Operator,
    since: Annotated[
        datetime | None, Query(description="only records at or after this time (ISO 8601)")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    after: Annotated[
        int, Query(ge=0, le=2**63 - 1, description="only records past this seq (paging)")
    ] = 0,
) -> list[AuditOut]:
    """State-changing calls, oldest first: who (token), from where, what, and the status;
    and lifecycle events (``event``: worker.registered, worker.offline, worker.removed,
    lease.lost). A full page ends before the newest: ask again with ``after`` = the last
    ``seq``. The log spans every pool: an operator of some pools may not read it."""
    if caller.pools is not None:
        raise Forbidden(
            "the audit log spans every pool; it takes an admin or an operator of every pool"
        )
    st = state(request)
    await st.audit.flush()  # what was recorded a moment ago is in the answer
    start = since.timestamp() if since else 0.0
    rows = await run_in_threadpool(st.services.reads.audit, start, limit, after)
    return [views.audit_out(a) for a in rows]
