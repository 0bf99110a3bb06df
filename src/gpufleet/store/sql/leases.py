"""Leases: what a lease-carrying write needs besides a status change (extending
leases, a stop asked for, an attempt's history and a result that came late), and the
leases the sweep finds lost.

A mixin of :class:`~gpufleet.store.sql.store.SqlStore` (:class:`~.base.SqlParts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import select, update

from gpufleet.domain.models import ACTIVE, JobStatus
from gpufleet.store import schema as t
from gpufleet.store.rows_read import AttemptRow, JobRow
from gpufleet.store.rows_written import (
    pause_event,
    stop_event,
)
from gpufleet.store.sql.base import SqlParts


def lease_where(job_id: str, lease: int, statuses: Iterable[JobStatus]) -> Any:
    """The job's row, if ``lease`` holds it in one of ``statuses``."""
    j = t.jobs.c
    return (j.id == job_id) & (j.lease == lease) & j.status.in_([s.value for s in statuses])


class LeaseOps(SqlParts):
    """Leases and attempts."""

    def extend_leases(
        self,
        leases: Iterable[tuple[str, int]],
        expires: float,
        worker_id: str,
        gpu_mib: Mapping[tuple[str, int], int] | None = None,
    ) -> set[tuple[str, int]]:
        """Push back the expiry of every valid lease ``worker_id`` holds (and record the
        GPU memory each job's processes use, where given); returns those leases."""
        held: set[tuple[str, int]] = set()
        leases = list(leases)
        if not leases:  # an idle worker's heartbeat: no transaction
            return held
        used = gpu_mib or {}
        with self._write() as conn:
            for job_id, lease in sorted(leases):  # rows locked in id order, as by `transaction`
                where = lease_where(job_id, lease, ACTIVE) & (t.jobs.c.worker_id == worker_id)
                values: dict[str, Any] = {"lease_expires_at": expires}
                if (job_id, lease) in used:
                    values["gpu_mib"] = used[(job_id, lease)]
                if conn.execute(update(t.jobs).where(where).values(values)).rowcount == 1:
                    held.add((job_id, lease))
        return held

    def lost_leases(self, now: float) -> list[JobRow]:
        j = t.jobs.c
        q = select(t.jobs).where(j.status.in_([s.value for s in ACTIVE]), j.lease_expires_at < now)
        with self._read() as conn:
            return [JobRow.from_row(r) for r in conn.execute(q).all()]

    def request_stop(self, job_id: str, now: float, grace: float, by: str | None = None) -> bool:
        """Mark a claimed or running job as asked to stop (once), and say so in its log."""
        j = t.jobs.c
        where = (
            (j.id == job_id)
            & j.status.in_([s.value for s in ACTIVE])
            & j.stop_requested_at.is_(None)
        )
        with self._write() as conn:
            done = conn.execute(
                update(t.jobs)
                .where(where)
                .values(stop_requested_at=now, stop_grace=grace)
                .returning(j.status, j.lease)
            ).first()
            if done is None:
                return False
            event = stop_event(job_id, done.status, done.lease, by, grace, now)
            conn.execute(t.job_logs.insert(), event)
            return True

    def request_pause(self, job_id: str, now: float, by: str | None = None) -> bool:
        """Mark a claimed or running job as asked to pause (once), and say so in its log:
        its worker vacates it, and it is held once it has."""
        j = t.jobs.c
        where = (
            (j.id == job_id)
            & j.status.in_([s.value for s in ACTIVE])
            & j.pause_requested_at.is_(None)
        )
        with self._write() as conn:
            done = conn.execute(
                update(t.jobs).where(where).values(pause_requested_at=now).returning(j.lease)
            ).first()
            if done is None:
                return False
            conn.execute(t.job_logs.insert(), pause_event(job_id, done.lease, by, now))
            return True

    def pausing(self, leases: Iterable[tuple[str, int]]) -> set[str]:
        """Of these leases, the jobs asked to pause."""
        ids = [job_id for job_id, _ in leases]
        if not ids:
            return set()
        j = t.jobs.c
        q = select(j.id).where(j.id.in_(ids) & j.pause_requested_at.is_not(None))
        with self._read() as conn:
            return {str(i) for i in conn.scalars(q)}

    def stops(self, leases: Iterable[tuple[str, int]]) -> dict[str, float]:
        """Of these leases, the jobs asked to stop: job id -> grace seconds."""
        ids = [job_id for job_id, _ in leases]
        if not ids:
            return {}
        j = t.jobs.c
        q = select(j.id, j.stop_grace).where(j.id.in_(ids) & j.stop_requested_at.is_not(None))
        with self._read() as conn:
            return {str(i): float(g or 0.0) for i, g in conn.execute(q).all()}

    def attempts(self, job_id: str) -> list[AttemptRow]:
        a = t.attempts.c
        with self._read() as conn:
            rows = conn.execute(
                select(t.attempts).where(a.job_id == job_id).order_by(a.attempt)
            ).all()
        return [AttemptRow.from_row(r) for r in rows]

    def late_result(self, job_id: str, attempt: int, text: str) -> None:
        """Keep, in the attempt's history, a result its worker sent after it had ended (the
        first one sent; a retry of it changes nothing)."""
        a = t.attempts.c
        first = (a.job_id == job_id) & (a.attempt == attempt) & a.late_result.is_(None)
        with self._write() as conn:
            conn.execute(update(t.attempts).where(first), {"late_result": text})

    def active_jobs(self, worker_id: str | None = None) -> list[JobRow]:
        j = t.jobs.c
        q = select(t.jobs).where(j.status.in_([s.value for s in ACTIVE]))
        if worker_id is not None:
            q = q.where(j.worker_id == worker_id)
        with self._read() as conn:
            return [JobRow.from_row(r) for r in conn.execute(q).all()]
