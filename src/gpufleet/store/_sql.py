"""The SQL store: queue operations over SQLAlchemy Core, for SQLite and PostgreSQL.

Every write for a running job is a conditional update on (job id, lease, status), so a
stale lease changes nothing and the caller answers 409. SQLite has one writer: writes
take a process lock so they queue here instead of spinning on ``SQLITE_BUSY``.
PostgreSQL claims with ``FOR UPDATE SKIP LOCKED``, so concurrent claimers never wait on
each other's rows.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    bindparam,
    create_engine,
    event,
    func,
    make_url,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from gpufleet.domain import lifecycle
from gpufleet.domain.models import ACTIVE, JobSpec, JobStatus
from gpufleet.store import schema as t
from gpufleet.store._changes import ChangeOps
from gpufleet.store._data import DataOps
from gpufleet.store._fleet import FleetOps
from gpufleet.store.rows import AttemptRow, JobRow, LogRow, WorkerRow
from gpufleet.wire import JobSpecModel

_MIGRATIONS = Path(__file__).with_name("migrations")
CLAIM_PAGE = 4
CHANNEL = "gpufleet_claimable"
TOKENS_CHANGED = "tokens"  # a NOTIFY payload on CHANNEL: drop cached tokens
SUPERSEDED = "poll"  # "poll REPLICA WORKER_ID": that worker polls anew; end its open poll
_J = t.jobs.c
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
# What a claim reads about its worker first, in one statement (on PostgreSQL one round
# trip, which also locks the worker's row): the GPUs its claimed and running jobs hold,
# grouped ('[]': a CPU slot, with how many), and the pending jobs aimed at it that are
# claimable now, in claim order (it takes those before its pool's queue). The aimed jobs
# come from the small partial index; left to itself SQLite would walk the pool's whole
# queue (ix_jobs_queue matches two equalities and the order). Run on the driver's own
# cursor: SQLAlchemy's execution path costs more than the query.
_HELD = (
    "SELECT gpus, COUNT(*) AS n FROM jobs WHERE worker_id = {wid} "
    "AND status IN ('claimed', 'running') GROUP BY gpus"
)
_AIMED = (
    "SELECT id, priority, created_at FROM jobs {hint}WHERE target IN ({wid}, {wname}) "
    "AND status = 'pending' AND pool = {pool} AND waiting = 0 "
    "AND (not_before IS NULL OR not_before <= {now}) ORDER BY priority DESC, created_at, id "
    "LIMIT 8"
)
_CLAIMER_SQLITE = (
    "SELECT (SELECT json_group_array(json_array(gpus, n)) FROM ("
    + _HELD.format(wid="?")
    + ")), (SELECT json_group_array(id) FROM ("
    + _AIMED.format(hint="INDEXED BY ix_jobs_target ", wid="?", wname="?", pool="?", now="?")
    + "))"
)
_CLAIMER_POSTGRES = (
    "SELECT (SELECT json_agg(json_build_array(h.gpus, h.n)) FROM ("
    + _HELD.format(wid="w.id")
    + ") h), (SELECT json_agg(a.id ORDER BY a.priority DESC, a.created_at, a.id) FROM ("
    + _AIMED.format(hint="", wid="w.id", wname="w.name", pool="w.pool", now="%s")
    + ") a) FROM workers w WHERE w.id = %s FOR UPDATE OF w"
)


def normalize_url(url: str) -> str:
    """``postgresql://`` means psycopg 3; a bare path means a SQLite file."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    if "://" not in url:
        return f"sqlite:///{Path(url).expanduser().resolve()}"
    return url


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _json_list(value: Any) -> list[Any]:
    """A JSON array from the database: text on SQLite, decoded already by psycopg; NULL
    (an aggregate over no rows) is empty."""
    if value is None:
        return []
    found: list[Any] = value if isinstance(value, list) else json.loads(value)
    return found


def _spec_json(spec: JobSpec) -> str:
    return JobSpecModel.from_domain(spec).model_dump_json()


@dataclass(frozen=True)
class Hold:
    """Insert only if ``check`` accepts ``worker``'s jobs (those it runs and those aimed at
    it that wait), read in the insert's own transaction with the worker's row locked: two
    submits aimed at one worker cannot both find it free. ``check`` raises to refuse."""

    worker: WorkerRow
    check: Callable[[list[JobRow]], None]


#: Given the GPUs each of a worker's claimed or running jobs holds, how to choose a job:
#: the GPUs to claim it on, or None to pass.
Chooser = Callable[[JobRow], Sequence[int] | None]


