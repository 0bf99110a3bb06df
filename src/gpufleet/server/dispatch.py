"""Dispatch: which job a polling worker gets, and the polls waiting for one.

A claim ranks its worker's candidates (the jobs aimed at it, then its pool's queue a page
at a time) in Python with no transaction open, leaves a job to a waiting worker that
ranks better for it (host priority, best fit), and offers the store a few claims, best
first; the store takes the first still pending if no other claim of the worker came
between. The waiting registry holds, per worker whose poll waits on this server, the
view it is ranked by and what it said it has free.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from itertools import islice

from gpufleet.domain import lifecycle
from gpufleet.domain.models import WorkerStatus
from gpufleet.scheduling.matching import (
    Assignment,
    FreeResources,
    JobView,
    WorkerView,
    now_reason,
    rank_key,
    unheld,
)
from gpufleet.server.caps import Caps, Gate
from gpufleet.server.checkpoints import Checkpoints
from gpufleet.server.dataflow import DataFlow
from gpufleet.server.fairqueue import fair_order
from gpufleet.server.fleet import Fleet
from gpufleet.server.lease_secrets import LeaseSecrets
from gpufleet.server.metrics import Metrics
from gpufleet.server.notices import Notices
from gpufleet.server.settings import QueueSettings
from gpufleet.server.sharing import FairShare
from gpufleet.server.views import checkpoint_out
from gpufleet.store import ClaimStore, JobRow, StaleClaim, WorkerRow
from gpufleet.store.api import ClaimSession
from gpufleet.wire import CheckpointOut, JobSpecModel, Lease

log = logging.getLogger("gpufleet.server")

Claimed = tuple[JobRow, lifecycle.Change]


class Dispatch:
    """Claims, and the registry of waiting polls they rank against; one per server process."""

    def __init__(
        self,
        store: ClaimStore,
        settings: QueueSettings,
        fleet: Fleet,
        flow: DataFlow,
        secrets: LeaseSecrets,
        notices: Notices,
        clock: Callable[[], float],
        metrics: Metrics,
        checkpoints: Checkpoints,
        fair: FairShare | None = None,
        caps: Caps | None = None,
    ) -> None:
        self.checkpoints = checkpoints
        self.fair = fair
        self.caps = caps
        self.store = store
        self.settings = settings
        self.fleet = fleet
        self.flow = flow
        self.secrets = secrets
        self.notices = notices
        self.clock = clock
        self.metrics = metrics
        self._waiting: dict[str, tuple[WorkerView, FreeResources]] = {}
        self._waiting_lock = threading.Lock()

    # ---- the waiting polls ------------------------------------------------------------

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
            self.fleet.owned(worker_id, token_id, pools)
        if wait > 0:
            self.wait_begin(worker_id, free)
        else:
            self.fleet.revive(self.fleet.claimer(worker_id))
        return self.try_claim(worker_id, free)

    def wait_begin(self, worker_id: str, free: FreeResources) -> None:
        w = self.fleet.revive(self.fleet.claimer(worker_id))
        with self._waiting_lock:
            self._waiting[worker_id] = (self.fleet.view(w), free)

    def refresh_waiting(self, worker_id: str) -> None:
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

    def superseded(self, worker_id: str, replica: str) -> None:
        """Tell the other server replicas that this worker sent a poll replacing its open
        one (its replica ends that one)."""
        self.store.publish_superseded(worker_id, replica)

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

    # ---- claims -----------------------------------------------------------------------

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
            self.notices.written(job.id)
            return self._lease(job, change)
        return None

    def _lease(self, job: JobRow, change: lifecycle.Change) -> Lease:
        """What the worker is told of a claim it made."""
        claimed_at: float = change.fields["claimed_at"]  # type: ignore[assignment]
        spec, max_run_of = (job.spec, None) if self.caps is None else self.caps.limited(job)
        return Lease(
            job_id=job.id,
            attempt=change.attempt,
            secret=self.secrets.make(job.id, change.attempt, claimed_at),
            spec=JobSpecModel.shown(spec),
            max_run_of=max_run_of,
            gpus=list(change.fields["gpus"]),  # type: ignore[call-overload]
            lease_timeout=self.settings.lease_timeout,
            inputs=self.flow.staged(job.spec) if job.spec.inputs else [],
            checkpoint=self._snapshot(job),
        )

    def _snapshot(self, job: JobRow) -> CheckpointOut | None:
        """The snapshot a new attempt of ``job`` restores: its latest (the first attempt
        and a job that keeps none have none)."""
        if job.spec.checkpoint_dir is None or job.lease == 0:
            return None
        snap = self.checkpoints.latest(job.id)
        return None if snap is None else checkpoint_out(snap)

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

    def _claim(self, w: WorkerRow, free: FreeResources, now: float) -> Claimed | None:
        """One go: the jobs aimed at the worker first, then its pool's queue a page at a
        time (up to ``candidates`` jobs), each page ranked here (no lock is held) and
        offered to the store, a few jobs at a time, best first."""
        fair = self.fair is not None and self.fair.on()
        with self.store.claiming() as session:
            # in fair-share order the queue is read by user, not from its head
            view = session.view(w.id, w.name, w.pool, now, 0 if fair else session.page_size)
            mine = unheld(free, view.held, w.cpu_slots)
            if not (mine.cpu_slots or mine.gpus):
                return None
            me = self.fleet.view(w)
            expires = now + self.settings.lease_timeout
            gate = None if self.caps is None else self.caps.gate(session)

            def offer(page: list[JobRow]) -> Claimed | None:
                rows, rest = {j.id: j for j in page}, page
                while rest:
                    choices, rest = self._choices(
                        rest, w, me, mine, now, expires, session.choices, gate
                    )
                    recheck = None if gate is None else gate.recheck(choices, rows)
                    taken = session.claim(w.id, view.claims, choices, recheck)
                    if taken is not None:
                        return rows[taken], next(c for c in choices if c.job_id == taken)
                return None

            got = offer(self._made_way(session, w.id, now) + view.aimed)
            if got is None and fair:
                return self._offer_fairly(session, w.pool, now, offer)
            seen, page = 0, view.queue
            while got is None and seen < self.settings.candidates:
                got = offer(page)
                if got is not None or len(page) < session.page_size:
                    break
                seen += len(page)
                page = session.page(w.pool, now, page[-1], session.page_size)
            return got

    def _made_way(self, session: ClaimSession, worker_id: str, now: float) -> list[JobRow]:
        """The jobs a preemption is freeing a slot of this worker for (read only while
        preemption is on: none can be, else)."""
        if self.fair is None or not self.fair.rules.current().preemption.enabled:
            return []
        return session.made_way(worker_id, now)

    def _offer_fairly(
        self,
        session: ClaimSession,
        pool: str,
        now: float,
        offer: Callable[[list[JobRow]], Claimed | None],
    ) -> Claimed | None:
        """Offer the pool's queue in fair-share order, a page at a time, up to
        ``candidates`` jobs."""
        assert self.fair is not None
        order = fair_order(session, pool, now, self.fair.standings(pool), session.page_size)
        seen = 0
        while seen < self.settings.candidates:
            page = list(islice(order, session.page_size))
            if not page:
                return None
            got = offer(page)
            if got is not None:
                return got
            seen += len(page)
        return None

    def _choices(
        self,
        page: list[JobRow],
        w: WorkerRow,
        me: WorkerView,
        mine: FreeResources,
        now: float,
        expires: float,
        most: int,
        gate: Gate | None = None,
    ) -> tuple[list[lifecycle.Change], list[JobRow]]:
        """The next ``most`` claims this worker would make of ``page``, best first (each job it
        may run now on what it has free, unless a cap holds it back or a waiting worker
        ranks better for it), and the jobs of the page not ranked yet."""
        out = []
        for n, job in enumerate(page):
            jv = JobView(job.id, job.spec, job.created_at)
            verdict = now_reason(jv, me, mine, now, self.settings.prefer_cuda_grace)
            if isinstance(verdict, str) or (gate is not None and gate.refuses(job, verdict.gpus)):
                continue
            if self._better_waiting(jv, me, verdict, now):
                continue
            out.append(
                lifecycle.claim(job, w.id, w.name, verdict.gpus, now, expires, job.spec_json)
            )
            if len(out) == most:
                return out, page[n + 1 :]
        return out, []
