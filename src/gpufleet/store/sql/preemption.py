"""Preemption: the waiting jobs that may preempt, a running job marked to make way for
one (once, by a conditional update, so servers sharing a database may each look), and
the leases a heartbeat is told to vacate.

A mixin of :class:`~gpufleet.store.sql.store.SqlStore`. Marking holds both jobs' rows
(in id order, as :meth:`transaction` does) before it looks: two servers choosing a victim
for one waiting job at once mark one, and the second finds it making way.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import func, select, update

from gpufleet.domain.models import ACTIVE, JobStatus
from gpufleet.store import schema as t
from gpufleet.store.api import Preempt
from gpufleet.store.rows_read import JobRow
from gpufleet.store.rows_written import preempt_events
from gpufleet.store.sql.base import SqlParts

_J = t.jobs.c
_ACTIVE = [s.value for s in ACTIVE]
_PENDING, _RUNNING = JobStatus.PENDING.value, JobStatus.RUNNING.value


class PreemptionOps(SqlParts):
    """The waiting jobs that may preempt, a victim marked, the leases to vacate."""

    def preemptors(self, pool: str, min_priority: int, since: float, limit: int) -> list[JobRow]:
        q = (
            select(t.jobs)
            .where(
                (_J.status == _PENDING)
                & (_J.pool == pool)
                & (_J.priority >= min_priority)
                & (_J.waiting == 0)
                & (func.coalesce(_J.not_before, _J.created_at) <= since)
            )
            .order_by(_J.priority.desc(), _J.created_at, _J.id)
            .limit(limit)
        )
        with self._read() as conn:
            return [JobRow.from_row(r) for r in conn.execute(q).all()]

    def request_preempt(self, ask: Preempt, now: float) -> bool:
        with self._write() as conn:
            both = select(_J.id).where(_J.id.in_([ask.victim, ask.by])).order_by(_J.id)
            self._lock_rows(conn, both)
            waiting = conn.execute(
                select(_J.lease).where((_J.id == ask.by) & (_J.status == _PENDING))
            ).first()
            making_way = select(_J.id).where(
                (_J.preempted_by == ask.by)
                & _J.preempt_requested_at.is_not(None)
                & _J.status.in_(_ACTIVE)
            )
            if waiting is None or conn.execute(making_way.limit(1)).first() is not None:
                return False
            where = (
                (_J.id == ask.victim)
                & (_J.lease == ask.lease)
                & (_J.status == _RUNNING)
                & _J.preempt_requested_at.is_(None)
                & _J.pause_requested_at.is_(None)
                & _J.stop_requested_at.is_(None)
            )
            marked = update(t.jobs).where(where)
            values = {"preempt_requested_at": now, "preempted_at": now, "preempted_by": ask.by}
            if conn.execute(marked.values(values)).rowcount != 1:
                return False
            if ask.worker is not None:  # its slot, freed, goes to the waiting job first
                hold = {"made_way_on": ask.worker, "made_way_until": ask.until}
                conn.execute(update(t.jobs).where(_J.id == ask.by).values(hold))
            rows = preempt_events(
                ask.victim, ask.lease, ask.by, waiting.lease, ask.why, ask.said, now
            )
            conn.execute(t.job_logs.insert(), rows)
            return True

    def preempted_for(self, job_id: str, limit: int) -> list[JobRow]:
        q = (
            select(t.jobs)
            .where(_J.preempted_by == job_id)
            .order_by(_J.preempted_at.desc(), _J.id)
            .limit(limit)
        )
        with self._read() as conn:
            return [JobRow.from_row(r) for r in conn.execute(q).all()]

    def preempting(self, leases: Iterable[tuple[str, int]]) -> set[str]:
        ids = [job_id for job_id, _ in leases]
        if not ids:
            return set()
        q = select(_J.id).where(_J.id.in_(ids) & _J.preempt_requested_at.is_not(None))
        with self._read() as conn:
            return {str(i) for i in conn.scalars(q)}
