"""Upkeep of the fleet's leases: the sweep (leases whose worker went silent, workers gone
silent, the job counts folded in), and the leases a worker gives up as it leaves, as it
registers again, or as its token is revoked.

Each step is a conditional update of one lease or worker, so servers sharing a database
may run the sweep at once. Old output and audit records go by
:class:`~gpufleet.server.retention.Retention`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from gpufleet.domain import worker_lifecycle
from gpufleet.domain.models import WorkerStatus
from gpufleet.server.fleet import Fleet, OnEvent
from gpufleet.server.leases import Leases
from gpufleet.server.notices import Notices
from gpufleet.store import FleetStore, JobStore


class UpkeepStore(JobStore, FleetStore, Protocol):
    """What upkeep sweeps: leases lost, and workers gone silent."""


class Upkeep:
    """The sweep, and a worker's leases given up; one per server process."""

    def __init__(
        self,
        store: UpkeepStore,
        fleet: Fleet,
        leases: Leases,
        notices: Notices,
        clock: Callable[[], float],
        on_event: OnEvent,
    ) -> None:
        self.store = store
        self.fleet = fleet
        self.leases = leases
        self.notices = notices
        self.clock = clock
        self.on_event = on_event

    def sweep(self) -> tuple[list[str], list[str]]:
        """Expire leases of silent workers, mark those workers offline, forget ephemeral
        workers gone for longer than their TTL. Returns (requeued jobs, offline workers)."""
        return self.lose_lapsed_leases(), self.recount_and_mark_offline()

    def lose_lapsed_leases(self) -> list[str]:
        """Requeue (or fail) the jobs whose lease has lapsed; their ids. Safe to run on
        several servers at once: each requeue is a conditional update of one lease."""
        now = self.clock()
        expired = self.store.lost_leases(now)
        names = {w.id: w.name for w in self.store.list_workers()} if expired else {}
        requeued: list[str] = []
        for job in expired:
            who = names.get(job.worker_id or "", job.worker_id)
            if self.leases.lose(job, now, who or "?", restarted=False):
                requeued.append(job.id)
        if requeued:
            self.notices.changed()
        return requeued

    def recount_and_mark_offline(self) -> list[str]:
        """Recount dependencies another replica met, fold the job count changes in (on
        PostgreSQL), mark silent workers offline and forget ephemeral ones gone past
        their TTL; the ids that went offline."""
        self.store.fold_job_counts()
        if self.store.refresh_waiting():
            self.notices.changed()
        return self.fleet.sweep()

    def settle(self, worker_id: str, name: str, running: Sequence[tuple[str, int]]) -> list[str]:
        """A worker registers again and runs only ``running``: the leases it held besides
        (a worker killed and started again lost its jobs with it) are lost now, not at
        their expiry. The requeued (or failed) job ids."""
        still = set(running)
        now = self.clock()
        lost = [
            job.id
            for job in self.store.active_jobs(worker_id)
            if (job.id, job.lease) not in still and self.leases.lose(job, now, name, restarted=True)
        ]
        if lost:
            self.notices.changed()
        return lost

    def leave(self, worker_id: str, reason: str) -> None:
        """A worker stops: it is offline now, and a job it still held goes back to the
        queue without counting the attempt (it should have handed it back)."""
        w = self.fleet.worker(worker_id)
        returned = [j for j in self.store.active_jobs(w.id) if self.leases.hand_back(j)]
        self.fleet.leave(w, reason)
        if returned:
            self.notices.changed()

    def retire(self, token_id: str) -> list[str]:
        """A revoked token's workers go offline and their jobs back to the queue (the
        attempt is not counted: the job did not fail). Returns the requeued job ids."""
        requeued = []
        now = self.clock()
        for w in self.store.list_workers():
            if w.token_id != token_id:
                continue
            for job in self.store.active_jobs(w.id):
                if self.leases.hand_back(job):
                    requeued.append(job.id)
            if w.status != WorkerStatus.OFFLINE:
                self.on_event("worker.offline", w.id, f"{w.name}: its token was revoked", None)
            self.store.change_worker(worker_lifecycle.revoke(w.id, now))
            self.fleet.forget(w.id)
        if requeued:
            self.notices.changed()
        return requeued
