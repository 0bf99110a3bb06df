"""The SQL store: queue operations over SQLAlchemy Core, the part SQLite and PostgreSQL
share. Each backend (:mod:`gpufleet.store.sqlite`, :mod:`gpufleet.store.postgres`)
subclasses :class:`SqlStore` with what it does its own way: its engine, its INSERT, row
locks, its own SQL where a query differs, and what it offers beyond the contract. Nothing
here asks which backend it is.

Every write for a running job is a conditional update on (job id, lease, status), so a
stale lease changes nothing and the caller answers 409.
"""

from __future__ import annotations

import copy
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    bindparam,
    func,
    select,
    union_all,
    update,
)

from gpufleet.domain.models import ACTIVE, TERMINAL, JobSpec, JobStatus
from gpufleet.domain.quota import OutputQuota
from gpufleet.store import schema as t
from gpufleet.store._changes import ChangeOps
from gpufleet.store._claims import ClaimOps, ClaimSession, page_statements
from gpufleet.store._data import DataOps
from gpufleet.store._environments import EnvironmentOps
from gpufleet.store._fleet import FleetOps, write_hosts
from gpufleet.store._pages import read_page
from gpufleet.store._values import (
    account_columns,
    cut_event,
    job_values,
    metered,
    progress_columns,
    stop_event,
    submit_events,
)
from gpufleet.store.api import Appended, Batch, Offers, QueueGauges, Submitted
from gpufleet.store.rows import AttemptRow, JobRow, LogRow, WorkerRow, log_offsets
from gpufleet.store.space import SpaceWatch, watch_engine
from gpufleet.store.stored import spec_json
from gpufleet.store.unit import UnitOfWork

_MIGRATIONS = Path(__file__).with_name("migrations")
POOL_SIZE = 40  # the server's worker threads (anyio's default limiter)
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


