"""The PostgreSQL backend of the SQL store: several servers on one database. Writes that
must hold rows lock them (in id order, so two transactions never wait on each other in a
circle), claims skip the rows other claimers hold, job counts are folded from a table of
changes, and the servers tell each other of their changes with NOTIFY."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, Select, create_engine, event, func, make_url, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DisconnectionError

from gpufleet.store import schema as t
from gpufleet.store.api import Offers
from gpufleet.store.pages import Fitter
from gpufleet.store.postgres.claims import PostgresClaims
from gpufleet.store.postgres.pages import summed_in_sql
from gpufleet.store.sql.events import LINE_COLUMNS
from gpufleet.store.sql.jobs import AIMED_WHERE, JOB_COLUMNS
from gpufleet.store.sql.store import POOL_SIZE, SqlStore

IDLE_PING = 5.0  # seconds a pooled PostgreSQL connection may sit before it is checked
CHANNEL = "gpufleet_claimable"
TOKENS_CHANGED = "tokens"  # a NOTIFY payload on CHANNEL: drop cached tokens
SUPERSEDED = "poll"  # "poll REPLICA WORKER_ID": that worker polls anew; end its open poll
_FOLD = """
WITH gone AS (DELETE FROM job_count_deltas RETURNING pool, status, n)
INSERT INTO job_counts (pool, status, n)
SELECT pool, status, sum(n) FROM gone GROUP BY pool, status ORDER BY pool, status
ON CONFLICT (pool, status) DO UPDATE SET n = job_counts.n + excluded.n
"""


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


class PostgresStore(SqlStore):
    """The SQL store on PostgreSQL (psycopg 3)."""

    dialect = "postgresql"
    # PostgreSQL would walk the pending queue in claim order for the few aimed jobs: the
    # read is fenced off in a subquery (OFFSET 0), so it takes them from the partial index.
    aimed_jobs_sql = (
        f"SELECT {JOB_COLUMNS} FROM (SELECT * FROM jobs WHERE {AIMED_WHERE} "
        "OFFSET 0) aimed ORDER BY priority DESC, created_at, id"
    )

    def _make_engine(self, url: str) -> Engine:
        # Kept open: 20 per server process (4 replicas stay under PostgreSQL's default 100
        # connections); 20 more for bursts, closed when they end.
        engine = create_engine(url, pool_size=POOL_SIZE // 2, max_overflow=20)
        event.listen(engine, "checkout", _ping_if_idle)
        return engine

    def _begin_transaction(self, conn: Connection, job_ids: Sequence[str]) -> None:
        # The rows of the jobs the calls will change are locked first, in id order, as
        # every write of several jobs takes them: a transaction that holds some while it
        # waits for others cannot deadlock.
        if job_ids:
            j = t.jobs.c
            ids = sorted(set(job_ids))
            conn.execute(select(j.id).where(j.id.in_(ids)).order_by(j.id).with_for_update()).all()

    def _insert(self, table: Any) -> Any:
        return postgresql.insert(table)

    def _lock_rows(self, conn: Connection, q: Select[Any], read: bool = False) -> None:
        conn.execute(q.with_for_update(read=read)).all()

    def _insert_lines(self, conn: Connection, rows: list[tuple[str, int, str, str, float]]) -> None:
        """``COPY`` (a 5,000-line batch through SQLAlchemy took about 80 ms, which other
        requests waited behind)."""
        raw: Any = conn.connection.driver_connection
        table, columns = t.job_logs.name, ", ".join(t.job_logs.c[n].name for n in LINE_COLUMNS)
        with raw.cursor() as cur, cur.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)

    @property
    def page_fitter(self) -> Fitter:
        """A page of records read only as far as its byte budget: summed in the query."""
        return summed_in_sql

    @contextmanager
    def claiming(self) -> Iterator[PostgresClaims]:
        """One transaction: the reads and the write of one claim."""
        self._outside_transaction("a claim")
        with self.engine.begin() as conn:
            yield PostgresClaims(self, conn)

    def fold_job_counts(self) -> int:
        """Fold the count changes PostgreSQL's trigger appended into ``job_counts``; how
        many were folded. Replicas may fold at once: each change is deleted by exactly
        one of them, and the sums go in key order (two folds never wait on each other in
        a circle)."""
        with self._write() as conn:
            return int(conn.exec_driver_sql(_FOLD).rowcount or 0)

    def publish_claimable(self) -> None:
        """Tell other server replicas that a job may have become claimable (NOTIFY)."""
        with self.engine.begin() as conn:
            conn.exec_driver_sql(f"NOTIFY {CHANNEL}")

    def publish_tokens_changed(self) -> None:
        """Tell other server replicas that a token was rotated or revoked, so they drop
        what they cached of tokens now rather than when their cache expires."""
        with self.engine.begin() as conn:
            conn.exec_driver_sql(f"NOTIFY {CHANNEL}, '{TOKENS_CHANGED}'")

    def publish_superseded(self, worker_id: str, replica: str) -> None:
        """Tell other replicas that ``worker_id`` sent a poll replacing its open one."""
        with self.engine.begin() as conn:
            conn.execute(select(func.pg_notify(CHANNEL, f"{SUPERSEDED} {replica} {worker_id}")))

    @property
    def offers(self) -> Offers:
        """Claim sessions side by side, and other servers' changes heard (LISTEN)."""
        return Offers(claimers=8, listens=True)

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
