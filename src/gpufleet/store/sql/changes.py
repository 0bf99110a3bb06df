"""Status changes: each one decided in :mod:`gpufleet.domain.lifecycle`, applied here as
one conditional update on (status, lease), with every consequence in the same
transaction.

A mixin of :class:`~gpufleet.store.sql.store.SqlStore`. The store decides no status: a
:class:`~gpufleet.domain.lifecycle.Change` names the statuses and lease it may come from,
the status it goes to and the fields it sets. What follows from a job ending is part of
the same transaction: the jobs waiting on a job that succeeded are recounted (and become
claimable), and the jobs waiting on one that failed or was cancelled fail too, walked
down the chain iteratively, each naming its dependency's final status.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from functools import cache
from typing import Any

from sqlalchemy import Connection, bindparam, literal_column, or_, select, update

from gpufleet.domain import lifecycle
from gpufleet.domain.lifecycle import Change, Event
from gpufleet.domain.models import JobStatus
from gpufleet.store import schema as t
from gpufleet.store.api import Applied
from gpufleet.store.changes import FAILS_DEPENDENTS, NamedChanges, encode
from gpufleet.store.rows_read import JobRow
from gpufleet.store.rows_written import state_rows
from gpufleet.store.sql.usage import UsageOps

_J, _A, _D = t.jobs.c, t.attempts.c, t.job_deps.c
_OPEN_ATTEMPT = t.attempts.insert()  # built once: its cache key is then computed once
_EVENT = t.job_logs.insert()


@cache
def _statement(
    event: Event, keys: tuple[str, ...], expired: bool, guard: tuple[str, ...] = ()
) -> Any:
    """The conditional update of a change of this shape, built once."""
    where = (
        (_J.id == bindparam("_id"))
        & (_J.lease == bindparam("_lease"))
        & or_(
            *(_J.status == literal_column(f"'{s.value}'") for s in sorted(lifecycle.sources(event)))
        )
    )
    if expired:
        where = where & (_J.lease_expires_at < bindparam("_lost_before"))
    for key in guard:
        where = where & (t.jobs.c[key] == bindparam(f"_guard_{key}"))
    values: dict[str, Any] = {
        "status": lifecycle.target(event).value,
        **{k: bindparam(k) for k in keys},
    }
    return update(t.jobs).where(where).values(values)


@cache
def _record_statement(keys: tuple[str, ...]) -> Any:
    """The update of an attempt record still open, built once per shape."""
    where = (
        (_A.job_id == bindparam("_id"))
        & (_A.attempt == bindparam("_attempt"))
        & _A.finished_at.is_(None)
    )
    return update(t.attempts).where(where).values({k: bindparam(k) for k in keys})


class ChangeOps(NamedChanges, UsageOps):
    """Applies the lifecycle's changes: claim, start, finish, release, lose, cancel,
    requeue, and the dependency failures they cause."""

    @abstractmethod
    def recount_waiting(self, conn: Connection, job_ids: Sequence[str] | None) -> int:
        """Recount the unmet dependencies of these pending jobs; how many changed."""

    # ---- how -------------------------------------------------------------------------

    def _commit(self, change: Change) -> Applied | None:
        with self._write() as conn:
            if not self.apply_change(conn, change):
                return None
            return self.after(conn, change)

    def apply_change(self, conn: Connection, change: Change) -> bool:
        """Apply ``change`` if the job is still where it expects; whether it was."""
        keys = tuple(sorted(change.fields))
        guard = tuple(sorted(change.guard))
        stmt = _statement(change.event, keys, change.lost_before is not None, guard)
        params = {
            **encode(change.fields),
            **{f"_guard_{k}": change.guard[k] for k in guard},
            "_id": change.job_id,
            "_lease": change.lease,
            "_lost_before": change.lost_before,
        }
        if conn.execute(stmt, params).rowcount != 1:
            return False
        if change.opens is not None:
            values: dict[str, object] = {
                "job_id": change.job_id,
                "attempt": change.attempt,
                **change.opens,
            }
            conn.execute(_OPEN_ATTEMPT, encode(values))
        if change.record:
            self._charge(conn, change)
            rkeys = tuple(sorted(change.record))
            where = {"_id": change.job_id, "_attempt": change.attempt}
            conn.execute(_record_statement(rkeys), {**encode(change.record), **where})
        # In the transaction that holds the job's row: its events are numbered in order.
        conn.execute(_EVENT, state_rows([change]))
        return True

    def after(self, conn: Connection, change: Change) -> Applied:
        """What follows from ``change`` (applied in ``conn``): dependents released by a
        success or a requeue, or failed down the chain by a failure or a cancel."""
        job = _row(conn, change.job_id)
        status = change.status
        if status == JobStatus.SUCCEEDED:
            return Applied(job, released=self.recount_waiting(conn, _dependents(conn, job.id)))
        if status in FAILS_DEPENDENTS:
            return Applied(job, failed=self.fail_dependents(conn, job, job.finished_at or 0.0))
        if change.event == Event.REQUEUE:
            self.recount_waiting(conn, [job.id])
        return Applied(job)

    def fail_dependents(self, conn: Connection, job: JobRow, now: float) -> list[str]:
        """Fail every pending job that waits on ``job`` (failed or cancelled), and those
        waiting on them: the pending jobs below it are read in one recursive query and
        walked breadth first (no recursion in Python, a chain of any length), and each
        fails naming the dependency that failed it, with that one's final status.
        Returns the ids failed, nearest first."""
        below: dict[str, list[JobRow]] = {}
        for dep_id, waiting in _pending_below(conn, job.id):
            below.setdefault(dep_id, []).append(waiting)
        changes = lifecycle.dependents_failed(job, below, now)
        if not self._apply_all(conn, changes):
            return [c.job_id for c in changes if self.apply_change(conn, c)]
        return [c.job_id for c in changes]

    def _apply_all(self, conn: Connection, changes: list[Change]) -> bool:
        """Apply changes of one shape in one batch; False (nothing applied) unless every
        one took, as when a job below was changed meanwhile."""
        if not changes:
            return True
        first = changes[0]
        stmt = _statement(first.event, tuple(sorted(first.fields)), False)
        rows = [{**encode(c.fields), "_id": c.job_id, "_lease": c.lease} for c in changes]
        with conn.begin_nested() as nested:
            if conn.execute(stmt, rows).rowcount == len(rows):
                conn.execute(_EVENT, state_rows(changes))
                return True
            nested.rollback()
        return False

    def fail_on_failed_deps(self, conn: Connection, job_ids: Sequence[str], now: float) -> None:
        """Jobs just inserted that need a job which already failed or was cancelled fail
        at once (and the jobs of the same batch waiting on them). One query finds them."""
        dep = t.jobs.alias("dep")
        q = (
            select(_D.job_id, dep)
            .join(dep, dep.c.id == _D.dep_id)
            .where(
                _D.job_id.in_(list(job_ids)),
                dep.c.status.in_(sorted(s.value for s in FAILS_DEPENDENTS)),
            )
            .order_by(_D.job_id, dep.c.id)
        )
        failed_deps: dict[str, JobRow] = {}
        for r in conn.execute(q).all():
            m = dict(r._mapping)
            failed_deps.setdefault(str(m.pop("job_id")), JobRow.from_mapping(m))
        for job_id, failed in failed_deps.items():
            job = _row(conn, job_id)
            if job.status != JobStatus.PENDING:
                continue  # failed already, below an earlier one of the batch
            if self.apply_change(conn, lifecycle.dependency_failed(job, failed, now)):
                self.fail_dependents(conn, _row(conn, job_id), now)


_ROW = select(t.jobs).where(_J.id == bindparam("id"))
_DEPENDENTS = select(_D.job_id).where(_D.dep_id == bindparam("id"))


def _row(conn: Connection, job_id: str) -> JobRow:
    return JobRow.from_row(conn.execute(_ROW, {"id": job_id}).one())


def _dependents(conn: Connection, dep_id: str) -> list[str]:
    return [str(i) for i in conn.scalars(_DEPENDENTS, {"id": dep_id})]


def _pending_below(conn: Connection, job_id: str) -> list[tuple[str, JobRow]]:
    """(dependency id, pending job waiting on it) for every pending job below ``job_id``
    in the dependency graph, in one recursive query."""
    base = select(_D.job_id, _D.dep_id).where(_D.dep_id == job_id)
    down = base.cte("down", recursive=True)
    step = (
        select(_D.job_id, _D.dep_id)
        .join(down, _D.dep_id == down.c.job_id)
        .join(t.jobs, _J.id == down.c.job_id)
        .where(_J.status == JobStatus.PENDING.value)
    )
    down = down.union(step)
    q = (
        select(down.c.dep_id, t.jobs)
        .join(t.jobs, _J.id == down.c.job_id)
        .where(_J.status == JobStatus.PENDING.value)
        .order_by(_J.id, down.c.dep_id)
    )
    out = []
    for r in conn.execute(q).all():
        m = dict(r._mapping)
        dep_id = m.pop("dep_id")
        out.append((str(dep_id), JobRow.from_mapping(m)))
    return out
