"""The SQL store: queue operations over SQLAlchemy Core, for SQLite and PostgreSQL.

Every write for a running job is a conditional update on (job id, lease, status), so a
stale lease changes nothing and the caller answers 409. SQLite has one writer: writes
take a process lock so they queue here instead of spinning on ``SQLITE_BUSY``.
PostgreSQL claims with ``FOR UPDATE SKIP LOCKED``, so concurrent claimers never wait on
each other's rows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
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
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DisconnectionError

from gpufleet.domain.models import ACTIVE, TERMINAL, JobSpec, JobStatus
from gpufleet.domain.quota import OutputQuota
from gpufleet.store import schema as t
from gpufleet.store._changes import ChangeOps
from gpufleet.store._claims import ClaimOps, page_statements
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
from gpufleet.store.api import Appended, Batch, Hold, Offers, QueueGauges, Written
from gpufleet.store.rows import AttemptRow, JobRow, LogRow, WorkerRow, log_offsets
from gpufleet.store.space import SpaceWatch, watch_engine
from gpufleet.store.stored import spec_json

_MIGRATIONS = Path(__file__).with_name("migrations")
POOL_SIZE = 40  # the server's worker threads (anyio's default limiter)
IDLE_PING = 5.0  # seconds a pooled PostgreSQL connection may sit before it is checked
CHANNEL = "gpufleet_claimable"
TOKENS_CHANGED = "tokens"  # a NOTIFY payload on CHANNEL: drop cached tokens
SUPERSEDED = "poll"  # "poll REPLICA WORKER_ID": that worker polls anew; end its open poll
_J = t.jobs.c
_C, _CD = t.job_counts.c, t.job_count_deltas.c
_BOTH = union_all(select(_C.pool, _C.status, _C.n), select(_CD.pool, _CD.status, _CD.n)).subquery()
_COUNTS = select(_BOTH.c.pool, _BOTH.c.status, func.sum(_BOTH.c.n)).group_by(
    _BOTH.c.pool, _BOTH.c.status
)
_FOLD = """
WITH gone AS (DELETE FROM job_count_deltas RETURNING pool, status, n)
INSERT INTO job_counts (pool, status, n)
SELECT pool, status, sum(n) FROM gone GROUP BY pool, status ORDER BY pool, status
ON CONFLICT (pool, status) DO UPDATE SET n = job_counts.n + excluded.n
"""
_JOB = select(t.jobs).where(_J.id == bindparam("id"))
# Read through the small partial index of aimed jobs, never by walking the pending queue
# in claim order (which planners prefer, and which costs as much as the queue is long):
# SQLite is told the index, PostgreSQL gets the read fenced off in a subquery (OFFSET 0).
_AIMED_WHERE = f"target IS NOT NULL AND status = '{JobStatus.PENDING.value}'"
_JOB_COLUMNS = ", ".join(c.name for c in t.jobs.c)  # named: a column added later is not read
_AIMED_JOBS = {
    "sqlite": f"SELECT {_JOB_COLUMNS} FROM jobs INDEXED BY ix_jobs_target "
    f"WHERE {_AIMED_WHERE} ORDER BY priority DESC, created_at, id",
    "postgresql": f"SELECT {_JOB_COLUMNS} FROM (SELECT * FROM jobs WHERE {_AIMED_WHERE} "
    "OFFSET 0) aimed ORDER BY priority DESC, created_at, id",
}
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


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
    """Check a pooled PostgreSQL connection before use if it sat idle for IDLE_PING
    seconds: a database restarted meanwhile has closed it, and the pool then opens a new
    one. A connection in steady use is not pinged (pinging on every checkout cost a round
    trip per call: 15 % of a heartbeat's CPU)."""
    now = time.monotonic()
    last = record.info.get("used", now)
    record.info["used"] = now
    if now - last < IDLE_PING:
        return
    try:
        with dbapi_conn.cursor() as cur:
            cur.execute("SELECT 1")
    except Exception as exc:  # the driver's error for a closed connection
        raise DisconnectionError("a pooled connection was closed") from exc


class SqlStore(DataOps, ChangeOps, ClaimOps, FleetOps, EnvironmentOps):
    """Queue operations; policy (what a state change *is*) lives above, in the service."""

    def __init__(self, url: str) -> None:
        self.url = normalize_url(url)
        self.engine: Engine
        if self.url.startswith("sqlite"):
            # As many pooled connections as the server has threads (anyio's 40): under
            # load a smaller pool opened and closed a connection, with its pragmas, for
            # most calls (a third of a heartbeat's cost with 10,000 workers).
            # (An in-memory database has one connection, shared: no pool to size.)
            memory = make_url(self.url).database in (None, "", ":memory:")
            pool = {} if memory else {"pool_size": POOL_SIZE, "max_overflow": 10}
            self.engine = create_engine(
                self.url, connect_args={"check_same_thread": False, "timeout": 30}, **pool
            )
            event.listen(self.engine, "connect", _sqlite_pragmas)
            self._lock: threading.Lock | None = threading.Lock()
        else:
            # Kept open: 20 per server process (4 replicas stay under PostgreSQL's default
            # 100 connections); 20 more for bursts, closed when they end.
            self.engine = create_engine(self.url, pool_size=POOL_SIZE // 2, max_overflow=20)
            event.listen(self.engine, "checkout", _ping_if_idle)
            self._lock = None
        self.dialect = self.engine.dialect.name
        self.space = SpaceWatch()
        watch_engine(self.engine, self.space)
        self.page_q = page_statements()
        # The transaction calls share inside ``together`` (this store's, this thread's).
        self._shared: ContextVar[Connection | None] = ContextVar(f"store{id(self)}", default=None)

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
    def together(
        self, job_ids: Sequence[str] = ()
    ) -> Iterator[Callable[[], AbstractContextManager[object]]]:
        """The calls made inside (in this thread) share one transaction, committed as it
        ends, and read what the ones before them wrote. Each part (``with part():``) is a
        savepoint: a part that raises leaves nothing behind, and the other parts stand. On
        SQLite the one writer's lock is held throughout (claims, which take it themselves,
        must not run inside). On PostgreSQL the rows of ``job_ids``, the jobs the calls
        will change, are locked first, in id order, as every write of several jobs takes
        them: a transaction that holds some while it waits for others cannot deadlock."""
        if self._shared.get() is not None:
            yield nullcontext
            return
        began = self.space.mark()
        with self._lock or nullcontext(), self.engine.begin() as conn:
            if self.dialect == "sqlite":
                # pysqlite opens a transaction only before a write, and SQLite commits the
                # one a first SAVEPOINT opened when that savepoint is released: begin here,
                # as the writer at once (a deferred one could not become it later).
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            elif job_ids:
                ids = sorted(set(job_ids))
                conn.execute(
                    select(t.jobs.c.id)
                    .where(t.jobs.c.id.in_(ids))
                    .order_by(t.jobs.c.id)
                    .with_for_update()
                ).all()
            token = self._shared.set(conn)
            try:
                yield conn.begin_nested
            finally:
                self._shared.reset(token)
        self.space.wrote(began)  # committed: a full disk (if one was seen) has room again

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        shared = self._shared.get()
        if shared is not None:
            yield shared
            return
        began = self.space.mark()
        with self._lock or nullcontext(), self.engine.begin() as conn:
            yield conn
        self.space.wrote(began)  # committed: a full disk (if one was seen) has room again

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        shared = self._shared.get()
        if shared is not None:
            yield shared
            return
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

    @property
    def offers(self) -> Offers:
        """PostgreSQL runs claim sessions side by side and hears other servers' changes;
        SQLite writes one at a time, and is one server's alone."""
        if self.dialect == "postgresql":
            return Offers(claimers=8, listens=True)
        return Offers(claimers=1, listens=False)

    def listen(
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

    def submit(self, batch: Batch, now: float) -> Written:
        """Write a submit or a manifest apply in one transaction (see :class:`Batch`).
        A new job's dependencies are counted in it, so it is never claimable before they
        are met, and a dependency that failed already fails it at once."""
        with self._write() as conn:
            if batch.hold is not None:
                self._hold(conn, batch.hold)
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
        return Written(created, updated)

    def _hold(self, conn: Connection, hold: Hold) -> None:
        self._lock_worker(conn, hold.worker.id)
        hold.check(self._holding(conn, hold.worker))
        # a claim ranked before this job was aimed at the worker ranks again
        w = t.workers.c
        conn.execute(update(t.workers).where(w.id == hold.worker.id).values(claims=w.claims + 1))

    def _insert_new(self, conn: Connection, batch: Batch, now: float) -> list[str]:
        """Insert the batch's jobs whose id is new, with their dependencies; their ids."""
        ids = [j[0] for j in batch.jobs]
        needed = sorted({d for ds in batch.deps.values() for d in ds})
        if needed and self.dialect == "postgresql":
            # A dependency finishing meanwhile waits for this insert (or this one for
            # it), so one of the two sees the other: no new job waits on a failed one.
            q = select(t.jobs.c.id).where(t.jobs.c.id.in_(needed))
            conn.execute(q.with_for_update(read=True))
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
        if self.dialect == "postgresql":
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

    @staticmethod
    def _pending_specs(conn: Connection, ids: list[str], *, lock: bool) -> dict[str, str]:
        """The specs of those of ``ids`` (sorted) still pending; ``lock``: row-locked, in
        id order."""
        j = t.jobs.c
        found: dict[str, str] = {}
        for at in range(0, len(ids), 500):
            q = select(j.id, j.spec).where(
                j.id.in_(ids[at : at + 500]), j.status == JobStatus.PENDING.value
            )
            if lock:
                q = q.order_by(j.id).with_for_update()
            found.update({i: sp for i, sp in conn.execute(q).all()})
        return found

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
        with self._read() as conn:
            rows = conn.exec_driver_sql(_AIMED_JOBS[self.dialect]).all()
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

    def fold_job_counts(self) -> int:
        """Fold the count changes PostgreSQL's trigger appended into ``job_counts``; how
        many were folded. Replicas may fold at once: each change is deleted by exactly
        one of them, and the sums go in key order (two folds never wait on each other in
        a circle). Nothing to do on SQLite, whose trigger counts in place."""
        if self.dialect != "postgresql":
            return 0
        with self._write() as conn:
            return int(conn.exec_driver_sql(_FOLD).rowcount or 0)

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
            for job_id, lease in sorted(leases):  # rows locked in id order, as by `together`
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
                    _insert_lines(conn, self.dialect, rows)
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
            rows = read_page(conn, q, limit, budget, newest_first=before is not None)
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
            rows = read_page(conn, q, limit, budget)
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


def _insert_lines(
    conn: Connection, dialect: str, rows: list[tuple[str, int, str, str, float]]
) -> None:
    """Insert a batch of a job's log rows through the driver, in the write's transaction:
    ``COPY`` on PostgreSQL, ``executemany`` on SQLite. A flooding job sends thousands of
    lines a second, and SQLAlchemy's per-row parameter handling cost more than the insert
    itself (a 5,000-line batch: about 80 ms on PostgreSQL, which other requests waited
    behind). Each row takes the next ``seq`` as it goes in, so the order is kept."""
    raw: Any = conn.connection.driver_connection
    table, columns = t.job_logs.name, ", ".join(t.job_logs.c[n].name for n in LINE_COLUMNS)
    if dialect == "postgresql":
        with raw.cursor() as cur, cur.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
    else:
        marks = ", ".join("?" for _ in LINE_COLUMNS)
        raw.executemany(f"INSERT INTO {table} ({columns}) VALUES ({marks})", rows)
