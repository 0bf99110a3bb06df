"""The lease protocol: what a worker writes on a job it holds (start, heartbeats, output,
finish, release) and a lease lost.

A claim (:mod:`gpufleet.server.dispatch`) hands a worker a lease (job id, attempt); every
later write carries it and is applied by a conditional update, so a stale lease changes
nothing (409) and a job is recorded as finished once. The states each write moves a job to
come from the one table in :mod:`gpufleet.domain.lifecycle`.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from gpufleet.domain import lifecycle, oom
from gpufleet.domain.models import MIB_PER_GIB, JobStatus
from gpufleet.domain.quota import MARKER
from gpufleet.errors import Conflict, NotFound
from gpufleet.server.dispatch import Dispatch
from gpufleet.server.fleet import Fleet, OnEvent
from gpufleet.server.metrics import Metrics
from gpufleet.server.notices import Notices
from gpufleet.server.settings import QueueSettings
from gpufleet.store import (
    EventStore,
    FleetStore,
    JobRow,
    JobStore,
    PreemptionStore,
    Transaction,
    WorkerRow,
    json_columns,
)
from gpufleet.wire import (
    EnvUsed,
    HeartbeatRequest,
    HeartbeatResponse,
    LeaseOrder,
    LeaseRef,
    Restored,
)

log = logging.getLogger("gpufleet.server")

APPEND_CHUNK = 1_000  # output lines a transaction stores at most


def printable(text: str) -> str:
    """Job output is arbitrary bytes; a NUL cannot be stored in PostgreSQL text."""
    return text.replace("\x00", "\ufffd")


class LeaseStore(JobStore, EventStore, FleetStore, PreemptionStore, Protocol):
    """What the lease protocol writes: jobs and their attempts, and their event logs (and
    reads of the fleet: what memory a machine has, after an attempt ran out of it)."""


class Leases:
    """Every lease-carrying write, and a lease lost; one per server process."""

    def __init__(
        self,
        store: LeaseStore,
        settings: QueueSettings,
        fleet: Fleet,
        dispatch: Dispatch,
        notices: Notices,
        clock: Callable[[], float],
        on_event: OnEvent,
        metrics: Metrics,
    ) -> None:
        self.store = store
        self.settings = settings
        self.fleet = fleet
        self.dispatch = dispatch
        self.notices = notices
        self.clock = clock
        self.on_event = on_event
        self.metrics = metrics

    def within(self, tx: Transaction) -> Leases:
        """These writes made through ``tx``: their notices given once it has committed."""
        bound = copy.copy(self)
        bound.store, bound.notices = tx.store, self.notices.within(tx)
        return bound

    def _job(self, job_id: str) -> JobRow:
        job = self.store.get_job(job_id)
        if job is None:
            raise NotFound(f"no job {job_id!r}", detail={"job": job_id})
        return job

    def held(self, job_id: str, attempt: int, pools: Sequence[str] | None = None) -> JobRow:
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

    def start(
        self,
        job_id: str,
        attempt: int,
        said: float | None = None,
        claimed_at: float | None = None,
        environment: EnvUsed | None = None,
        restored: Restored | None = None,
    ) -> None:
        """The worker started the job's process. The change takes only on the current
        lease of a claimed job; else the job says why (404, 409, or a retried start).
        The start is dated when the worker ``said`` (its clock) if that lies between the
        claim and now, else the nearer of the two (with nothing said, now): a report that
        waited out a server outage, or the round trip of any report, does not make the job
        look started later than it was. ``environment``: the Python environment the job
        runs in, kept on the attempt (and counted in the metrics, once); ``restored``: the
        checkpoint snapshot restored before it started, kept on the attempt and told in the
        job's event log."""
        now = self.clock()
        started = now
        if said is not None:
            started = min(now, said if claimed_at is None else max(said, claimed_at))
        env = None if environment is None else environment.model_dump_json()
        back = None if restored is None else restored.model_dump()
        expires = now + self.settings.lease_timeout
        change = lifecycle.start(job_id, attempt, started, expires, env, back)
        done = self.store.start(change)
        if done is not None:
            self.metrics.started(done.job.claimed_at, started)
            if environment is not None:
                self.metrics.environment(environment.built, environment.seconds)
            if restored is not None:
                self.metrics.restored(restored.seconds)
            self.notices.written(job_id)
        else:
            job = self.held(job_id, attempt)
            if job.status == JobStatus.RUNNING:  # a retried start whose answer was lost
                return
            raise Conflict(
                f"job {job_id} attempt {attempt} was already started",
                detail={"job": job_id, "attempt": attempt},
            )

    def renew_for(self, leases: Sequence[tuple[str, int]], worker_id: str) -> None:
        """A worker registering again still runs these jobs: their leases live on."""
        self.store.extend_leases(leases, self.clock() + self.settings.lease_timeout, worker_id)

    def heartbeat(
        self, worker_id: str, req: HeartbeatRequest, w: WorkerRow | None = None
    ) -> HeartbeatResponse:
        """``w``: the worker's row if the caller has just read it; a heartbeat needs it
        fresh (its drain flag, and whether it was offline)."""
        w = w or self.fleet.worker(worker_id)
        now = self.clock()
        used = {(r.job_id, r.attempt): r.gpu_mib for r in req.leases if r.gpu_mib is not None}
        held = self.store.extend_leases(
            [(r.job_id, r.attempt) for r in req.leases],
            now + self.settings.lease_timeout,
            w.id,
            used,
        )
        stats = json.dumps([g.model_dump() for g in req.gpus]) if req.gpus else None
        self.fleet.beat(w, req.draining, stats)
        if req.environments is not None:  # its cache changed: the whole list, now
            built = json.dumps([e.model_dump() for e in req.environments])
            self.fleet.built(w, built)
        if req.pythons is not None:
            self.fleet.pythons(w, req.pythons)
        owner = None if req.owner is None else req.owner.model_dump_json()
        if owner != w.owner_state:  # its owner policy says something new: kept, shown
            self.fleet.store.set_worker_owner_state(w.id, owner)
            self.fleet.forget(w.id)
        if req.environments is not None or req.pythons is not None:
            self.dispatch.refresh_waiting(w.id)
        orders = _orders(
            req.leases,
            held,
            self.store.stops(held),
            self.store.pausing(held),
            self.store.preempting(held),
        )
        drain_in = None if w.drain_by is None else max(0.0, w.drain_by - self.clock())
        return HeartbeatResponse(orders=orders, drain=w.drain, drain_in=drain_in)

    def append_logs(
        self,
        job_id: str,
        attempt: int,
        lines: Sequence[tuple[str, str]],
        first: int | None = None,
    ) -> float | None:
        """Append output lines (from line ``first`` of the attempt on: lines the server has
        already are skipped; output past the attempt's quota is dropped); the stop grace
        when the job has been asked to stop (the worker learns it here, within a second of
        a stop, as well as at its heartbeat)."""
        lines = [(stream, printable(line)) for stream, line in lines]
        now = self.clock()
        # A big batch goes in as several short transactions: on SQLite each holds the one
        # write lock, and a claim or a start report waits for at most one of them. Only a
        # batch that says where it begins (``first``) is split: sent again after a part
        # went in, the lines the store has are skipped.
        parts = (
            [(0, lines)]
            if first is None or len(lines) <= APPEND_CHUNK
            else [(at, lines[at : at + APPEND_CHUNK]) for at in range(0, len(lines), APPEND_CHUNK)]
        )
        stop = None
        for at, part in parts:
            start = None if first is None else first + at
            done = self.store.append_logs(
                job_id, attempt, part, now, start, self.settings.output_quota
            )
            if not done.held:
                self.held(job_id, attempt)
            if done.cut is not None:
                self._cut(job_id, attempt, done.cut)
            stop = done.stop
        self.notices.written(job_id)
        return stop

    def _cut(self, job_id: str, attempt: int, marker: str) -> None:
        """An attempt's output passed its quota and is cut from here: say so in the log
        and the audit log (the job's event log has the marker and a record already)."""
        why = marker.removeprefix(MARKER)
        log.warning("job %s attempt %d: output cut: %s", job_id, attempt, why)
        self.on_event("job.output_cut", job_id, f"attempt {attempt}: {why}", None)

    def finish(
        self,
        job_id: str,
        attempt: int,
        exit_code: int | None,
        error: str | None,
        stderr_tail: Sequence[str] = (),
        held: JobRow | None = None,
        failure: str | None = None,
        final: bool = False,
    ) -> JobRow:
        """Record the end of an attempt: success, a retry after backoff, or failure. A
        failed attempt keeps the last lines of its stderr, to say why. ``held``: the job
        as :meth:`~gpufleet.server.holders.Holders.check` just read it (the change itself
        is guarded by the lease). ``failure``: its class ("environment"), and ``final``: it
        fails the same way on every worker, so the job is not retried
        (``lifecycle.finish``)."""
        job = held if held is not None else self.held(job_id, attempt)
        tail = [printable(line) for line in stderr_tail]
        said = printable(error) if error else None
        now = self.clock()
        # Only a failure reads the spec's exit codes: a success need not parse it.
        ok = exit_code == 0 and said is None and failure is None
        codes = {} if ok else _retry_codes(job)
        no_bigger, raised = self._more_memory(job, failure) if failure else (None, None)
        change = lifecycle.finish(
            job,
            exit_code,
            said,
            tail,
            now,
            self.settings.retry_backoff,
            failure=failure,
            final=final,
            no_bigger=no_bigger,
            raised=raised,
            retry_on=codes.get("retry_on", ()),
            no_retry_on=codes.get("no_retry_on", ()),
        )
        done = self.store.finish(change)
        if done is None:
            self.held(job_id, attempt)
            raise Conflict(f"job {job_id} changed while finishing; retry", detail={"job": job_id})
        self.metrics.ended(change.status.value, job, now, "retry")
        for written in (job_id, *done.failed):
            self.notices.written(written)
        if change.status == JobStatus.PENDING or done.released:
            self.notices.changed()
        return done.job

    def _more_memory(
        self, job: JobRow, failure: str
    ) -> tuple[str | None, dict[str, object] | None]:
        """After an attempt out of GPU or host memory: the job's next spec, asking for
        more than the machine it ran on had, and why (``raised``); or why no worker of
        its pool has more (``no_bigger``: the job fails at once)."""
        worker = self.store.get_worker(job.worker_id) if job.worker_id else None
        had = _memory_had(worker, job.gpus, failure) if worker is not None else None
        need = oom.raised_need(failure, job.lease, had)
        if need is None:
            return None, None
        pool = self.store.list_workers([job.pool])
        if not any((_memory_had(w, (), failure, most=True) or 0) > need.value for w in pool):
            kind = "a GPU" if failure == oom.GPU_OOM else "a machine"
            return (
                f"not retried: no worker of pool {job.pool} has {kind} with more than {had:g} GiB",
                None,
            )
        spec = job.spec
        r = spec.requirements
        if need.field == "min_vram_gib":
            requirements = replace(r, min_vram_gib=need.value)
        else:
            requirements = replace(r, min_ram_gib=need.value)
        fields: dict[str, object] = {
            "spec": json_columns.spec_json(replace(spec, requirements=requirements)),
            "raised": json.dumps({"field": need.field, "value": need.value, "why": need.why}),
        }
        return None, fields

    def release(self, job_id: str, attempt: int, reason: str, owner: bool = False) -> JobRow:
        """A draining worker hands a job back; the attempt is not counted (``owner``: it
        was vacated for the workstation's owner, not counted as a loss either)."""
        job = self.held(job_id, attempt)
        if not self.hand_back(job, owner):
            self.held(job_id, attempt)
        self.notices.changed()
        return self._job(job_id)

    def hand_back(self, job: JobRow, owner: bool = False) -> bool:
        """Put a job its worker gives up (drained, left, token revoked, vacated for the
        owner) back in the queue, the attempt not counted (a job asked to stop fails
        instead)."""
        now = self.clock()
        why = "its worker handed it back"
        change = lifecycle.release(job, now, why, self.settings.max_losses, owner)
        if self.store.release(change) is None:
            return False
        why = "preempted" if change.event is lifecycle.Event.PREEMPT else "released"
        self.metrics.ended(change.status.value, job, now, why)
        self.notices.written(job.id)
        return True

    def lose(self, job: JobRow, now: float, who: str, restarted: bool) -> bool:
        """The job's lease is lost (``lifecycle.lose``): requeued, or failed with no
        attempts left; whether it took (a heartbeat or a result may have come first)."""
        change = lifecycle.lose(job, now, who, restarted, self.settings.max_losses)
        if self.store.lose(change) is None:
            return False
        self.metrics.leases_lost.inc()
        self.metrics.ended(change.status.value, job, now, "lease_lost")
        self.notices.written(job.id)
        final = change.status == JobStatus.FAILED
        then = "failed: it has lost its machine too often" if final else "requeued"
        why = "started again without it" if restarted else "no heartbeat"
        self.on_event(
            "lease.lost", job.id, f"attempt {job.lease} on worker {who}: {why}; {then}", None
        )
        return True


