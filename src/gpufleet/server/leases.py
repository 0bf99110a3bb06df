"""The lease protocol: claims, start, heartbeats, logs, finish, release, and the sweep of
leases whose worker went silent.

A claim hands a worker a lease (job id, attempt); every later write carries it and is
applied by a conditional update, so a stale lease changes nothing (409) and a job is
recorded as finished once. The states each write moves a job to come from the one table
in :mod:`gpufleet.domain.lifecycle`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

from gpufleet.domain import lifecycle, worker_lifecycle
from gpufleet.domain.models import JobStatus, WorkerStatus
from gpufleet.domain.quota import MARKER
from gpufleet.errors import Conflict, Forbidden, NotFound
from gpufleet.scheduling.matching import (
    Assignment,
    FreeResources,
    JobView,
    WorkerView,
    now_reason,
    rank_key,
    unheld,
)
from gpufleet.server.dataflow import DataFlow
from gpufleet.server.fleet import Fleet, OnEvent
from gpufleet.server.lease_secrets import LeaseSecrets
from gpufleet.server.metrics import Metrics
from gpufleet.server.settings import QueueSettings
from gpufleet.store import JobRow, StaleClaim, Store, WorkerRow
from gpufleet.wire import (
    EnvUsed,
    HeartbeatRequest,
    HeartbeatResponse,
    JobSpecModel,
    Lease,
    LeaseOrder,
)

log = logging.getLogger("gpufleet.server")

APPEND_CHUNK = 1_000  # output lines a transaction stores at most


def printable(text: str) -> str:
    """Job output is arbitrary bytes; a NUL cannot be stored in PostgreSQL text."""
    return text.replace("\x00", "\ufffd")


class Leases:
    """Claims and every lease-carrying write; one per server process."""

    def __init__(
        self,
        store: Store,
        settings: QueueSettings,
        fleet: Fleet,
        flow: DataFlow,
        clock: Callable[[], float],
        on_change: Callable[[], None],
        on_event: OnEvent,
        metrics: Metrics | None = None,
        on_written: Callable[[str], None] = lambda _job_id: None,
    ) -> None:
        self.store = store
        self.secrets = LeaseSecrets(store)
        self.metrics = metrics or Metrics()
        # A job's event log has new records (a status change, output): followers read now.
        self._on_written = on_written
        self.settings = settings
        self.fleet = fleet
        self.flow = flow
        self.clock = clock
        self._on_change = on_change
        # Inside ``together``: what to tell once its transaction has committed.
        self._told: ContextVar[list[Callable[[], None]] | None] = ContextVar(
            f"leases{id(self)}", default=None
        )
        self.on_event = on_event
        self._waiting: dict[str, tuple[WorkerView, FreeResources]] = {}
        self._waiting_lock = threading.Lock()

    def on_written(self, job_id: str) -> None:
        self._tell(lambda: self._on_written(job_id))

    def on_change(self) -> None:
        self._tell(self._on_change)

    def _tell(self, call: Callable[[], None]) -> None:
        later = self._told.get()
        if later is None:
            call()
        else:
            later.append(call)

    @contextmanager
    def together(
        self, job_ids: Sequence[str] = ()
    ) -> Iterator[Callable[[], AbstractContextManager[object]]]:
        """The writes made inside go in one transaction (:meth:`Store.together`, whose
        ``part`` it gives; ``job_ids``: the jobs it will change, locked first in one
        order); followers and waiting polls are told once it has committed, so none reads
        before the change is there. Nothing is told if it fails, and a failure to tell
        one is logged: the writes stand."""
        told: list[Callable[[], None]] = []  # stays empty inside another: its end tells
        token = self._told.set(told) if self._told.get() is None else None
        try:
            with self.store.together(job_ids) as part:
                yield part
        finally:
            if token is not None:
                self._told.reset(token)
        for call in told:
            try:
                call()
            except Exception:  # committed: the others are still told
                log.exception("telling followers or polls of a change failed")

    def check_holder(
        self,
        job_id: str,
        attempt: int,
        token_id: str,
        pools: Sequence[str] | None,
        secret: str | None,
    ) -> JobRow:
        """The job, if (job_id, attempt) is its current lease, the worker holding it was
        enrolled with ``token_id``, and ``secret`` is the one its claim gave: 404 for a job
        of a pool the caller cannot see, 409 for a stale lease, 403 for a lease another
        token's worker holds or a wrong secret."""
        job = self._held(job_id, attempt, pools)
        holder = self.fleet.claimer(job.worker_id) if job.worker_id else None
        if holder is None or holder.token_id != token_id:
            raise Forbidden(
                f"job {job_id} attempt {attempt} is held by worker "
                f"{holder.name if holder else '?'}, not by a worker of this token",
                detail={"job": job_id, "attempt": attempt},
            )
        if job.claimed_at is None or not self.secrets.holds(
            secret, job_id, attempt, job.claimed_at
        ):
            raise Forbidden(
                f"job {job_id} attempt {attempt}: this write does not carry the secret the "
                "attempt's claim gave its worker (field 'secret'); a worker's token alone "
                "cannot write an attempt's results",
                detail={"job": job_id, "attempt": attempt, "field": "secret"},
            )
        return job

    def retire(self, token_id: str) -> list[str]:
        """A revoked token's workers go offline and their jobs back to the queue (the
        attempt is not counted: the job did not fail). Returns the requeued job ids."""
        requeued = []
        now = self.clock()
        for w in self.store.list_workers():
            if w.token_id != token_id:
                continue
            for job in self.store.active_jobs(w.id):
                if self._hand_back(job):
                    requeued.append(job.id)
            if w.status != WorkerStatus.OFFLINE:
                self.on_event("worker.offline", w.id, f"{w.name}: its token was revoked", None)
            self.store.change_worker(worker_lifecycle.revoke(w.id, now))
            self.fleet.forget(w.id)
        if requeued:
            self.on_change()
        return requeued

    # ---- the worker protocol ----------------------------------------------------------

    def _better_waiting(self, job: JobView, me: WorkerView, mine: Assignment, now: float) -> bool:
        """Whether another polling worker ranks better for ``job`` (host priority, best fit)."""
        my_rank = rank_key(job.spec, me, mine)
        with self._waiting_lock:
            others = [v for k, v in self._waiting.items() if k != me.id]
        for view, free in others:
            # The best rank this worker could have; most of the time it cannot beat ours and
            # the full check is skipped.
            priority = view.policy.priority if view.policy else 0
            if not (-priority, 0, 0, 0) < my_rank:
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
            self.fleet.own(worker_id, token_id, pools)
        if wait > 0:
            self.wait_begin(worker_id, free)
        else:
            self.fleet.revive(self.fleet.claimer(worker_id))
        return self.try_claim(worker_id, free)

    def wait_begin(self, worker_id: str, free: FreeResources) -> None:
        w = self.fleet.revive(self.fleet.claimer(worker_id))
        with self._waiting_lock:
            self._waiting[worker_id] = (self.fleet.view(w), free)

    def _refresh_waiting(self, worker_id: str) -> None:
        """A waiting worker's heartbeat changed what it offers (the environments it has
        built, its Pythons): the view other claims rank it by is taken again, else a job
        it is now best for would go to whichever worker asked first until its poll ends."""
        with self._waiting_lock:
            if worker_id not in self._waiting:
                return
        view = self.fleet.view(self.fleet.claimer(worker_id))
        with self._waiting_lock:
            if worker_id in self._waiting:
                self._waiting[worker_id] = (view, self._waiting[worker_id][1])

    def wait_end(self, worker_id: str) -> None:
        with self._waiting_lock:
            self._waiting.pop(worker_id, None)

    def try_claim(self, worker_id: str, free: FreeResources) -> Lease | None:
        """Claim the best job this worker may run now, or None. ``free`` is what the worker
        said it has free; slots the server knows its jobs hold are taken out of it. The
        ranking runs on a snapshot with no transaction open; the claim commits only if no
        other claim for this worker came between (else it ranks again), so a poll that
        crossed a claim cannot hand a slot out twice."""
        w = self.fleet.claimer(worker_id)
        if w.drain or w.status in (WorkerStatus.OFFLINE, WorkerStatus.DRAINING):
            return None
        for _ in range(5):
            now = self.clock()
            try:
                claimed = self._claim(w, free, now)
            except StaleClaim:
                continue
            if claimed is None:
                return None
            job, change = claimed
            self.metrics.claimed(job.created_at, now)
            self.on_written(job.id)
            claimed_at: float = change.fields["claimed_at"]  # type: ignore[assignment]
            return Lease(
                job_id=job.id,
                attempt=change.attempt,
                secret=self.secrets.make(job.id, change.attempt, claimed_at),
                spec=JobSpecModel.shown(job.spec),
                gpus=list(change.fields["gpus"]),  # type: ignore[call-overload]
                lease_timeout=self.settings.lease_timeout,
                inputs=self.flow.staged(job.spec) if job.spec.inputs else [],
            )
        return None

    def claim_more(self, worker_id: str, free: FreeResources, most: int) -> list[Lease]:
        """Up to ``most`` further claims for a worker that just got a lease, with no wait:
        each is ranked and committed like the first, and each sees the slots the ones
        before took (the store counts them as held), so they never overlap."""
        more: list[Lease] = []
        while len(more) < most:
            try:
                lease = self.try_claim(worker_id, free)
            except Exception:  # the first lease and these are committed: never lose them
                log.exception("claiming more jobs for worker %s failed", worker_id)
                break
            if lease is None:
                break
            more.append(lease)
        return more

    def _claim(
        self, w: WorkerRow, free: FreeResources, now: float
    ) -> tuple[JobRow, lifecycle.Change] | None:
        """One go: the jobs aimed at the worker first, then its pool's queue a page at a
        time (up to ``candidates`` jobs), each page ranked here (no lock is held) and
        offered to the store, a few jobs at a time, best first."""
        with self.store.claiming() as session:
            view = session.view(w.id, w.name, w.pool, now, session.page_size)
            mine = unheld(free, view.held, w.cpu_slots)
            if not (mine.cpu_slots or mine.gpus):
                return None
            me = self.fleet.view(w)
            expires = now + self.settings.lease_timeout

            def offer(page: list[JobRow]) -> tuple[JobRow, lifecycle.Change] | None:
                rows, rest = {j.id: j for j in page}, page
                while rest:
                    choices, rest = self._choices(rest, w, me, mine, now, expires, session.choices)
                    taken = session.claim(w.id, view.claims, choices)
                    if taken is not None:
                        return rows[taken], next(c for c in choices if c.job_id == taken)
                return None

            got = offer(view.aimed)
            seen, page = 0, view.queue
            while got is None and seen < self.settings.candidates:
                got = offer(page)
                if got is not None or len(page) < session.page_size:
                    break
                seen += len(page)
                page = session.page(w.pool, now, page[-1], session.page_size)
            return got

    def _choices(
        self,
        page: list[JobRow],
        w: WorkerRow,
        me: WorkerView,
        mine: FreeResources,
        now: float,
        expires: float,
        most: int,
    ) -> tuple[list[lifecycle.Change], list[JobRow]]:
        """The next ``most`` claims this worker would make of ``page``, best first (each job it
        may run now on what it has free, unless a waiting worker ranks better for it), and
        the jobs of the page not ranked yet."""
        out = []
        for n, job in enumerate(page):
            jv = JobView(job.id, job.spec, job.created_at)
            verdict = now_reason(jv, me, mine, now, self.settings.prefer_cuda_grace)
            if isinstance(verdict, str) or self._better_waiting(jv, me, verdict, now):
                continue
            out.append(
                lifecycle.claim(job, w.id, w.name, verdict.gpus, now, expires, job.spec_json)
            )
            if len(out) == most:
                return out, page[n + 1 :]
        return out, []

    def _job(self, job_id: str) -> JobRow:
        job = self.store.get_job(job_id)
        if job is None:
            raise NotFound(f"no job {job_id!r}", detail={"job": job_id})
        return job

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

    def start(
        self,
        job_id: str,
        attempt: int,
        said: float | None = None,
        claimed_at: float | None = None,
        environment: EnvUsed | None = None,
    ) -> None:
        """The worker started the job's process. The change takes only on the current
        lease of a claimed job; else the job says why (404, 409, or a retried start).
        The start is dated when the worker ``said`` (its clock) if that lies between the
        claim and now, else the nearer of the two (with nothing said, now): a report that
        waited out a server outage, or the round trip of any report, does not make the job
        look started later than it was. ``environment``: the Python environment the job
        runs in, kept on the attempt (and counted in the metrics, once)."""
        now = self.clock()
        started = now
        if said is not None:
            started = min(now, said if claimed_at is None else max(said, claimed_at))
        env = None if environment is None else environment.model_dump_json()
        change = lifecycle.start(job_id, attempt, started, now + self.settings.lease_timeout, env)
        done = self.store.start(change)
        if done is not None:
            self.metrics.started(done.job.claimed_at, started)
            if environment is not None:
                self.metrics.environment(environment.built, environment.seconds)
            self.on_written(job_id)
        else:
            job = self._held(job_id, attempt)
            if job.status == JobStatus.RUNNING:  # a retried start whose answer was lost
                return
            raise Conflict(
                f"job {job_id} attempt {attempt} was already started",
                detail={"job": job_id, "attempt": attempt},
            )

    def superseded(self, worker_id: str, replica: str) -> None:
        """Tell the other server replicas that this worker sent a poll replacing its open
        one (its replica ends that one)."""
        self.store.publish_superseded(worker_id, replica)

    def keep(self, leases: Sequence[tuple[str, int]], worker_id: str) -> None:
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
        if req.environments is not None or req.pythons is not None:
            self._refresh_waiting(w.id)
        stops = self.store.stops(held)
        orders = []
        for r in req.leases:
            if (r.job_id, r.attempt) not in held:
                orders.append(LeaseOrder(job_id=r.job_id, attempt=r.attempt, order="cancel"))
            elif r.job_id in stops:
                orders.append(
                    LeaseOrder(
                        job_id=r.job_id, attempt=r.attempt, order="stop", grace=stops[r.job_id]
                    )
                )
            else:
                orders.append(LeaseOrder(job_id=r.job_id, attempt=r.attempt, order="continue"))
        return HeartbeatResponse(orders=orders, drain=w.drain)

    def leave(self, worker_id: str, reason: str) -> None:
        """A worker stops: it is offline now, and a job it still held goes back to the
        queue without counting the attempt (it should have handed it back)."""
        w = self.fleet.worker(worker_id)
        returned = [j for j in self.store.active_jobs(w.id) if self._hand_back(j)]
        self.fleet.leave(w, reason)
        if returned:
            self.on_change()

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
                self._held(job_id, attempt)
            if done.cut is not None:
                self._cut(job_id, attempt, done.cut)
            stop = done.stop
        self.on_written(job_id)
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
        as :meth:`check_holder` just read it (the change itself is guarded by the lease).
        ``failure``: its class ("environment"), and ``final``: it fails the same way on
        every worker, so the job is not retried (``lifecycle.finish``)."""
        job = held if held is not None else self._held(job_id, attempt)
        tail = [printable(line) for line in stderr_tail]
        said = printable(error) if error else None
        now = self.clock()
        # Only a failure reads the spec's exit codes: a success need not parse it.
        ok = exit_code == 0 and said is None and failure is None
        codes = {} if ok else _retry_codes(job)
        change = lifecycle.finish(
            job,
            exit_code,
            said,
            tail,
            now,
            self.settings.retry_backoff,
            failure=failure,
            final=final,
            **codes,
        )
        done = self.store.finish(change)
        if done is None:
            self._held(job_id, attempt)
            raise Conflict(f"job {job_id} changed while finishing; retry", detail={"job": job_id})
        self.metrics.ended(change.status.value, job.started_at, now, "retry")
        for written in (job_id, *done.failed):
            self.on_written(written)
        if change.status == JobStatus.PENDING or done.released:
            self.on_change()
        return done.job

    def refused_result(
        self,
        job_id: str,
        attempt: int,
        token_id: str,
        exit_code: int | None,
        error: str | None,
        secret: str | None = None,
    ) -> None:
        """A result for an attempt that had ended (its lease lost, the job cancelled) is
        refused with 409; keep what it said in that attempt's history, if a worker of
        ``token_id`` ran the attempt."""
        ran = next((a for a in self.store.attempts(job_id) if a.attempt == attempt), None)
        holder = self.fleet.claimer(ran.worker_id) if ran and ran.worker_id else None
        if holder is None or holder.token_id != token_id:
            return
        if ran is None or not self.secrets.holds(secret, job_id, attempt, ran.claimed_at):
            return  # only the attempt's own worker may leave a word in its history
        said = f"exit code {exit_code}" if exit_code is not None else "no exit code"
        if error:
            said += f" ({printable(error)[:500]})"
        when = datetime.fromtimestamp(self.clock(), UTC).isoformat(timespec="seconds")
        self.store.late_result(job_id, attempt, f"{said}, sent at {when}; refused")

    def attach_artifact(self, job_id: str, attempt: int, sha256: str) -> None:
        self.flow.attach(self._held(job_id, attempt), attempt, sha256)

    def release(self, job_id: str, attempt: int, reason: str) -> JobRow:
        """A draining worker hands a job back; the attempt is not counted."""
        job = self._held(job_id, attempt)
        if not self._hand_back(job):
            self._held(job_id, attempt)
        self.on_change()
        return self._job(job_id)

    def _hand_back(self, job: JobRow) -> bool:
        """Put a job its worker gives up (drained, left, token revoked) back in the queue,
        the attempt not counted (a job asked to stop fails instead)."""
        now = self.clock()
        change = lifecycle.release(job, now, "its worker handed it back")
        if self.store.release(change) is None:
            return False
        self.metrics.ended(change.status.value, job.started_at, now, "released")
        self.on_written(job.id)
        return True

    def sweep(self) -> tuple[list[str], list[str]]:
        """Expire leases of silent workers, mark those workers offline, forget ephemeral
        workers gone for longer than their TTL. Returns (requeued jobs, offline workers)."""
        return self.expire(), self.tidy()

    def expire(self) -> list[str]:
        """Requeue (or fail) the jobs whose lease has lapsed; their ids. Safe to run on
        several servers at once: each requeue is a conditional update of one lease."""
        now = self.clock()
        expired = self.store.expired_leases(now)
        names = {w.id: w.name for w in self.store.list_workers()} if expired else {}
        requeued: list[str] = []
        for job in expired:
            who = names.get(job.worker_id or "", job.worker_id)
            if self._lose(job, now, who or "?", restarted=False):
                requeued.append(job.id)
        if requeued:
            self.on_change()
        return requeued

    def _lose(self, job: JobRow, now: float, who: str, restarted: bool) -> bool:
        """The job's lease is lost (``lifecycle.lose``): requeued, or failed with no
        attempts left; whether it took (a heartbeat or a result may have come first)."""
        change = lifecycle.lose(job, now, who, restarted)
        if self.store.reap(change) is None:
            return False
        self.metrics.lease_expirations.inc()
        self.metrics.ended(change.status.value, job.started_at, now, "lease_lost")
        self.on_written(job.id)
        final = change.status == JobStatus.FAILED
        then = "failed: no attempts left" if final else "requeued"
        why = "started again without it" if restarted else "no heartbeat"
        self.on_event(
            "lease.lost", job.id, f"attempt {job.lease} on worker {who}: {why}; {then}", None
        )
        return True

    def settle(self, worker_id: str, name: str, running: Sequence[tuple[str, int]]) -> list[str]:
        """A worker registers again and runs only ``running``: the leases it held besides
        (a worker killed and started again lost its jobs with it) are lost now, not at
        their expiry. The requeued (or failed) job ids."""
        still = set(running)
        now = self.clock()
        lost = [
            job.id
            for job in self.store.active_jobs(worker_id)
            if (job.id, job.lease) not in still and self._lose(job, now, name, restarted=True)
        ]
        if lost:
            self.on_change()
        return lost

    def tidy(self) -> list[str]:
        """Recount dependencies another replica met, fold the job count changes in (on
        PostgreSQL), mark silent workers offline and forget ephemeral ones gone past
        their TTL; the ids that went offline."""
        self.store.fold_job_counts()
        if self.store.refresh_waiting():
            self.on_change()
        return self.fleet.sweep()


def _retry_codes(job: JobRow) -> dict[str, tuple[int, ...]]:
    """The exit codes a job names as retried and not retried."""
    spec = job.spec
    return {"retry_on": spec.retry_on, "no_retry_on": spec.no_retry_on}
