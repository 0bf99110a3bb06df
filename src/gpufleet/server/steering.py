"""What owners and operators do to a job: cancel it, ask it to stop early, pause and
resume it, queue it again.
A submitter steers only the jobs it submitted; an operator any job of its pools. Each
status change is the lifecycle's (:mod:`gpufleet.domain.lifecycle`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from gpufleet.domain import lifecycle
from gpufleet.domain.models import JobStatus
from gpufleet.errors import Conflict, Forbidden
from gpufleet.server.dataflow import DataFlow
from gpufleet.server.metrics import Metrics
from gpufleet.server.reads import Reads
from gpufleet.store import JobRow, JobStore


class Steering:
    """Cancel, stop and requeue; one per server process."""

    def __init__(
        self,
        store: JobStore,
        reads: Reads,
        flow: DataFlow,
        clock: Callable[[], float],
        on_change: Callable[[], None],
        metrics: Metrics | None = None,
        on_written: Callable[[str], None] = lambda _job_id: None,
    ) -> None:
        self.store = store
        self.metrics = metrics or Metrics()
        self.on_written = on_written  # a job's event log has new records
        self.reads = reads
        self.flow = flow
        self.clock = clock
        self.on_change = on_change

    def cancel(
        self,
        ref: str,
        pools: Sequence[str] | None = None,
        owner: str | None = None,
        by: str | None = None,
    ) -> JobRow:
        """Cancel a job (of ``pools``; submitted by the token ``owner`` when given)."""
        job = self._steerable(ref, pools, owner, "cancel")
        for _ in range(3):  # a claim or a start may slip in between the read and the change
            done = self.store.cancel(replace(lifecycle.cancel(job, self.clock()), by=by))
            if done is not None or job.status.terminal:
                break
            job = self.reads.job(job.id)
        if done is None:
            raise Conflict(
                f"job {job.id} is {job.status.value}; "
                "only a pending, claimed or running job can be cancelled",
                detail={"job": job.id, "status": job.status.value},
            )
        self.metrics.ended("cancelled", job, self.clock(), "cancel")
        for written in (job.id, *done.failed):
            self.on_written(written)
        if job.target:
            self.on_change()  # a slot it held for its worker is free for others
        return done.job

    def stop(
        self,
        ref: str,
        pools: Sequence[str] | None = None,
        owner: str | None = None,
        grace: float = 60.0,
        by: str | None = None,
    ) -> JobRow:
        """Ask a claimed or running job to finish early and keep what it made: its worker
        sends it SIGINT at its next heartbeat or log upload, and SIGTERM then SIGKILL if it
        is still running ``grace`` seconds later. Asking again changes nothing."""
        job = self._steerable(ref, pools, owner, "stop")
        if job.status.active and job.stop_requested_at is None:
            if self.store.request_stop(job.id, self.clock(), grace, by):
                self.on_written(job.id)
            job = self.reads.job(job.id)
        if not job.status.active:
            advice = "cancel it instead" if job.status == JobStatus.PENDING else "it has ended"
            raise Conflict(
                f"job {job.id} is {job.status.value}: nothing runs to stop early ({advice})",
                detail={"job": job.id, "status": job.status.value},
            )
        return job

    def pause(
        self,
        ref: str,
        pools: Sequence[str] | None = None,
        owner: str | None = None,
        by: str | None = None,
    ) -> JobRow:
        """Hold a job until it is resumed: a pending one at once; a claimed or running one
        once its worker has vacated it (at its next heartbeat: its grace signal, its grace
        period, its checkpoint folder synced), freeing its slot. Asking again changes
        nothing."""
        job = self._steerable(ref, pools, owner, "pause")
        for _ in range(3):  # a claim may slip in between the read and the change
            if job.status == JobStatus.PENDING:
                done = self.store.pause(replace(lifecycle.pause(job, self.clock()), by=by))
                if done is not None:
                    self.on_written(job.id)
                    return done.job
            elif job.status.active:
                if self.store.request_pause(job.id, self.clock(), by):
                    self.on_written(job.id)
                job = self.reads.job(job.id)
                if job.status.active or job.status == JobStatus.PAUSED:
                    return job
            if job.status == JobStatus.PAUSED or job.status.terminal:
                break
            job = self.reads.job(job.id)
        if job.status != JobStatus.PAUSED:
            raise Conflict(
                f"job {job.id} is {job.status.value}; only a pending, claimed or running job "
                "can be paused",
                detail={"job": job.id, "status": job.status.value},
            )
        return job

    def resume(
        self,
        ref: str,
        pools: Sequence[str] | None = None,
        owner: str | None = None,
        by: str | None = None,
    ) -> JobRow:
        """Queue a paused job again: its next attempt, on whichever worker fits, restores
        its latest checkpoint."""
        job = self._steerable(ref, pools, owner, "resume")
        done = self.store.resume(replace(lifecycle.resume(job), by=by))
        if done is None:
            vacating = job.pause_requested_at is not None and job.status.active
            wait = " (its worker is vacating it: resume it once it is paused)" if vacating else ""
            raise Conflict(
                f"job {job.id} is {job.status.value}; only a paused job can be resumed{wait}",
                detail={"job": job.id, "status": job.status.value},
            )
        self.on_written(job.id)
        self.on_change()
        return done.job

    def requeue(
        self,
        ref: str,
        pools: Sequence[str] | None = None,
        owner: str | None = None,
        by: str | None = None,
    ) -> JobRow:
        """Queue a failed or cancelled job again (of ``pools``; ``owner``'s when given)."""
        job = self._steerable(ref, pools, owner, "requeue")
        self.flow.check_requeue(job)
        done = self.store.requeue(replace(lifecycle.requeue(job), by=by))
        if done is None:
            raise Conflict(
                f"job {job.id} is {job.status.value}; "
                "only a failed or cancelled job can be requeued",
                detail={"job": job.id, "status": job.status.value},
            )
        self.metrics.requeues.labels("operator").inc()
        self.on_written(job.id)
        self.on_change()
        return done.job

    def _steerable(
        self, ref: str, pools: Sequence[str] | None, owner: str | None, what: str
    ) -> JobRow:
        """The job, if the caller may steer it: a submitter (``owner``: its token id)
        cancels, stops and requeues only the jobs it submitted; an operator any job of
        its pools."""
        job = self.reads.job(ref, pools)
        if owner is not None and job.submitted_by != owner:
            raise Forbidden(
                f"job {job.id} was submitted by another token; a submitter may {what} only "
                "its own jobs (an operator of the pool may act on any: gpufleet tokens "
                "create --role operator --pool POOL)",
                detail={"job": job.id},
            )
        return job