def _memory_had(
    worker: WorkerRow, gpus: Sequence[int], failure: str, most: bool = False
) -> float | None:
    """GiB of memory the attempt had on ``worker``: the smallest of its GPUs ``gpus``
    (after a GPU out-of-memory) or the machine's RAM; with ``most``, the most any GPU
    of the worker has (what it could offer a retry)."""
    cap = worker.capability
    if failure != oom.GPU_OOM:
        return cap.ram_mib / MIB_PER_GIB if cap.ram_mib else None
    sizes = [g.total_gib for g in cap.gpus if most or g.index in gpus]
    if not sizes:
        return None
    return max(sizes) if most else min(sizes)


def _retry_codes(job: JobRow) -> dict[str, tuple[int, ...]]:
    """The exit codes a job names as retried and not retried."""
    spec = job.spec
    return {"retry_on": spec.retry_on, "no_retry_on": spec.no_retry_on}


def _orders(
    leases: Sequence[LeaseRef],
    held: Collection[tuple[str, int]],
    stops: Mapping[str, float],
    pausing: Collection[str] = (),
    preempting: Collection[str] = (),
) -> list[LeaseOrder]:
    """What a heartbeat tells its worker of each lease it named: cancel one it no longer
    holds, vacate one asked to pause or to make way for a job of a higher priority, stop
    (with the grace) one asked to stop, else continue."""
    orders = []
    for r in leases:
        if (r.job_id, r.attempt) not in held:
            orders.append(LeaseOrder(job_id=r.job_id, attempt=r.attempt, order="cancel"))
        elif r.job_id in pausing:
            orders.append(LeaseOrder(job_id=r.job_id, attempt=r.attempt, order="pause"))
        elif r.job_id in preempting:
            orders.append(LeaseOrder(job_id=r.job_id, attempt=r.attempt, order="preempt"))
        elif r.job_id in stops:
            orders.append(
                LeaseOrder(job_id=r.job_id, attempt=r.attempt, order="stop", grace=stops[r.job_id])
            )
        else:
            orders.append(LeaseOrder(job_id=r.job_id, attempt=r.attempt, order="continue"))
    return orders
