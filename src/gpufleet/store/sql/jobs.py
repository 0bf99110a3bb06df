"""Jobs: a submit or a manifest apply written in one transaction (new jobs, their
dependencies, grants, hosts, pending jobs changed), and what clients and the scheduler read
of jobs: one job, pages, counts, the queue ahead of one, the gauges.

A mixin of :class:`~gpufleet.store.sql.store.SqlStore` (:class:`~.base.SqlParts`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar

from sqlalchemy import Connection, bindparam, func, select, union_all, update

from gpufleet.domain.models import ACTIVE, JobSpec, JobStatus
from gpufleet.store import schema as t
from gpufleet.store.api import Batch, QueueGauges, Submitted
from gpufleet.store.json_columns import spec_json
from gpufleet.store.rows_read import JobRow, WorkerRow
from gpufleet.store.rows_written import (
    job_values,
    submit_events,
)
from gpufleet.store.sql.base import SqlParts
from gpufleet.store.sql.fleet import write_hosts

_J = t.jobs.c
_C, _CD = t.job_counts.c, t.job_count_deltas.c
_BOTH = union_all(select(_C.pool, _C.status, _C.n), select(_CD.pool, _CD.status, _CD.n)).subquery()
_COUNTS = select(_BOTH.c.pool, _BOTH.c.status, func.sum(_BOTH.c.n)).group_by(
    _BOTH.c.pool, _BOTH.c.status
)
_JOB = select(t.jobs).where(_J.id == bindparam("id"))
# The pending jobs aimed at a worker: each backend reads them through the small partial
# index of aimed jobs in its own way (never by walking the pending queue in claim order).
AIMED_WHERE = f"target IS NOT NULL AND status = '{JobStatus.PENDING.value}'"
JOB_COLUMNS = ", ".join(c.name for c in t.jobs.c)  # named: a column added later is not read
# Only a job still pending with the spec we compared against is changed.
_PENDING_UPDATE = (
    update(t.jobs)
    .where(
        (_J.id == bindparam("jid"))
        & (_J.status == JobStatus.PENDING.value)
        & (_J.spec == bindparam("old"))
    )
    .values(
        spec=bindparam("spec"),
        priority=bindparam("priority"),
        max_attempts=bindparam("max_attempts"),
        pool=bindparam("pool"),
        unrunnable=bindparam("unrunnable"),
        target=bindparam("target"),
    )
)


class JobOps(SqlParts):
    """Submitting, and reading jobs."""

    #: The pending jobs aimed at a worker, in claim order (:data:`JOB_COLUMNS`).
    aimed_jobs_sql: ClassVar[str]

    @abstractmethod
    def _grant(self, conn: Connection, grants: Iterable[tuple[str, str]]) -> None:
        """Let these (blob, pool) pairs be read (:mod:`.data`)."""

    @abstractmethod
    def insert_deps(self, conn: Connection, deps: Mapping[str, Sequence[str]]) -> None:
        """Record the jobs each new job waits for (:mod:`.data`)."""

    @abstractmethod
    def recount_waiting(self, conn: Connection, job_ids: Sequence[str] | None) -> int:
        """Count again what these jobs wait for (:mod:`.data`)."""

    @abstractmethod
    def fail_on_failed_deps(self, conn: Connection, job_ids: Sequence[str], now: float) -> None:
        """Fail those of these jobs whose dependency failed already (:mod:`.changes`)."""

    def hold_worker(self, worker: WorkerRow) -> list[JobRow]:
        with self._write() as conn:
            self._lock_worker(conn, worker.id)
            # a claim ranked before this call was made ranks again
            w = t.workers.c
            conn.execute(update(t.workers).where(w.id == worker.id).values(claims=w.claims + 1))
            return self._holding(conn, worker)

    def submit(self, batch: Batch, now: float) -> Submitted:
        """Write a submit or a manifest apply in one transaction (see :class:`Batch`).
        A new job's dependencies are counted in it, so it is never claimable before they
        are met, and a dependency that failed already fails it at once."""
        with self._write() as conn:
            self._grant(conn, batch.grants)
            if batch.hosts is not None:
                write_hosts(conn, batch.hosts, now, self._insert(t.hosts))
            created = self._insert_new(conn, batch, now)
            fresh = set(created)
            updated = (
                self._update_pending(conn, [j for j in batch.jobs if j[0] not in fresh])
                if batch.update
                else []
            )
        return Submitted(created, updated)

    def _insert_new(self, conn: Connection, batch: Batch, now: float) -> list[str]:
        """Insert the batch's jobs whose id is new, with their dependencies; their ids."""
        ids = [j[0] for j in batch.jobs]
        needed = sorted({d for ds in batch.deps.values() for d in ds})
        if needed:
            # A dependency finishing meanwhile waits for this insert (or this one for
            # it), so one of the two sees the other: no new job waits on a failed one.
            self._lock_rows(conn, select(t.jobs.c.id).where(t.jobs.c.id.in_(needed)), read=True)
        have: set[str] = set()
        for chunk in range(0, len(ids), 500):
            q = select(t.jobs.c.id).where(t.jobs.c.id.in_(ids[chunk : chunk + 500]))
            have.update(conn.scalars(q))
        fresh = [
            job_values(i, s, now, u, batch.submitted_by, batch.by)
            for i, s, u in batch.jobs
            if i not in have
        ]
        if not fresh:
            return []
        # A concurrent apply may have inserted some meanwhile: those are skipped, and
        # RETURNING names only the rows this call created.
        stmt = self._insert(t.jobs).on_conflict_do_nothing().returning(t.jobs.c.id)
        inserted = set(conn.execute(stmt, fresh).scalars())
        if inserted:
            conn.execute(t.job_logs.insert(), submit_events(sorted(inserted), batch.by, now))
        mine = {i: d for i, d in batch.deps.items() if i in inserted and d}
        if mine:
            self.insert_deps(conn, mine)
            self.recount_waiting(conn, list(mine))
            self.fail_on_failed_deps(conn, list(mine), now)
        return [v["id"] for v in fresh if v["id"] in inserted]

    def _update_pending(
        self, conn: Connection, jobs: Sequence[tuple[str, JobSpec, str | None]]
    ) -> list[str]:
        """Give pending jobs a new spec (same identity, new priority, requirements or
        limits) and its unrunnable verdict; jobs already claimed or finished keep theirs.
        The specs are compared without locks; on PostgreSQL only the jobs whose spec
        differs are then read again locked, in id order across the whole batch, so no
        claim comes between and two applies wait for each other instead of deadlocking.
        (SQLite's one writer holds them all already.)"""
        wanted = {job_id: (spec_json(spec), spec, why) for job_id, spec, why in jobs}
        current = self._pending_specs(conn, sorted(wanted), lock=False)
        differ = sorted(i for i, old in current.items() if old != wanted[i][0])
        if not differ:
            return []
        current = self._pending_specs(conn, differ, lock=True)
        rows = [
            {
                "jid": i,
                "old": current[i],
                "spec": wanted[i][0],
                "priority": wanted[i][1].priority,
                "max_attempts": wanted[i][1].max_attempts,
                "pool": wanted[i][1].pool,
                "unrunnable": wanted[i][2],
                "target": wanted[i][1].requirements.worker,
            }
            for i in differ
            if i in current and current[i] != wanted[i][0]
        ]
        if rows:
            conn.execute(_PENDING_UPDATE, rows)
        return [str(r["jid"]) for r in rows]

    def _pending_specs(self, conn: Connection, ids: list[str], *, lock: bool) -> dict[str, str]:
        """The specs of those of ``ids`` (sorted) still pending; ``lock``: row-locked, in
        id order, where the backend has row locks (:meth:`_lock_rows`)."""
        j = t.jobs.c
        found: dict[str, str] = {}
        for at in range(0, len(ids), 500):
            q = select(j.id, j.spec).where(
                j.id.in_(ids[at : at + 500]), j.status == JobStatus.PENDING.value
            )
            if lock:
                self._lock_rows(conn, q.order_by(j.id))
            found.update({i: sp for i, sp in conn.execute(q).all()})
        return found

    def _lock_worker(self, conn: Connection, worker_id: str) -> None:
        """Serialize this transaction with others about the same worker (PostgreSQL; on
        SQLite the one writer already does)."""
        w = t.workers.c
        self._lock_rows(conn, select(w.id).where(w.id == worker_id))

    def _holding(self, conn: Connection, worker: WorkerRow) -> list[JobRow]:
        """The jobs ``worker`` runs or has claimed, and the pending ones aimed at it, the
        pending ones in the order they would be claimed."""
        j = t.jobs.c
        runs = (j.worker_id == worker.id) & j.status.in_([s.value for s in ACTIVE])
        aimed = j.target.in_([worker.id, worker.name]) & (j.status == JobStatus.PENDING.value)
        q = select(t.jobs).where(runs | aimed).order_by(j.priority.desc(), j.created_at, j.id)
        return [JobRow.from_row(r) for r in conn.execute(q).all()]

    def holding(self, worker: WorkerRow) -> list[JobRow]:
        """What a submit aimed at ``worker`` is checked against (outside a write)."""
        with self._read() as conn:
            return self._holding(conn, worker)

    def aimed_jobs(self) -> list[JobRow]:
        """Pending jobs aimed at a worker, in the order they would be claimed."""
        with self._read() as conn:
            rows = conn.exec_driver_sql(self.aimed_jobs_sql).all()
        return [JobRow.from_row(r) for r in rows]

    def manifest_jobs(
        self, manifest: str, pools: Sequence[str] | None = None
    ) -> list[tuple[str, str]]:
        """Every job of ``manifest`` (of ``pools``; None: every pool): (id, status)."""
        j = t.jobs.c
        q = select(j.id, j.status).where(j.manifest == manifest).order_by(j.created_at, j.id)
        if pools is not None:
            q = q.where(j.pool.in_(pools))
        with self._read() as conn:
            return [(str(i), str(st)) for i, st in conn.execute(q).all()]

    def pools_of(self, job_ids: Sequence[str]) -> dict[str, str]:
        """The pool of each of these jobs that exists: id -> pool."""
        j = t.jobs.c
        found: dict[str, str] = {}
        with self._read() as conn:
            for at in range(0, len(job_ids), 500):
                q = select(j.id, j.pool).where(j.id.in_(job_ids[at : at + 500]))
                found.update({str(i): str(p) for i, p in conn.execute(q).all()})
        return found

    def get_job(self, job_id: str) -> JobRow | None:
        with self._read() as conn:
            row = conn.execute(_JOB, {"id": job_id}).first()
        return JobRow.from_row(row) if row else None

    def find_jobs_by_name(
        self, name: str, limit: int = 2, pools: Sequence[str] | None = None
    ) -> list[JobRow]:
        """The newest ``limit`` jobs named ``name`` (of ``pools``; None: every pool)."""
        q = select(t.jobs).where(t.jobs.c.name == name)
        if pools is not None:
            q = q.where(t.jobs.c.pool.in_(pools))
        with self._read() as conn:
            rows = conn.execute(q.order_by(t.jobs.c.created_at.desc()).limit(limit)).all()
        return [JobRow.from_row(r) for r in rows]

    def list_jobs(
        self,
        statuses: Iterable[str] = (),
        limit: int = 1000,
        pools: Sequence[str] | None = None,
        name: str | None = None,
        before: tuple[float, str] | None = None,
    ) -> list[JobRow]:
        """The newest ``limit`` jobs (of ``pools``; None: every pool), oldest first; with
        ``name``, those whose name holds it (any case); with ``before`` (a job's creation
        time and id), those created before that job: the next page back."""
        j = t.jobs.c
        q = select(t.jobs).order_by(j.created_at.desc(), j.id.desc()).limit(limit)
        statuses = list(statuses)
        if statuses:
            q = q.where(j.status.in_(statuses))
        if pools is not None:
            q = q.where(j.pool.in_(pools))
        if name:
            q = q.where(func.lower(j.name).contains(name.lower(), autoescape=True))
        if before is not None:
            at, job_id = before
            q = q.where((j.created_at < at) | ((j.created_at == at) & (j.id < job_id)))
        with self._read() as conn:
            return [JobRow.from_row(r) for r in reversed(conn.execute(q).all())]

    def job_counts(
        self, pools: Sequence[str] | None = None, name: str | None = None
    ) -> dict[str, int]:
        """Jobs of ``pools`` (None: all) by status; with ``name``, of the jobs whose name
        holds it (counted from the jobs: a search). Statuses with no job are left out."""
        if not name:
            counts: dict[str, int] = {}
            for (status, pool), n in self._counts().items():
                if pools is None or pool in pools:
                    counts[status] = counts.get(status, 0) + n
            return counts
        q = select(t.jobs.c.status, func.count()).group_by(t.jobs.c.status)
        if pools is not None:
            q = q.where(t.jobs.c.pool.in_(pools))
        q = q.where(func.lower(t.jobs.c.name).contains(name.lower(), autoescape=True))
        with self._read() as conn:
            return {s: int(n) for s, n in conn.execute(q).all()}

    def _counts(self) -> dict[tuple[str, str], int]:
        """Jobs by (status, pool), from the counts the triggers keep: the same cost for
        any number of jobs (the deltas not folded in yet are a few seconds' changes)."""
        with self._read() as conn:
            rows = conn.execute(_COUNTS).all()
        counts: dict[tuple[str, str], int] = {}
        for pool, status, n in rows:
            counts[(status, pool)] = counts.get((status, pool), 0) + int(n)
        return {key: n for key, n in counts.items() if n > 0}

    def queue_ahead(self, job: JobRow, limit: int) -> list[JobRow]:
        """Pending jobs of ``job``'s pool ranked before it (priority, then age, then id),
        best first; at most ``limit``."""
        j = t.jobs.c
        before = (j.priority > job.priority) | (
            (j.priority == job.priority)
            & (
                (j.created_at < job.created_at)
                | ((j.created_at == job.created_at) & (j.id < job.id))
            )
        )
        q = (
            select(t.jobs)
            .where(j.status == JobStatus.PENDING.value, j.pool == job.pool, before)
            .order_by(j.priority.desc(), j.created_at, j.id)
            .limit(limit)
        )
        with self._read() as conn:
            return [JobRow.from_row(r) for r in conn.execute(q).all()]

    def queue_gauges(self) -> QueueGauges:
        """What /metrics reads of the queue: jobs by status and pool, each pool's oldest
        pending job, and the bytes kept as artifacts and as other blobs (packages)."""
        j, a, b = t.jobs.c, t.artifacts.c, t.blobs.c
        oldest = (
            select(j.pool, func.min(j.created_at))
            .where(j.status == JobStatus.PENDING.value)
            .group_by(j.pool)
        )
        artifact_shas = select(a.sha256).distinct()
        artifact_bytes = select(func.coalesce(func.sum(b.size), 0)).where(
            b.sha256.in_(artifact_shas)
        )
        package_bytes = select(func.coalesce(func.sum(b.size), 0)).where(
            b.sha256.not_in(artifact_shas)
        )
        with self._read() as conn:
            return QueueGauges(
                jobs=self._counts(),
                oldest_pending={p: float(c) for p, c in conn.execute(oldest).all()},
                artifact_bytes=int(conn.execute(artifact_bytes).scalar() or 0),
                package_bytes=int(conn.execute(package_bytes).scalar() or 0),
            )