def normalize_url(url: str) -> str:
    """``postgresql://`` means psycopg 3; a bare path means a SQLite file."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    if "://" not in url:
        return f"sqlite:///{Path(url).expanduser().resolve()}"
    return url


class SqlStore(DataOps, ChangeOps, ClaimOps, FleetOps, EnvironmentOps):
    """Queue operations; policy (what a state change *is*) lives above, in the service."""

    #: The backend's name, for the server's log; never asked by code outside it.
    dialect: ClassVar[str]
    #: SQLite's one writer: writes take it, so they queue here rather than spin on
    #: ``SQLITE_BUSY`` (None: the database orders its writers itself).
    _lock: threading.Lock | None = None
    #: The pending jobs aimed at a worker, in claim order (:data:`JOB_COLUMNS`).
    aimed_jobs_sql: ClassVar[str]

    def __init__(self, url: str) -> None:
        self.url = normalize_url(url)
        self.engine: Engine = self._make_engine(self.url)
        self.space = SpaceWatch()
        watch_engine(self.engine, self.space)
        self.page_q = page_statements()
        #: The transaction this store is bound to (:meth:`transaction` gives a copy bound
        #: to its own); None: each call opens its own.
        self._conn: Connection | None = None

    # ---- what each backend does its own way ------------------------------------------

    @abstractmethod
    def _make_engine(self, url: str) -> Engine:
        """The engine, its pool sized for the server's threads."""

    @abstractmethod
    def _begin_transaction(self, conn: Connection, job_ids: Sequence[str]) -> None:
        """Begin :meth:`transaction`'s transaction on ``conn``, holding what its calls
        will change (``job_ids``) as this backend must."""

    @abstractmethod
    def _insert(self, table: Any) -> Any:
        """The backend's INSERT (with ON CONFLICT) for ``table``."""

    @abstractmethod
    def _lock_rows(self, conn: Connection, q: Select[Any], read: bool = False) -> None:
        """Lock the rows ``q`` selects until the transaction ends (``read``: shared), where
        the backend has row locks; where one writer holds everything, nothing."""

    @abstractmethod
    def _insert_lines(self, conn: Connection, rows: list[tuple[str, int, str, str, float]]) -> None:
        """Insert a batch of a job's log rows (:data:`LINE_COLUMNS`) through the driver,
        in the write's transaction. A flooding job sends thousands of lines a second, and
        SQLAlchemy's per-row parameter handling cost more than the insert itself. Each row
        takes the next ``seq`` as it goes in, so the order is kept."""

    @abstractmethod
    def claiming(self) -> AbstractContextManager[ClaimSession]:
        """A claim session (:mod:`gpufleet.store._claims`)."""

    @abstractmethod
    def fold_job_counts(self) -> int:
        """Fold count changes kept apart into ``job_counts``; how many were folded."""

    @property
    @abstractmethod
    def offers(self) -> Offers:
        """What this backend offers beyond the contract."""

    @abstractmethod
    def publish_claimable(self) -> None:
        """Tell other server replicas that a job may have become claimable."""

    @abstractmethod
    def publish_tokens_changed(self) -> None:
        """Tell other server replicas that a token was rotated or revoked."""

    @abstractmethod
    def publish_superseded(self, worker_id: str, replica: str) -> None:
        """Tell other replicas that ``worker_id`` sent a poll replacing its open one."""

    @abstractmethod
    def listen(
        self,
        on_notify: Callable[[], None],
        stop: threading.Event,
        on_tokens: Callable[[], None] | None = None,
        on_superseded: Callable[[str, str], None] | None = None,
    ) -> None:
        """Hear other servers' changes until ``stop`` is set (see :class:`Offers`)."""

    def _read_page(
        self,
        conn: Connection,
        q: Select[Any],
        limit: int,
        budget: int | None,
        newest_first: bool = False,
    ) -> list[Any]:
        """:func:`read_page`: the budget summed as rows are read; a backend may sum it in
        SQL instead."""
        return read_page(conn, q, limit, budget, newest_first)

    # ---- plumbing ---------------------------------------------------------------------

    def migrate(self) -> None:
        """Bring the schema to the newest version (idempotent)."""
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(_MIGRATIONS))
        with self._write() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def close(self) -> None:
        """Close every pooled connection. A connection still checked out (a call running in
        another thread as the server stops) is waited for, 5 s at most: disposing the pool
        under it would leave it to be closed by the garbage collector."""
        pool = self.engine.pool
        deadline = time.monotonic() + 5.0
        while getattr(pool, "checkedout", lambda: 0)() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.engine.dispose()

    @contextmanager
    def transaction(self, job_ids: Sequence[str] = ()) -> Iterator[UnitOfWork]:
        """One transaction (:class:`~gpufleet.store.api.Transaction`): its store is a copy
        of this one bound to it, its savepoints are the database's, and its after-commit
        calls run once it has committed. ``job_ids``: the jobs its calls will change, held
        first as the backend must (:meth:`_begin_transaction`)."""
        self._outside_transaction("a transaction")
        began = self.space.mark()
        with self._lock or nullcontext(), self.engine.begin() as conn:
            self._begin_transaction(conn, job_ids)
            unit = UnitOfWork(self._bound(conn), conn.begin_nested)
            yield unit
        self.space.wrote(began)  # committed: a full disk (if one was seen) has room again
        unit.committed()

    def _bound(self, conn: Connection) -> SqlStore:
        """This store with every call made on ``conn``, in its transaction."""
        bound = copy.copy(self)
        bound._conn = conn
        return bound

    def _outside_transaction(self, what: str) -> None:
        """Refuse ``what`` (a claim, a transaction) on a store bound to a transaction: it
        runs in a transaction of its own, which would wait for this one's writer (the
        types of :class:`~gpufleet.store.api.Transaction` rule this out already)."""
        if self._conn is not None:
            raise RuntimeError(f"{what} cannot run inside a transaction")

    def hold_worker(self, worker: WorkerRow) -> list[JobRow]:
        with self._write() as conn:
            self._lock_worker(conn, worker.id)
            # a claim ranked before this call was made ranks again
            w = t.workers.c
            conn.execute(update(t.workers).where(w.id == worker.id).values(claims=w.claims + 1))
            return self._holding(conn, worker)

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        if self._conn is not None:
            yield self._conn
            return
        began = self.space.mark()
        with self._lock or nullcontext(), self.engine.begin() as conn:
            yield conn
        self.space.wrote(began)  # committed: a full disk (if one was seen) has room again

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        if self._conn is not None:
            yield self._conn
            return
        with self.engine.connect() as conn:
            yield conn

    def ping(self) -> str:
        with self._read() as conn:
            conn.execute(select(1))
        return self.dialect

    # ---- jobs -------------------------------------------------------------------------

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
            job_values(i, s, now, u, batch.submitted_by) for i, s, u in batch.jobs if i not in have
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

    def _lease_where(self, job_id: str, lease: int, statuses: Iterable[JobStatus]) -> Any:
        j = t.jobs.c
        return (j.id == job_id) & (j.lease == lease) & j.status.in_([s.value for s in statuses])

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
                where = self._lease_where(job_id, lease, ACTIVE) & (t.jobs.c.worker_id == worker_id)
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

    # ---- logs -------------------------------------------------------------------------

    def append_logs(
        self,
        job_id: str,
        lease: int,
        lines: Sequence[tuple[str, str]],
        now: float,
        first: int | None = None,
        quota: OutputQuota | None = None,
    ) -> Appended:
        """Append output lines if the lease still holds the job, line ``first`` of the
        attempt on (None: after what it has): lines it has already are skipped, so a batch
        sent again is stored once. Output past the attempt's ``quota`` is dropped (a cut's
        marker and event are stored). Says whether the lease held, and the stop grace when
        the job has been asked to stop (read in the same go)."""
        j, a = t.jobs.c, t.attempts.c
        with self._write() as conn:
            # The job's row is locked, as a status change locks it: the job's events are
            # numbered in the order they commit, so a follower never skips one.
            held = conn.execute(
                select(j.status, j.stop_requested_at, j.stop_grace, j.metrics)
                .where(self._lease_where(job_id, lease, ACTIVE))
                .with_for_update()
            ).first()
            if held is None:
                return Appended(False)
            this = (a.job_id == job_id) & (a.attempt == lease)
            # the attempt's row is locked: appends of one attempt count one at a time
            account = (a.log_lines, a.claimed_at, a.output_bytes, a.output_dropped, a.output_cut)
            have = conn.execute(select(*account).where(this).with_for_update()).one()
            fresh = log_offsets(have.log_lines or 0, first, lines)
            cut = None
            if fresh:
                got = metered(fresh.lines, dict(have._mapping), quota, now)
                rows = [(job_id, lease, s, ln, now) for s, ln in got.lines]
                if rows:
                    self._insert_lines(conn, rows)
                columns = {"log_lines": fresh.end, **account_columns(got.account)}
                conn.execute(update(t.attempts).where(this), columns)
                # the job's latest progress, even from records the quota cut from its log
                summary = progress_columns(fresh.lines, held.metrics)
                if summary is not None:
                    conn.execute(update(t.jobs).where(j.id == job_id), summary)
                if got.marker is not None:
                    cut = got.marker
                    conn.execute(
                        t.job_logs.insert(), cut_event(job_id, held.status, lease, cut, now)
                    )
        stop = None if held.stop_requested_at is None else float(held.stop_grace or 0)
        return Appended(True, stop, cut)

    def prune(self, logs_before: float | None, audit_before: float | None, batch: int) -> int:
        """Delete up to ``batch`` rows: log lines of jobs that ended before ``logs_before``,
        then audit records from before ``audit_before`` (None: keep). Returns how many;
        called again while it returns ``batch``. Each delete is conditional, so servers
        sharing the database may run it at once."""
        lines, j, a = t.job_logs.c, t.jobs.c, t.audit.c
        ended = select(j.id).where(
            j.status.in_([s.value for s in TERMINAL]), j.finished_at < logs_before
        )
        done = 0
        with self._write() as conn:
            if logs_before is not None:
                old = select(lines.seq).where(lines.job_id.in_(ended)).limit(batch)
                done += conn.execute(t.job_logs.delete().where(lines.seq.in_(old))).rowcount
            if audit_before is not None and done < batch:
                old = select(a.seq).where(a.at < audit_before).limit(batch - done)
                done += conn.execute(t.audit.delete().where(a.seq.in_(old))).rowcount
        return done

    def logs(
        self,
        job_id: str,
        after: int,
        limit: int,
        streams: Collection[str] | None = None,
        before: int | None = None,
        budget: int | None = None,
    ) -> list[LogRow]:
        """The job's event log after ``after``, in order: every record, or those of
        ``streams`` (stdout, stderr, progress, state). With ``before``: the last ``limit``
        records between the two (a page scrolled back to), still in order. With
        ``budget``: only the records within that many bytes of lines (see
        :mod:`gpufleet.store._pages`)."""
        c = t.job_logs.c
        q = select(t.job_logs).where(c.job_id == job_id, c.seq > after)
        if streams is not None:
            q = q.where(c.stream.in_(sorted(streams)))
        if before is not None:
            q = q.where(c.seq < before)
        with self._read() as conn:
            rows = self._read_page(conn, q, limit, budget, newest_first=before is not None)
        found = [LogRow.from_row(r) for r in rows]
        return found[::-1] if before is not None else found

    def state_events(
        self,
        after: int,
        limit: int,
        pools: Sequence[str] | None = None,
        budget: int | None = None,
    ) -> list[tuple[LogRow, str]]:
        """Status changes of every job (of ``pools``) after ``after``, in order, each with
        its job's pool: what the fleet-wide event stream carries (within ``budget``
        bytes of records, as :meth:`logs`)."""
        c, j = t.job_logs.c, t.jobs.c
        q = (
            select(t.job_logs, j.pool)
            .join(t.jobs, j.id == c.job_id)
            .where(c.stream == "state", c.seq > after)
        )
        if pools is not None:
            q = q.where(j.pool.in_(list(pools)))
        with self._read() as conn:
            rows = self._read_page(conn, q, limit, budget)
        out = []
        for r in rows:
            m = dict(r._mapping)
            pool = str(m.pop("pool"))
            out.append((LogRow.from_mapping(m), pool))
        return out

    def last_seq(self, job_id: str | None = None) -> int:
        """The newest record's number, of ``job_id``'s log or of all (0: none yet). A
        job's records commit in number order, so none still to come is numbered below."""
        c = t.job_logs.c
        q = select(func.max(c.seq))
        if job_id is not None:
            q = q.where(c.job_id == job_id)
        with self._read() as conn:
            return int(conn.execute(q).scalar() or 0)


LINE_COLUMNS = ("job_id", "attempt", "stream", "line", "ts")
