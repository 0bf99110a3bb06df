"""The worker protocol: register, long-poll claim, heartbeat, and lease-carrying writes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Annotated

from anyio import to_thread
from fastapi import APIRouter, Depends, Request, Response

from gpufleet.scheduling.matching import FreeGpu, FreeResources
from gpufleet.server import deps, views
from gpufleet.server.deps import state
from gpufleet.store import TokenRow
from gpufleet.wire import (
    ERRORS,
    ArtifactAttach,
    ClaimRequest,
    FinishRequest,
    HeartbeatRequest,
    HeartbeatResponse,
    JobOut,
    Lease,
    LogAppend,
    ReleaseRequest,
    StartRequest,
    WorkerOut,
    WorkerRegister,
)

router = APIRouter(prefix="/v1", responses=ERRORS)
Worker = Annotated[TokenRow, Depends(deps.worker)]
Reader = Annotated[TokenRow, Depends(deps.reader)]
Operator = Annotated[TokenRow, Depends(deps.operator)]


def _worker_out(request: Request, worker_id: str) -> WorkerOut:
    q = state(request).queue
    w = q.worker(worker_id)
    running = q.store.active_jobs(w.id)
    return views.worker_out(w, q.worker_status(w, len(running)).value, running)


@router.get("/workers", response_model=list[WorkerOut], tags=["fleet"])
def list_workers(request: Request, _: Reader) -> list[WorkerOut]:
    q = state(request).queue
    active = q.store.active_jobs()
    out = []
    for w in q.store.list_workers():
        mine = [j for j in active if j.worker_id == w.id]
        out.append(views.worker_out(w, q.worker_status(w, len(mine)).value, mine))
    return out


@router.get("/workers/{ref}", response_model=WorkerOut, tags=["fleet"])
def show_worker(ref: str, request: Request, _: Reader) -> WorkerOut:
    return _worker_out(request, ref)


@router.post("/workers/{ref}/drain", response_model=WorkerOut, tags=["fleet"])
def drain_worker(ref: str, request: Request, _: Operator) -> WorkerOut:
    """Stop giving the worker jobs; it finishes what it runs, then exits."""
    w = state(request).queue.drain(ref)
    return _worker_out(request, w.id)


@router.post("/workers", response_model=WorkerOut, status_code=201, tags=["worker protocol"])
def register_worker(body: WorkerRegister, request: Request, _: Worker) -> WorkerOut:
    """Register (or re-register) a worker by name; jobs it still runs keep their leases."""
    queue = state(request).queue
    w = queue.register(body)
    out = _worker_out(request, w.id)
    out.lease_timeout = queue.settings.lease_timeout
    return out


@router.post(
    "/workers/{worker_id}/claim",
    response_model=Lease,
    responses={204: {"description": "nothing to run within the wait"}},
    tags=["worker protocol"],
)
async def claim(
    worker_id: str, body: ClaimRequest, request: Request, _: Worker
) -> Lease | Response:
    """Long-poll for a job that fits the free slots; a lease, or 204 after ``wait`` seconds."""
    st = state(request)
    free = FreeResources(body.cpu_slots, tuple(FreeGpu(g.index, g.free_mib) for g in body.gpus))
    if free.cpu_slots == 0 and not free.gpus:
        await to_thread.run_sync(st.queue.claimer, worker_id)  # an unknown worker is a 404
        return Response(status_code=204)
    deadline = time.monotonic() + body.wait
    try:
        wake = st.notifier.current()
        lease = await to_thread.run_sync(
            st.queue.poll, worker_id, free, body.wait, limiter=st.claim_limiter
        )
        while True:
            if lease is not None:
                if await request.is_disconnected():  # nobody will run it: hand it back
                    await to_thread.run_sync(
                        st.queue.release, lease.job_id, lease.attempt, "worker went away"
                    )
                    return Response(status_code=204)
                # Serialized here, once: the hot path skips FastAPI's second validation pass.
                return Response(lease.model_dump_json(), media_type="application/json")
            left = deadline - time.monotonic()
            if left <= 0 or await request.is_disconnected():
                return Response(status_code=204)
            # Re-check at least every second: backoffs and grace windows end without a wake.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), min(left, 1.0))
            wake = st.notifier.current()
            lease = await to_thread.run_sync(
                st.queue.try_claim, worker_id, free, limiter=st.claim_limiter
            )
    finally:
        st.queue.wait_end(worker_id)


@router.post(
    "/workers/{worker_id}/heartbeat", response_model=HeartbeatResponse, tags=["worker protocol"]
)
def heartbeat(
    worker_id: str, body: HeartbeatRequest, request: Request, _: Worker
) -> HeartbeatResponse:
    """Extend the leases the worker still holds; ``orders`` says which jobs to kill."""
    return state(request).queue.heartbeat(worker_id, body)


@router.post("/jobs/{job_id}/start", status_code=204, tags=["worker protocol"])
def start_job(job_id: str, body: StartRequest, request: Request, _: Worker) -> None:
    state(request).queue.start(job_id, body.attempt)


@router.post("/jobs/{job_id}/output", status_code=204, tags=["worker protocol"])
def append_output(job_id: str, body: LogAppend, request: Request, _: Worker) -> None:
    lines = [(ln.stream, ln.line) for ln in body.lines]
    state(request).queue.append_logs(job_id, body.attempt, lines)


@router.post("/jobs/{job_id}/finish", response_model=JobOut, tags=["worker protocol"])
def finish_job(job_id: str, body: FinishRequest, request: Request, _: Worker) -> JobOut:
    """End an attempt: exit code 0 succeeds; anything else retries or fails."""
    job = state(request).queue.finish(job_id, body.attempt, body.exit_code, body.error)
    return views.job_out(job, {})


@router.post("/jobs/{job_id}/release", response_model=JobOut, tags=["worker protocol"])
def release_job(job_id: str, body: ReleaseRequest, request: Request, _: Worker) -> JobOut:
    """A draining worker hands the job back; the attempt is not counted."""
    return views.job_out(state(request).queue.release(job_id, body.attempt, body.reason), {})


@router.post("/jobs/{job_id}/artifact", status_code=204, tags=["workers"])
def attach_artifact(job_id: str, body: ArtifactAttach, request: Request, _: Worker) -> None:
    """Attach an uploaded blob as the artifact of the attempt this lease holds. The server
    checks the archive (every unpacking rule) before accepting it."""
    state(request).queue.attach_artifact(job_id, body.attempt, body.sha256)
