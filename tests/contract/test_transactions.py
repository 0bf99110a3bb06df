"""The unit of work (:meth:`Store.transaction`), on every backend: what its store writes
commits together or not at all, a savepoint undoes only itself, and the after-commit calls
run once the writes can be read, never after a rollback."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.domain.models import JobSpec, Requirements
from gpufleet.store import Batch, Store, WorkerRow, open_store

T0 = 1_700_000_000.0


def spec(name: str, worker: str | None = None) -> JobSpec:
    return JobSpec(name=name, command=("true",), requirements=Requirements(worker=worker))


def batch(*ids: str, worker: str | None = None) -> Batch:
    return Batch([(i, spec(i, worker), None) for i in ids])


def worker(store: Store, name: str = "box") -> WorkerRow:
    values = {
        "name": name,
        "pool": "default",
        "capability": '{"hostname": "box", "cores": 4, "ram_mib": 8192}',
        "cpu_slots": 1,
        "status": "available",
        "registered_at": T0,
    }
    store.upsert_worker("w-1", values)
    w = store.get_worker("w-1")
    assert w is not None
    return w


def claims(store: Store, w: WorkerRow) -> int:
    """How many claims the worker has made: a claim ranked before it moved is stale."""
    with store.claiming() as session:
        return session.view(w.id, w.name, w.pool, T0, 10).claims


def test_a_transactions_writes_commit_together_and_then_its_after_commit_calls_run(
    store: Store,
) -> None:
    seen: list[tuple[str, bool]] = []
    with store.transaction(["j-1", "j-2"]) as tx:
        tx.store.submit(batch("j-1"), T0)
        tx.after_commit(lambda: seen.append(("first", store.get_job("j-2") is not None)))
        assert tx.store.get_job("j-1") is not None  # read through it: its own write
        tx.store.submit(batch("j-2"), T0)
        tx.after_commit(lambda: seen.append(("second", store.get_job("j-1") is not None)))
        assert seen == []
    assert seen == [("first", True), ("second", True)]


def test_a_transaction_that_raises_leaves_nothing_and_tells_nothing(store: Store) -> None:
    seen: list[str] = []
    with pytest.raises(RuntimeError, match="half way"), store.transaction() as tx:
        tx.store.submit(batch("j-1"), T0)
        tx.after_commit(lambda: seen.append("told"))
        raise RuntimeError("half way")
    assert store.get_job("j-1") is None
    assert store.logs("j-1", 0, 10) == []  # nor its event log's records
    assert seen == []
    assert store.submit(batch("j-1"), T0).created == ["j-1"]  # and the store works on


def test_a_savepoint_that_raises_undoes_only_its_own_writes(store: Store) -> None:
    with store.transaction() as tx:
        tx.store.submit(batch("j-1"), T0)
        with pytest.raises(RuntimeError), tx.savepoint():
            tx.store.submit(batch("j-2"), T0)
            raise RuntimeError("this part fails")
        with tx.savepoint():
            tx.store.submit(batch("j-3"), T0)
    assert [store.get_job(i) is not None for i in ("j-1", "j-2", "j-3")] == [True, False, True]


def test_a_held_worker_gives_its_jobs_and_a_claim_ranked_before_ranks_again(
    store: Store,
) -> None:
    w = worker(store)
    store.submit(batch("j-aimed", worker="box"), T0)
    store.submit(batch("j-other"), T0)
    before = claims(store, w)
    with store.transaction() as tx:
        held = tx.store.hold_worker(w)
    assert [j.id for j in held] == ["j-aimed"]
    assert claims(store, w) == before + 1
    with pytest.raises(LookupError), store.transaction() as tx:
        tx.store.hold_worker(w)
        raise LookupError("refused after holding")
    assert claims(store, w) == before + 1  # rolled back with the rest


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_sql_transactions_store_refuses_a_claim_or_a_transaction_of_its_own(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A claim runs in a transaction of its own, taking the writer SQLite's transaction
    holds: asked inside one (which the types rule out), it is refused at once rather
    than waiting for itself."""
    url = f"sqlite:///{tmp_path}/s.db" if backend == "sqlite" else request.getfixturevalue("pg_url")
    s = open_store(url)
    try:
        s.migrate()
        with s.transaction() as tx:
            inside = tx.store
            with pytest.raises(RuntimeError, match="a claim cannot run inside a transaction"):
                inside.claiming().__enter__()  # type: ignore[attr-defined]
            with pytest.raises(RuntimeError, match="a transaction cannot run inside"):
                inside.transaction().__enter__()  # type: ignore[attr-defined]
    finally:
        s.close()