class SqlStore(DataOps, ChangeOps, FleetOps):
    """Queue operations; policy (what a state change *is*) lives above, in the service."""

    def __init__(self, url: str) -> None:
        self.url = normalize_url(url)
        self.engine: Engine
        if self.url.startswith("sqlite"):
            self.engine = create_engine(
                self.url, connect_args={"check_same_thread": False, "timeout": 30}
            )
            event.listen(self.engine, "connect", _sqlite_pragmas)
            self._lock: threading.Lock | None = threading.Lock()
        else:
            self.engine = create_engine(self.url, pool_size=10, max_overflow=30, pool_pre_ping=True)
            self._lock = None
        self.dialect = self.engine.dialect.name
        self._page_q = self._page_statement()
        self._claimer_sql = _CLAIMER_SQLITE if self.dialect == "sqlite" else _CLAIMER_POSTGRES

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
        self.engine.dispose()

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        with self._lock or nullcontext(), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn

    def _insert(self, table: Any) -> Any:
        mod = postgresql if self.dialect == "postgresql" else sqlite
        return mod.insert(table)

    def ping(self) -> str:
        with self._read() as conn:
            conn.execute(select(1))
        return self.dialect

    # ---- wake-ups across server replicas -----------------------------------------------

    def publish_claimable(self) -> None:
        """Tell other server replicas that a job may have become claimable (PostgreSQL
        NOTIFY; a single SQLite server needs nothing beyond its in-process wake-up)."""
        if self.dialect == "postgresql":
            with self.engine.begin() as conn:
                conn.exec_driver_sql(f"NOTIFY {CHANNEL}")

    def publish_tokens_changed(self) -> None:
        """Tell other server replicas that a token was rotated or revoked, so they drop
        what they cached of tokens now rather than when their cache expires."""
        if self.dialect == "postgresql":
            with self.engine.begin() as conn:
                conn.exec_driver_sql(f"NOTIFY {CHANNEL}, '{TOKENS_CHANGED}'")

    def publish_superseded(self, worker_id: str, replica: str) -> None:
        """Tell other replicas that ``worker_id`` sent a poll replacing its open one."""
        if self.dialect == "postgresql":
            with self.engine.begin() as conn:
                conn.execute(select(func.pg_notify(CHANNEL, f"{SUPERSEDED} {replica} {worker_id}")))

    def listen_claimable(
        self,
        on_notify: Callable[[], None],
        stop: threading.Event,
        on_tokens: Callable[[], None] | None = None,
        on_superseded: Callable[[str, str], None] | None = None,
    ) -> None:
        """Call ``on_notify`` for every NOTIFY from any replica (``on_tokens`` for a token
        change, ``on_superseded(worker_id, replica)`` for a worker's new poll) until
        ``stop`` is set. Blocks: run it in a thread. Reconnects after a lost connection."""
        import psycopg

        conninfo = make_url(self.url).set(drivername="postgresql").render_as_string(False)
        while not stop.is_set():
            try:
                with psycopg.connect(conninfo, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    while not stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            kind, _, rest = note.payload.partition(" ")
                            if kind == TOKENS_CHANGED:
                                if on_tokens is not None:
                                    on_tokens()
                            elif kind == SUPERSEDED:
                                replica, _, worker_id = rest.partition(" ")
                                if on_superseded is not None:
                                    on_superseded(worker_id, replica)
                            else:
                                on_notify()
            except psycopg.Error:
                stop.wait(1.0)

    # ---- jobs -------------------------------------------------------------------------

    def _job_values(
        self,
        job_id: str,
        spec: JobSpec,
        now: float,
        unrunnable: str | None,
        submitted_by: str | None,
    ) -> dict[str, Any]:
        return {
            "submitted_by": submitted_by,
            "target": spec.requirements.worker,
            "id": job_id,
            "name": spec.name,
            "status": lifecycle.INITIAL.value,
            "spec": _spec_json(spec),
            "priority": spec.priority,
            "pool": spec.pool,
            "manifest": spec.manifest,
            "model": spec.model,
            "attempts": 0,
            "max_attempts": spec.max_attempts,
            "lease": 0,
            "gpus": "[]",
            "created_at": now,
            "unrunnable": unrunnable,
        }

    def insert_jobs(
        self,
        jobs: Sequence[tuple[str, JobSpec, str | None]],
        now: float,
        deps: Mapping[str, Sequence[str]] | None = None,
        submitted_by: str | None = None,
        hold: Hold | None = None,
    ) -> list[str]:
        """Insert the jobs whose id is new; existing ones are left alone. Returns new ids.
        ``deps`` names the jobs each new job waits for; it is counted in the same
        transaction, so a new job is never claimable before its dependencies are met.
        ``submitted_by`` is the token submitting them; ``hold`` a check made first."""
        if not jobs:
            return []
        ids = [j[0] for j in jobs]
        with self._write() as conn:
            if hold is not None:
                self._lock_worker(conn, hold.worker.id)
                hold.check(self._holding(conn, hold.worker))
            have: set[str] = set()
            for chunk in range(0, len(ids), 500):
                q = select(t.jobs.c.id).where(t.jobs.c.id.in_(ids[chunk : chunk + 500]))
                have.update(conn.scalars(q))
            fresh = [
                self._job_values(i, s, now, u, submitted_by) for i, s, u in jobs if i not in have
            ]
            if not fresh:
                return []
            # A concurrent apply may have inserted some meanwhile: those are skipped, and
            # RETURNING names only the rows this call created.
            stmt = self._insert(t.jobs).on_conflict_do_nothing().returning(t.jobs.c.id)
            inserted = set(conn.execute(stmt, fresh).scalars())
            mine = {i: d for i, d in (deps or {}).items() if i in inserted and d}
            if mine:
                self.insert_deps(conn, mine)
                self.recount_waiting(conn, list(mine))
                self.fail_on_failed_deps(conn, list(mine), now)
            return [v["id"] for v in fresh if v["id"] in inserted]

    def update_pending(self, jobs: Sequence[tuple[str, JobSpec, str | None]]) -> list[str]:
        """Give pending jobs a new spec (same identity, new priority, requirements or
        limits) and its unrunnable verdict; jobs already claimed or finished keep theirs.
        Compared outside the writer lock, written in one batch. Returns the ids changed."""
        j = t.jobs.c
        wanted = {job_id: (_spec_json(spec), spec, why) for job_id, spec, why in jobs}
        ids = list(wanted)
        current: dict[str, str] = {}
        with self._read() as conn:
            for at in range(0, len(ids), 500):
                q = select(j.id, j.spec).where(
                    j.id.in_(ids[at : at + 500]), j.status == JobStatus.PENDING.value
                )
                current.update({i: sp for i, sp in conn.execute(q).all()})
        rows = [
            {
                "jid": i,
                "old": old,
                "spec": wanted[i][0],
                "priority": wanted[i][1].priority,
                "max_attempts": wanted[i][1].max_attempts,
                "pool": wanted[i][1].pool,
                "unrunnable": wanted[i][2],
                "target": wanted[i][1].requirements.worker,
            }
            for i, old in current.items()
            if old != wanted[i][0]
        ]
        if rows:
            with self._write() as conn:
                conn.execute(_PENDING_UPDATE, rows)
        return [str(r["jid"]) for r in rows]

    def _driver_rows(self, conn: Connection, sql: str, params: tuple[Any, ...]) -> list[Any]:
        """Rows of a hot-path query run on the driver's own cursor (SQLAlchemy's execution
        path costs more than these queries do)."""
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(sql, params)
            return list(cursor.fetchall())
        finally:
            cursor.close()

    def _claimer(
        self, conn: Connection, worker: WorkerRow, now: float
    ) -> tuple[list[tuple[int, ...]], list[str]]:
        """The GPUs each of the worker's claimed and running jobs holds (() a CPU slot),
        and the ids of the pending jobs aimed at it that are claimable now, best first.
        On PostgreSQL the worker's row is locked until the transaction ends."""
        if self.dialect == "sqlite":
            params: tuple[Any, ...] = (worker.id, worker.id, worker.name, worker.pool, now)
        else:
            params = (now, worker.id)
        rows = self._driver_rows(conn, self._claimer_sql, params)
        held_raw, aimed_raw = rows[0] if rows else (None, None)
        held = [
            tuple(json.loads(gpus))
            for gpus, count in _json_list(held_raw)
            for _ in range(int(count))
        ]
        return held, [str(i) for i in _json_list(aimed_raw)]

    def _aimed(self, conn: Connection, ids: list[str]) -> list[JobRow]:
        """The jobs ``ids`` (aimed at the claiming worker), in claim order."""
        if not ids:
            return []
        j = t.jobs.c
        q = select(t.jobs).where(j.id.in_(ids)).order_by(j.priority.desc(), j.created_at, j.id)
        return [JobRow.from_row(r) for r in conn.execute(q).all()]

    def _lock_worker(self, conn: Connection, worker_id: str) -> None:
        """Serialize this transaction with others about the same worker (PostgreSQL; on
        SQLite the one writer already does)."""
        if self.dialect == "postgresql":
            w = t.workers.c
            conn.execute(select(w.id).where(w.id == worker_id).with_for_update())

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
        j = t.jobs.c
        q = (
            select(t.jobs)
            .where(j.target.is_not(None) & (j.status == JobStatus.PENDING.value))
            .order_by(j.priority.desc(), j.created_at, j.id)
        )
        with self._read() as conn:
            return [JobRow.from_row(r) for r in conn.execute(q).all()]

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
            row = conn.execute(select(t.jobs).where(t.jobs.c.id == job_id)).first()
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
        self, statuses: Iterable[str] = (), limit: int = 1000, pools: Sequence[str] | None = None
    ) -> list[JobRow]:
        """The newest ``limit`` jobs (of ``pools``; None: every pool), oldest first."""
        q = select(t.jobs).order_by(t.jobs.c.created_at.desc(), t.jobs.c.id.desc()).limit(limit)
        statuses = list(statuses)
        if statuses:
            q = q.where(t.jobs.c.status.in_(statuses))
        if pools is not None:
            q = q.where(t.jobs.c.pool.in_(pools))
        with self._read() as conn:
            return [JobRow.from_row(r) for r in reversed(conn.execute(q).all())]

    def job_counts(self, pools: Sequence[str] | None = None) -> dict[str, int]:
        q = select(t.jobs.c.status, func.count()).group_by(t.jobs.c.status)
        if pools is not None:
            q = q.where(t.jobs.c.pool.in_(pools))
        with self._read() as conn:
            return {s: int(n) for s, n in conn.execute(q).all()}

    def _page_statement(self) -> Any:
        """Built once: the next few claimable jobs of a pool after a keyset position, best
        first (priority, then age). On PostgreSQL rows are locked ``FOR UPDATE SKIP LOCKED``,
        so rows another claimer is looking at are skipped and claimers never wait."""
        j = t.jobs.c
        p: Any = bindparam("p")
        c: Any = bindparam("c")
        i: Any = bindparam("i")
        q = (
            select(t.jobs)
            .where(j.status == JobStatus.PENDING.value, j.pool == bindparam("pool"))
            .where(j.waiting == 0)
            .where((j.not_before.is_(None)) | (j.not_before <= bindparam("now")))
            .where(
                (j.priority < p)
                | ((j.priority == p) & (j.created_at > c))
                | ((j.priority == p) & (j.created_at == c) & (j.id > i))
            )
            .order_by(j.priority.desc(), j.created_at, j.id)
            .limit(CLAIM_PAGE)
        )
        return q.with_for_update(skip_locked=True) if self.dialect == "postgresql" else q

    def _page(self, conn: Connection, pool: str, now: float, after: JobRow | None) -> list[JobRow]:
        key = (after.priority, after.created_at, after.id) if after else (2**31 - 1, -1.0, "")
        params = {"pool": pool, "now": now, "p": key[0], "c": key[1], "i": key[2]}
        return [JobRow.from_row(r) for r in conn.execute(self._page_q, params).all()]

    def claim_next(
        self,
        worker: WorkerRow,
        now: float,
        expires: float,
        plan: Callable[[list[tuple[int, ...]]], Chooser | None],
        limit: int = 200,
    ) -> tuple[JobRow, int, tuple[int, ...]] | None:
        """Claim the first claimable job the chooser accepts: first the jobs aimed at this
        worker, then the pool's queue. ``plan`` gets the GPUs each of the worker's claimed
        or running jobs holds (() a CPU slot), read in this transaction with the worker's
        row locked, and returns the chooser (None: nothing is free): it gives the GPUs to
        claim a job on, or None to pass. Returns (job, new lease, gpus), or None."""
        seen, last = 0, None
        with self._write() as conn:
            held, aimed = self._claimer(conn, worker, now)
            choose = plan(held)
            if choose is None:
                return None
            for job in self._aimed(conn, aimed):
                gpus = choose(job)
                if gpus is not None and self._claim_row(conn, job, worker, gpus, now, expires):
                    return job, job.lease + 1, tuple(gpus)
            while seen < limit:
                page = self._page(conn, worker.pool, now, last)
                for job in page:
                    gpus = choose(job)
                    if gpus is not None and self._claim_row(conn, job, worker, gpus, now, expires):
                        return job, job.lease + 1, tuple(gpus)
                if len(page) < CLAIM_PAGE:
                    return None
                seen, last = seen + len(page), page[-1]
        return None

    def _lease_where(self, job_id: str, lease: int, statuses: Iterable[JobStatus]) -> Any:
        j = t.jobs.c
        return (j.id == job_id) & (j.lease == lease) & j.status.in_([s.value for s in statuses])

    def _claim_row(
        self,
        conn: Connection,
        job: JobRow,
        worker: WorkerRow,
        gpus: Sequence[int],
        now: float,
        expires: float,
    ) -> bool:
        """Compare-and-set one pending job to claimed and open its attempt record."""
        change = lifecycle.claim(job, worker.id, worker.name, gpus, now, expires)
        return self.apply_change(conn, change)

    def extend_leases(
        self, leases: Iterable[tuple[str, int]], expires: float, worker_id: str
    ) -> set[tuple[str, int]]:
        """Push back the expiry of every valid lease ``worker_id`` holds; returns those."""
        held: set[tuple[str, int]] = set()
        with self._write() as conn:
            for job_id, lease in leases:
                where = self._lease_where(job_id, lease, ACTIVE) & (t.jobs.c.worker_id == worker_id)
                stmt = update(t.jobs).where(where)
                if conn.execute(stmt.values(lease_expires_at=expires)).rowcount == 1:
                    held.add((job_id, lease))
        return held

    def extend_all_leases(self, expires: float) -> int:
        """Give every active lease until ``expires`` (a server start: workers could not
        heartbeat while it was down). Returns how many."""
        j = t.jobs.c
        where = j.status.in_([s.value for s in ACTIVE]) & (j.lease_expires_at < expires)
        with self._write() as conn:
            return conn.execute(
                update(t.jobs).where(where).values(lease_expires_at=expires)
            ).rowcount

    def expired_leases(self, now: float) -> list[JobRow]:
        j = t.jobs.c
        q = select(t.jobs).where(j.status.in_([s.value for s in ACTIVE]), j.lease_expires_at < now)
        with self._read() as conn:
            return [JobRow.from_row(r) for r in conn.execute(q).all()]

    def request_stop(self, job_id: str, now: float, grace: float) -> bool:
        """Mark a claimed or running job as asked to stop (once)."""
        j = t.jobs.c
        where = (
            (j.id == job_id)
            & j.status.in_([s.value for s in ACTIVE])
            & j.stop_requested_at.is_(None)
        )
        with self._write() as conn:
            res = conn.execute(
                update(t.jobs).where(where).values(stop_requested_at=now, stop_grace=grace)
            )
            return res.rowcount == 1

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

    def active_jobs(self, worker_id: str | None = None) -> list[JobRow]:
        j = t.jobs.c
        q = select(t.jobs).where(j.status.in_([s.value for s in ACTIVE]))
        if worker_id is not None:
            q = q.where(j.worker_id == worker_id)
        with self._read() as conn:
            return [JobRow.from_row(r) for r in conn.execute(q).all()]

    # ---- logs -------------------------------------------------------------------------

    def append_logs(
        self, job_id: str, lease: int, lines: Sequence[tuple[str, str]], now: float
    ) -> tuple[bool, float | None]:
        """Append output lines if the lease still holds the job. Returns whether it did,
        and the stop grace when the job has been asked to stop (read in the same go)."""
        j = t.jobs.c
        with self._write() as conn:
            held = conn.execute(
                select(j.stop_requested_at, j.stop_grace).where(
                    self._lease_where(job_id, lease, ACTIVE)
                )
            ).first()
            if held is None:
                return False, None
            if lines:
                conn.execute(
                    t.job_logs.insert(),
                    [
                        {"job_id": job_id, "attempt": lease, "stream": s, "line": ln, "ts": now}
                        for s, ln in lines
                    ],
                )
        return True, (None if held.stop_requested_at is None else float(held.stop_grace or 0))

    def logs(self, job_id: str, after: int, limit: int) -> list[LogRow]:
        c = t.job_logs.c
        q = select(t.job_logs).where(c.job_id == job_id, c.seq > after).order_by(c.seq).limit(limit)
        with self._read() as conn:
            return [LogRow.from_row(r) for r in conn.execute(q).all()]
