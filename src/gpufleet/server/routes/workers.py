"""The fleet (list, show, drain, select) and the worker protocol: register, long-poll claim,
heartbeat, and lease-carrying writes.

A worker is bound to the token that registered it: only that token may claim, heartbeat
or write for it, and a lease-carrying write must come from the token whose worker holds
the lease (404: a job of another pool; 409: a stale lease; 403: another token's worker).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Annotated
from urllib.parse import quote

from anyio import to_thread
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from gpufleet.domain.checkpoints import SnapFile
from gpufleet.errors import Conflict, GpufleetError, NotFound
from gpufleet.scheduling.matching import FreeGpu, FreeResources, JobView, free_gpu_mib, selection
from gpufleet.server import deps, views
from gpufleet.server.access import Caller
from gpufleet.server.deps import note, state
from gpufleet.server.fleet import WorkerRecord
from gpufleet.server.holders import Holders
from gpufleet.server.polls import Poll, Polls, wait_either
from gpufleet.server.responses import error_info, error_response, internal_error
from gpufleet.server.shortage import noted
from gpufleet.tokens import redact
from gpufleet.wire import (
    ERRORS,
    ArtifactAttach,
    Candidate,
    CheckpointIn,
    CheckpointOut,
    ClaimRequest,
    ErrorBody,
    FinishRequest,
    HeartbeatRequest,
    HeartbeatResponse,
    HostOut,
    JobOut,
    Lease,
    LeaveRequest,
    LogAppend,
    ReleaseRequest,
    ReportBatch,
    ReportResult,
    ReportResults,
    SelectRequest,
    StartReport,
    StartRequest,
    WorkerOut,
    WorkerRegister,
)

log = logging.getLogger("gpufleet.server")
router = APIRouter(prefix="/v1", responses=ERRORS)
STOP_HEADER = "Gpufleet-Stop"
Worker = Annotated[Caller, Depends(deps.worker)]
Reader = Annotated[Caller, Depends(deps.reader)]
Operator = Annotated[Caller, Depends(deps.operator)]


def _json(answer: BaseModel) -> Response:
    """The answer of a hot route, serialized once (a returned model would be checked
    against the route's response_model, then serialized)."""
    return Response(answer.model_dump_json(), media_type="application/json")


def _worker_out(request: Request, w: WorkerRecord) -> WorkerOut:
    return views.worker_out(state(request).services.fleet.state_of(w))


@router.get("/workers", response_model=list[WorkerOut], tags=["fleet"])
def list_workers(
    request: Request,
    caller: Reader,
    pool: Annotated[
        str | None,
        Query(
            description="only this pool's workers",
            pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",  # a pool's name (wire.PoolName)
        ),
    ] = None,
) -> list[WorkerOut]:
    """Workers (a submitter: of its pools), with live GPU memory and status."""
    pools = caller.pools if pool is None else [p for p in [pool] if caller.sees(p)]
    return [views.worker_out(s) for s in state(request).services.fleet.states(pools)]


@router.post("/workers/select", response_model=list[Candidate], tags=["fleet"])
def select_workers(body: SelectRequest, request: Request, caller: Reader) -> list[Candidate]:
    """The workers of the job's pool as a user choosing one sees them: those that could
    start the job now first, on a GPU before in a CPU slot, the one whose GPU (the one the
    job would get) has the most free memory leading; the others with the reason they
    cannot. Each is judged as if the job were aimed at it (a GPU worker on a free GPU,
    unless ``cpu_only``); ``requirements.worker`` is ignored."""
    q = state(request).services
    pool = body.spec.pool or caller.default_pool()
    caller.may_use(pool)
    spec = body.spec.to_domain()
    spec = replace(spec, pool=pool, requirements=replace(spec.requirements, worker=None))
    states = {s.row.id: s for s in q.fleet.states([pool])}
    fleet = [(s.view, s.free) for s in states.values()]
    ranked = selection(JobView("(new)", spec, q.clock()), fleet, q.clock(), 0.0)
    return [
        Candidate(
            worker=views.worker_out(states[c.worker.id]),
            fits=c.reason is None,
            reason=c.reason,
            free_gpu_mib=free_gpu_mib(c.free),
            on_gpu=c.on_gpu,
            gpus=list(c.gpus),
            assigned_free_mib=c.gpu_free_mib,
            ever=c.ever,
        )
        for c in ranked
    ]


@router.get("/hosts", response_model=list[HostOut], tags=["fleet"])
def list_hosts(request: Request, caller: Reader) -> list[HostOut]:
    """Every ``[hosts.NAME]`` declaration the applied manifests made (a submitter: those
    of its pools' workers), by host: what it narrows, the manifest and file it came from,
    when and by which token it was applied."""
    return [views.host_out(d) for d in state(request).services.fleet.hosts(caller.pools)]


@router.get("/workers/{ref}", response_model=WorkerOut, tags=["fleet"])
def show_worker(ref: str, request: Request, caller: Reader) -> WorkerOut:
    w = state(request).services.fleet.worker(ref, caller.pools)
    return _worker_out(request, w)


@router.post("/workers/{ref}/drain", response_model=WorkerOut, tags=["fleet"])
def drain_worker(
    ref: str,
    request: Request,
    caller: Operator,
    deadline: Annotated[float | None, Query(ge=0, le=30 * 86400)] = None,
) -> WorkerOut:
    """Stop giving the worker jobs; it finishes what it runs, then exits."""
    w = state(request).services.fleet.drain(ref, caller.pools, deadline)
    note(request, w.id)
    return _worker_out(request, w)


@router.delete("/workers/{ref}", response_model=WorkerOut, tags=["fleet"])
def remove_worker(ref: str, request: Request, caller: Operator) -> WorkerOut:
    """Forget an offline worker (409 for one that is not offline: drain it first). Its
    jobs' history keeps its name. Returns the worker as it was."""
    fleet = state(request).services.fleet
    w = fleet.remove(ref, caller.pools, caller.token)
    note(request, w.id)
    return views.worker_out(fleet.state(w, []))


@router.post("/workers", response_model=WorkerOut, status_code=201, tags=["worker protocol"])
def register_worker(body: WorkerRegister, request: Request, caller: Worker) -> WorkerOut:
    """Register (or re-register) a worker by name; jobs it still runs keep their leases,
    and those it held but no longer runs (it died and started again) are lost at once.
    A worker token registers workers of its own pool only, and a name enrolled with
    another token is refused. Labels the token fixes (``tokens create --label``) are the
    worker's whatever it declares; declaring another value for one is refused (403)."""
    services = state(request).services
    pool = body.pool or caller.default_pool()
    caller.may_use(pool)
    w = services.fleet.register(body, pool, caller.token)
    running = [(r.job_id, r.attempt) for r in body.running]
    if running:
        services.leases.renew_for(running, w.id)
    services.upkeep.settle(w.id, w.name, running)  # what it no longer runs: lost now
    note(request, w.id)
    out = _worker_out(request, w)
    out.lease_timeout = services.settings.lease_timeout
    out.host = None  # a declaration's file and who applied it are for the fleet's readers
    return out


def _shutting_down() -> JSONResponse:
    message = "the server is shutting down; poll again in a moment"
    headers = {"Retry-After": "1", "Connection": "close"}
    return error_response(503, "server_unavailable", message, headers=headers)


def _empty(polls: Polls) -> Response:
    """Nothing to run: a stopping server also closes the connection, so the worker's next
    poll does not reach it."""
    return Response(status_code=204, headers={"Connection": "close"} if polls.stopping else None)


@router.post(
    "/workers/{worker_id}/claim",
    response_model=Lease,
    responses={
        204: {"description": "nothing to run within the wait (or a newer poll came)"},
        503: {"model": ErrorBody, "description": "the server is shutting down; retry"},
    },
    tags=["worker protocol"],
)
async def claim(
    worker_id: str, body: ClaimRequest, request: Request, caller: Worker
) -> Lease | Response:
    """Long-poll for a job that fits the free slots; a lease, or 204 after ``wait`` seconds.
    A newer poll of the same worker (sent when one of its slots freed) ends this one: it
    answers 204 at once, and the newer one claims with the worker's current slots."""
    st = state(request)
    if st.polls.stopping:
        return _shutting_down()
    free = FreeResources(body.cpu_slots, tuple(FreeGpu(g.index, g.free_mib) for g in body.gpus))
    dispatch = st.services.dispatch
    if free.cpu_slots == 0 and not free.gpus:
        await to_thread.run_sync(st.services.fleet.owned, worker_id, caller.id, caller.pools)
        return Response(status_code=204)
    # The first try checks that this token enrolled the worker; only then may the poll end
    # an older one of the same worker (here, and on other replicas when it says so).
    lease = await to_thread.run_sync(
        dispatch.poll, worker_id, free, body.wait, caller.id, caller.pools, limiter=st.claim_limiter
    )
    poll = st.polls.begin(worker_id)
    if body.supersede:
        await to_thread.run_sync(dispatch.superseded, worker_id, st.polls.replica)
    # A revoke or rotate of the worker's token ends the poll at once (on any server).
    with st.holds.hold(deps.credential(request), poll.over.set) as hold:
        try:
            return await _poll(request, worker_id, free, body, lease, poll, hold.ended)
        finally:
            if st.polls.end(worker_id, poll):
                dispatch.wait_end(worker_id)


async def _poll(
    request: Request,
    worker_id: str,
    free: FreeResources,
    body: ClaimRequest,
    lease: Lease | None,
    poll: Poll,
    revoked: asyncio.Event,
) -> Lease | Response:
    """Wait for a job that fits ``free`` (``lease``: the first try's), until the poll's
    ``wait`` is up, a newer poll or a stop ends it, or its token is ``revoked``."""
    st = state(request)
    dispatch, leases = st.services.dispatch, st.services.leases
    deadline = time.monotonic() + body.wait
    wake = st.notifier.current()
    while True:
        if lease is not None:
            if body.most > 1 and not await request.is_disconnected():
                lease.more = await to_thread.run_sync(
                    dispatch.claim_more, worker_id, free, body.most - 1, limiter=st.claim_limiter
                )
            # nobody will run them (the worker went away, or its token no longer lets it
            # in): hand them back
            if revoked.is_set() or await request.is_disconnected():
                for one in (lease, *lease.more):
                    await to_thread.run_sync(
                        leases.release, one.job_id, one.attempt, "worker went away"
                    )
                return Response(status_code=204)
            # Serialized here, once: the hot path skips FastAPI's second validation pass.
            note(request, lease.job_id)
            return _json(lease)
        left = deadline - time.monotonic()
        if poll.over.is_set() or left <= 0 or await request.is_disconnected():
            return _empty(st.polls)
        # Re-check at least every second: backoffs and grace windows end without a wake.
        await wait_either(wake, poll.over, min(left, 1.0))
        if poll.over.is_set():
            return _empty(st.polls)
        wake = st.notifier.current()
        lease = await to_thread.run_sync(
            dispatch.try_claim, worker_id, free, limiter=st.claim_limiter
        )


@router.post(
    "/workers/{worker_id}/heartbeat", response_model=HeartbeatResponse, tags=["worker protocol"]
)
def heartbeat(worker_id: str, body: HeartbeatRequest, request: Request, caller: Worker) -> Response:
    """Extend the leases the worker still holds; ``orders`` says which jobs to kill."""
    q = state(request).services
    w = q.fleet.owned(worker_id, caller.id, caller.pools, fresh=True)
    return _json(q.leases.heartbeat(worker_id, body, w))


@router.post("/workers/{worker_id}/leave", status_code=204, tags=["worker protocol"])
def leave(worker_id: str, body: LeaveRequest, request: Request, caller: Worker) -> None:
    """The worker stops (drained, its one job done, a signal): it is offline from now.
    A job it still held goes back to the queue without counting the attempt."""
    q = state(request).services
    q.fleet.owned(worker_id, caller.id, caller.pools)
    q.upkeep.leave(worker_id, body.reason)


def _holder(
    request: Request, caller: Caller, job_id: str, attempt: int, secret: str | None
) -> None:
    """Refused unless this caller's worker holds the job's attempt ``attempt`` and
    ``secret`` is the attempt's (see :mod:`gpufleet.server.lease_secrets`)."""
    holders = state(request).services.holders
    holders.check(job_id, attempt, caller.id, caller.pools, secret)


@router.post("/jobs/{job_id}/start", status_code=204, tags=["worker protocol"])
def start_job(job_id: str, body: StartRequest, request: Request, caller: Worker) -> None:
    """The job's process runs (since ``started_at`` by the worker's clock, when given),
    in the Python ``environment`` its worker reports, when its spec names one."""
    _start(state(request).services.holders, caller, job_id, body)


def _start(holders: Holders, caller: Caller, job_id: str, body: StartRequest) -> None:
    job = holders.check(job_id, body.attempt, caller.id, caller.pools, body.secret)
    said = body.started_at.timestamp() if body.started_at is not None else None
    holders.leases.start(
        job_id, body.attempt, said, job.claimed_at, body.environment, body.restored
    )


@router.post("/jobs/{job_id}/output", status_code=204, tags=["worker protocol"])
def append_output(
    job_id: str, body: LogAppend, request: Request, caller: Worker, response: Response
) -> None:
    """Append output lines. When the job has been asked to stop, the answer carries
    ``Gpufleet-Stop: GRACE`` (seconds), so the worker learns it within a log batch."""
    _holder(request, caller, job_id, body.attempt, body.secret)
    lines = [(ln.stream, ln.line) for ln in body.lines]
    stop = state(request).services.leases.append_logs(job_id, body.attempt, lines, body.first)
    if stop is not None:
        response.headers[STOP_HEADER] = f"{stop:g}"


@router.post("/jobs/{job_id}/finish", response_model=JobOut, tags=["worker protocol"])
def finish_job(job_id: str, body: FinishRequest, request: Request, caller: Worker) -> JobOut:
    """End an attempt: exit code 0 succeeds; anything else retries or fails, keeping the
    last lines of the attempt's stderr (``stderr_tail``). ``failure: "environment"``
    says the job's environment could not be built (``error``: uv's words); with
    ``final`` it cannot be built on any worker, and the job fails now instead of being
    retried. A result for an attempt that has ended is refused (409) and kept in that
    attempt's history (``late_result``)."""
    return _finish(state(request).services.holders, caller, job_id, body)


def _finish(holders: Holders, caller: Caller, job_id: str, body: FinishRequest) -> JobOut:
    try:
        held = holders.check(job_id, body.attempt, caller.id, caller.pools, body.secret)
    except Conflict:
        holders.refused_result(
            job_id, body.attempt, caller.id, body.exit_code, body.error, body.secret
        )
        raise
    job = holders.leases.finish(
        job_id,
        body.attempt,
        body.exit_code,
        body.error,
        body.stderr_tail,
        held=held,
        failure=body.failure,
        final=body.final,
    )
    return views.job_out(job, {})


@router.post("/reports", response_model=ReportResults, tags=["worker protocol"])
def reports(body: ReportBatch, request: Request, caller: Worker) -> Response:
    """Start and finish reports, applied in order, each as its own call
    (``/jobs/{job_id}/start``, ``/jobs/{job_id}/finish``) would be: each has its own
    answer (the status that call would have had, a finish's job, or the error) and its
    own audit record. A worker sends the reports that came while one call was on its way
    together in the next. They are written in one transaction, each report a savepoint of
    it: a failure of the server's own in one report (a database error) undoes that report
    alone and is its 500, logged; the others are applied and answered as before. If the
    transaction cannot commit, the call fails as a whole and nothing of it is recorded;
    followers and waiting polls are told once it has committed."""
    results: list[ReportResult] = []
    audited: list[tuple[str, int]] = []
    q = state(request).services
    with q.transaction([r.job_id for r in body.reports]) as tx:
        holders = q.holders.within(tx)
        for r in body.reports:
            shown = redact(r.job_id)
            try:
                with tx.savepoint():
                    try:
                        if isinstance(r, StartReport):
                            _start(holders, caller, r.job_id, r)
                            done = ReportResult(job_id=shown, status=204)
                        else:
                            job = _finish(holders, caller, r.job_id, r)
                            done = ReportResult(job_id=shown, status=200, job=job)
                    except GpufleetError as exc:  # answered; what it wrote stands
                        done = ReportResult(job_id=shown, status=exc.status, error=error_info(exc))
            except Exception as exc:  # ours, not the report's: as its own call would, a 500
                done = _failed_report(request, r.kind, shown, exc)
            results.append(done)
            audited.append((f"/v1/jobs/{quote(r.job_id, safe='')}/{r.kind}", done.status))
    request.state.audit_items = audited  # committed: each report is recorded
    return _json(ReportResults(results=results))


def _failed_report(request: Request, kind: str, shown: str, exc: Exception) -> ReportResult:
    """The answer to a report that failed on the server's side: 507 or 503 for a
    shortage (a full disk), else a 500, logged with its traceback."""
    err = noted(request, exc, state(request).services.store.space)
    if err is not None:
        return ReportResult(job_id=shown, status=err.status, error=error_info(err))
    rid = getattr(request.state, "request_id", "-")
    log.error("internal error in a %s report (request %s)", kind, rid, exc_info=exc)
    return ReportResult(job_id=shown, status=500, error=internal_error(rid))


@router.post("/jobs/{job_id}/release", response_model=JobOut, tags=["worker protocol"])
def release_job(job_id: str, body: ReleaseRequest, request: Request, caller: Worker) -> JobOut:
    """A draining worker hands the job back; the attempt is not counted."""
    _holder(request, caller, job_id, body.attempt, body.secret)
    return views.job_out(
        state(request).services.leases.release(
            job_id, body.attempt, body.reason, body.cause == "owner"
        ),
        {},
    )


@router.post(
    "/jobs/{job_id}/checkpoints", response_model=CheckpointOut, status_code=201, tags=["workers"]
)
def record_checkpoint(
    job_id: str, body: CheckpointIn, request: Request, caller: Worker
) -> CheckpointOut:
    """Record a snapshot of the job's checkpoint folder, taken by the attempt this lease
    holds. Every file it lists must be a blob on the server already, of the size it says,
    that this worker may read (422 names the file otherwise): a snapshot on record is
    complete. The job's pool may read its files from then on; the job's newest few
    snapshots are kept."""
    job = state(request).services.holders.check(
        job_id, body.attempt, caller.id, caller.pools, body.secret
    )
    files = [SnapFile(f.path, f.sha256, f.size) for f in body.files]
    q = state(request).services
    snap = q.checkpoints.record(
        job, body.attempt, files, {str(k): v for k, v in body.progress.items()}, caller.pools
    )
    q.metrics.checkpointed(snap.bytes)
    return views.checkpoint_out(snap)


@router.post("/jobs/{job_id}/artifact", status_code=204, tags=["workers"])
def attach_artifact(job_id: str, body: ArtifactAttach, request: Request, caller: Worker) -> None:
    """Attach an uploaded blob as the artifact of the attempt this lease holds. The server
    checks the archive (every unpacking rule) before accepting it."""
    _holder(request, caller, job_id, body.attempt, body.secret)
    q = state(request).services
    if not q.blobs.readable(body.sha256, caller.pools):
        raise NotFound(f"no blob {body.sha256}", detail={"blob": body.sha256})
    q.flow.attach(q.leases.held(job_id, body.attempt), body.attempt, body.sha256)
