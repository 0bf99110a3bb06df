"""PostgreSQL's own SQL: the plans of a claim's reads, the row locks a batch takes, the
one connection a batch holds, and connections made again after a restart. Skips where no
PostgreSQL answers (CI requires one).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from gpufleet.errors import Forbidden
from gpufleet.server.services import Services
from gpufleet.store import Batch, PostgresStore, open_store
from gpufleet.store.postgres.claims import _FIRST_FREE
from gpufleet.store.postgres.claims import _VIEW as _VIEW_POSTGRES
from tests.queue_steps import T0, FakeClock, blob_service, claim, register, service, spec


@pytest.fixture
def store(pg_url: str) -> Iterator[PostgresStore]:
    """A PostgreSQL store migrated on a fresh schema."""
    s = open_store(pg_url)
    assert isinstance(s, PostgresStore)
    try:
        s.migrate()
        yield s
    finally:
        s.close()


@pytest.fixture
def queue(store: PostgresStore, tmp_path: Path) -> Services:
    """The queue over that store, on a clock that stands still."""
    return service(store, FakeClock(), blob_service(store, tmp_path))


def test_a_postgresql_claim_reads_no_more_than_the_jobs_it_needs(
    store: PostgresStore, queue: Services
) -> None:
    """With statistics that lag a large apply (here: none yet), PostgreSQL planned the
    claim's reads of the aimed jobs, and its pick of the chosen ids, as walks of every
    pending job: each claim cost O(queue) (about 2,000 index entries a claim in
    bench/claims.py). They must come from the target index and the primary key."""
    jobs = [(f"j-{n:04d}", spec(f"q{n}"), None) for n in range(400)]
    store.submit(Batch(jobs), T0)
    w = register(queue, "box").id
    ids = [f"j-{n:04d}" for n in range(200, 204)]

    def plan(sql: str, params: Any) -> str:
        with store.engine.connect() as conn:
            cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
            cursor.execute("EXPLAIN (FORMAT JSON) " + sql, params)
            return json.dumps(cursor.fetchone()[0])

    view = plan(_VIEW_POSTGRES, (T0, w))
    assert "ix_jobs_target" in view and "ix_jobs_queue" not in view, view
    pick = plan(_FIRST_FREE, (ids, ids))
    assert "jobs_pkey" in pick and "ix_jobs_queue" not in pick, pick
    fleet = plan(PostgresStore.aimed_jobs_sql, ())
    assert "ix_jobs_target" in fleet and "ix_jobs_queue" not in fleet, fleet


def test_a_postgresql_batch_holds_its_jobs_rows_before_it_writes(store: PostgresStore) -> None:
    """A batch of reports (a ``transaction``) locks its jobs' rows first, in id order, as a
    heartbeat extending several leases takes them: a batch that held one row while it
    waited for another could deadlock with a heartbeat taking them the other way."""
    store.submit(Batch([(f"j-{n}", spec(f"q{n}"), None) for n in range(3)]), T0)
    locked = "SELECT id FROM jobs WHERE id = '{}' FOR UPDATE NOWAIT"
    with store.transaction(["j-1", "j-0"]), store.engine.connect() as other:
        for held in ("j-0", "j-1"):  # before any write of the batch
            with pytest.raises(sa.exc.OperationalError, match="could not obtain lock"):
                other.exec_driver_sql(locked.format(held))
            other.rollback()
        other.exec_driver_sql(locked.format("j-2"))  # not one of the batch's
        other.rollback()


def test_a_postgresql_store_reconnects_after_its_connections_were_closed(
    store: PostgresStore, queue: Services, pg_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database restart closes every pooled connection. One idle for a while is checked
    before use, so the call after the restart is answered, not failed."""
    import psycopg

    import gpufleet.store.postgres.store as sql

    made = queue.submission.submit(spec("kept"))
    assert store.get_job(made.id) is not None  # a pooled connection now exists
    with store.engine.connect() as conn:
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    monkeypatch.setattr(sql, "IDLE_PING", 0.0)  # as if it had sat idle
    job = store.get_job(made.id)
    assert job is not None and job.name == "kept"


def test_a_batch_of_reports_takes_one_connection_however_cold_the_caches(
    store: PostgresStore, queue: Services
) -> None:
    """Each report of a batch is checked (the job, the worker holding it) and written
    through the batch's transaction, on its connection: no second one is taken while it
    is held. Forty batches at once taking a second each would fill the pool (40) and
    wait on each other until the pool's timeout."""
    store.submit(Batch([("j-1", spec("one"), None)]), T0)
    w = register(queue, "box")
    lease = claim(queue, w)
    worker = store.get_worker(w.id)
    assert worker is not None and worker.token_id is None
    taken: list[object] = []

    def counted(*_: object) -> None:
        taken.append(1)

    sa.event.listen(store.engine, "checkout", counted)
    try:
        queue.fleet.forget(w.id)  # the worker's row is read, not found in the cache
        with queue.transaction(["j-1"]) as tx:
            held = len(taken)
            holders = queue.holders.within(tx)
            with pytest.raises(Forbidden):  # its token is not the caller's
                holders.check("j-1", lease.attempt, "another-token", None, lease.secret)
            holders.refused_result("j-1", lease.attempt, "another-token", 1, None, lease.secret)
            assert len(taken) == held, "a second connection was taken inside the batch"
    finally:
        sa.event.remove(store.engine, "checkout", counted)
