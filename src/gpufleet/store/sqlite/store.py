"""The SQLite backend of the SQL store: one writer at a time, so writes take a process
lock and queue here instead of spinning on ``SQLITE_BUSY``, and a transaction that must
hold rows (a batch of reports, a claim) takes the writer's lock at once rather than row
locks. One server's alone: there is no other replica to tell or to hear."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, Select, bindparam, create_engine, event, make_url, update
from sqlalchemy.dialects import sqlite

from gpufleet.domain.caps import Recheck
from gpufleet.domain.lifecycle import Change
from gpufleet.store import schema as t
from gpufleet.store.alone import OneServer
from gpufleet.store.api import StaleClaim
from gpufleet.store.sql.claims import AIMED_SQL, HELD_SQL, ClaimSession, claims_only, driver_rows
from gpufleet.store.sql.events import LINE_COLUMNS
from gpufleet.store.sql.jobs import AIMED_WHERE, JOB_COLUMNS
from gpufleet.store.sql.store import POOL_SIZE, SqlStore

_W = t.workers.c
# The worker's snapshot in one statement; the aimed jobs from the small partial index (left
# to itself SQLite would walk the pool's whole queue: ix_jobs_queue matches two equalities
# and the order).
_VIEW = (
    "SELECT (SELECT json_group_array(json_array(gpus, n)) FROM ("
    + HELD_SQL.format(wid="?")
    + ")), (SELECT json_group_array(id) FROM ("
    + AIMED_SQL.format(hint="INDEXED BY ix_jobs_target ", wid="?", wname="?", pool="?", now="?")
    + ")), (SELECT claims FROM workers WHERE id = ?)"
)
# A worker's claim count moves on only from the count a claim ranked on.
_COUNT_CLAIM = (
    update(t.workers)
    .where((_W.id == bindparam("wid")) & (_W.claims == bindparam("seen")))
    .values(claims=_W.claims + 1)
)


def _pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


class SqliteClaims(ClaimSession):
    """The reads run outside the writer's lock; the write takes it. Claims run one after
    the other, so the first choice is still there: one offered at a time."""

    page_size, choices = 4, 1
    store: SqliteStore  # whose writer's lock the write takes

    def _snapshot(self, worker_id: str, name: str, pool: str, now: float) -> list[Any]:
        return driver_rows(self.conn, _VIEW, (worker_id, worker_id, name, pool, now, worker_id))

    def claim(
        self, worker_id: str, seen: int, changes: Sequence[Change], caps: Recheck | None = None
    ) -> str | None:
        claims_only(changes)
        if not changes:
            return None
        conn = self.conn
        conn.commit()  # the reads' implicit transaction; SQLite took no lock for them
        with self.store._lock, conn.begin():
            # The one writer serializes every claim: what the caps' holders hold is read
            # inside it, so no other claim can come between the count and the write.
            for change in changes if caps is None else self.capped(changes, caps):
                if self.store.apply_change(conn, change):
                    counted = conn.execute(_COUNT_CLAIM, {"wid": worker_id, "seen": seen})
                    if counted.rowcount != 1:
                        raise StaleClaim(worker_id)  # and the claim rolls back
                    return change.job_id
        return None


class WriterLock:
    """SQLite's one writer, as a lock that knows which thread holds it. A thread that asks
    for it again while it holds it (a write made outside the transaction it is inside:
    the transaction's store is the one to write through) is refused at once, where a plain
    lock would wait for itself forever."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: int | None = None

    def __enter__(self) -> None:
        me = threading.get_ident()
        if self._holder == me:
            raise RuntimeError(
                "this thread holds SQLite's writer already: a write outside the transaction "
                "it is inside (write through the transaction's store)"
            )
        self._lock.acquire()
        self._holder = me

    def __exit__(self, *exc: object) -> None:
        self._holder = None
        self._lock.release()


class SqliteStore(OneServer, SqlStore):
    """The SQL store on SQLite (a file, or ``sqlite://`` in memory)."""

    dialect = "sqlite"
    _lock: WriterLock  # always: SQLite has one writer
    aimed_jobs_sql = (
        f"SELECT {JOB_COLUMNS} FROM jobs INDEXED BY ix_jobs_target "
        f"WHERE {AIMED_WHERE} ORDER BY priority DESC, created_at, id"
    )

    def __init__(self, url: str) -> None:
        self._lock = WriterLock()
        super().__init__(url)

    def _make_engine(self, url: str) -> Engine:
        # As many pooled connections as the server has threads (anyio's 40): under load a
        # smaller pool opened and closed a connection, with its pragmas, for most calls (a
        # third of a heartbeat's cost with 10,000 workers). (An in-memory database has one
        # connection, shared: no pool to size.)
        memory = make_url(url).database in (None, "", ":memory:")
        pool = {} if memory else {"pool_size": POOL_SIZE, "max_overflow": 10}
        connect = {"check_same_thread": False, "timeout": 30}
        engine = create_engine(url, connect_args=connect, **pool)
        event.listen(engine, "connect", _pragmas)
        return engine

    def _begin_transaction(self, conn: Connection, job_ids: Sequence[str]) -> None:
        # pysqlite opens a transaction only before a write, and SQLite commits the one a
        # first SAVEPOINT opened when that savepoint is released: begin here, as the
        # writer at once (a deferred one could not become it later). The one writer's
        # lock is held throughout: claims, which take it themselves, must not run inside.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    def _insert(self, table: Any) -> Any:
        return sqlite.insert(table)

    def _lock_rows(self, conn: Connection, q: Select[Any], read: bool = False) -> None:
        """Nothing: the one writer holds every row already."""

    def _insert_lines(self, conn: Connection, rows: list[tuple[str, int, str, str, float]]) -> None:
        raw: Any = conn.connection.driver_connection
        table, columns = t.job_logs.name, ", ".join(t.job_logs.c[n].name for n in LINE_COLUMNS)
        marks = ", ".join("?" for _ in LINE_COLUMNS)
        raw.executemany(f"INSERT INTO {table} ({columns}) VALUES ({marks})", rows)

    @contextmanager
    def claiming(self) -> Iterator[SqliteClaims]:
        self._outside_transaction("a claim")
        with self._read() as conn:
            yield SqliteClaims(self, conn)

    def fold_job_counts(self) -> int:
        """Nothing to fold: SQLite's trigger counts in place."""
        return 0
