"""SQLite's own SQL: the plans of a claim's reads and of the jobs list, and its one writer."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from gpufleet.store import SqliteStore, open_store
from gpufleet.store.sqlite.store import _VIEW as _VIEW_SQLITE
from tests.queue_steps import T0, FakeClock, blob_service, service


def test_claims_read_the_queue_in_the_order_of_its_index(tmp_path: Path) -> None:
    """The claim page walks ix_jobs_queue in claim order. A migration that rebuilt the
    table once dropped the index's "priority DESC", and every claim then sorted the whole
    queue (claims went from about 560 to 200 a second). SQLite only: its plan does not
    depend on the table's size, PostgreSQL's does."""
    store = open_store(f"sqlite:///{tmp_path}/plan.db")
    store.migrate()
    params = {"pool": "default", "now": T0, "p": 0, "c": T0, "i": "j-1", "n": 8}

    def plan(statement: Any) -> str:
        compiled = statement.compile(store.engine)
        values = compiled.construct_params(params)
        with store.engine.connect() as conn:
            rows = conn.exec_driver_sql(
                f"EXPLAIN QUERY PLAN {compiled}",
                tuple(values[k] for k in compiled.positiontup or ()),
            ).all()
        return " | ".join(str(row[-1]) for row in rows)

    head, after = store.page_q
    steps = plan(head)
    assert "ix_jobs_queue" in steps and "TEMP B-TREE" not in steps, steps
    # The next page starts where the last one ended (the position is in the index's
    # search, not a filter on a walk from the queue's head); only its own 2 x 8 rows
    # are sorted.
    steps = plan(after)
    assert (
        "USING INDEX ix_jobs_queue (status=? AND pool=? AND priority=? AND (created_at,id)>(?,?))"
        in steps
    ), steps
    assert "USING INDEX ix_jobs_queue (status=? AND pool=? AND priority<?)" in steps, steps
    # The jobs aimed at the claiming worker come from the small partial index, not from a
    # walk of the whole queue (which made every claim cost O(pending jobs)).
    with store.engine.connect() as conn:
        aimed = conn.exec_driver_sql(
            f"EXPLAIN QUERY PLAN {_VIEW_SQLITE}", ("w-1", "w-1", "box", "default", T0, "w-1")
        ).all()
    assert "ix_jobs_target" in " | ".join(str(row[-1]) for row in aimed), aimed
    # So do every worker's aimed jobs, read for `status` and each worker's free slots (a
    # walk of the queue made `status` cost 150 ms with 100,000 jobs pending)
    with store.engine.connect() as conn:
        fleet = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {SqliteStore.aimed_jobs_sql}").all()
    steps = " | ".join(str(row[-1]) for row in fleet)
    assert "ix_jobs_target" in steps and "ix_jobs_queue" not in steps, steps
    # The jobs list's newest page reads 50 rows of an index, never sorts every job
    listed: list[str] = []
    sa.event.listen(
        store.engine, "before_cursor_execute", lambda *a: listed.append(a[2]), named=False
    )
    store.list_jobs(limit=50)
    with store.engine.connect() as conn:
        newest = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {listed[-1]}", (50, 0)).all()
    steps = " | ".join(str(row[-1]) for row in newest)
    assert "ix_jobs_created" in steps and "TEMP B-TREE" not in steps, steps
    store.close()


def test_a_write_outside_the_transaction_its_thread_is_in_is_refused_not_a_hang(
    tmp_path: Path,
) -> None:
    """SQLite has one writer, and a transaction holds it. A write the same thread makes
    through the store itself rather than through the transaction's store would wait for
    its own transaction forever (the server's thread hung); it is refused at once, the
    transaction rolls back, and the store works on. Another thread's write still waits
    its turn and goes in."""
    store = open_store(f"sqlite:///{tmp_path}/one.db")
    try:
        store.migrate()
        done: list[str] = []
        refused = pytest.raises(RuntimeError, match="holds SQLite's writer already")
        with refused, store.transaction() as tx:
            tx.store.record_blob("a" * 64, 1, T0)
            waiting = threading.Thread(target=lambda: done.append(store.server_key("k", "v")))
            waiting.start()
            store.record_blob("b" * 64, 1, T0)  # not through tx.store
        waiting.join(10)
        assert done == ["v"]  # the other thread's write went in once the writer was free
        assert store.get_blob("a" * 64) is None  # the transaction rolled back
        store.record_blob("c" * 64, 1, T0)
        assert store.get_blob("c" * 64) is not None
    finally:
        store.close()


def test_the_lease_key_is_made_before_a_transaction_never_inside_one(tmp_path: Path) -> None:
    """The fleet's lease key is made by the first server to need it: a batch of reports
    checking attempts' secrets on a database that has none yet (one upgraded with jobs
    running) makes it before its transaction begins, not inside it."""
    store = open_store(f"sqlite:///{tmp_path}/keys.db")
    try:
        store.migrate()
        blobs = blob_service(store, tmp_path)
        q = service(store, FakeClock(), blobs)
        with q.transaction() as tx:
            holders = q.holders.within(tx)
            assert not holders.secrets.holds("gl_forged", "j-1", 1, T0)
        assert store.server_key("lease", "another") != "another"  # made, and kept
    finally:
        store.close()
