"""The job store's contract, on the memory store, SQLite and PostgreSQL: batches written
whole, claims handed out once and in order, the lease protocol's writes, a job's output,
listings and counts, and dependents failed in the transaction that fails their
dependency. Driven through ``Services`` where that is how the store is used; the rules of
the services themselves are tested in ``tests/service``.

Time comes from a fake clock the tests advance; nothing here sleeps.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import pytest
import sqlalchemy as sa

from gpufleet.domain import lifecycle
from gpufleet.domain.models import JobStatus, Requirements, WorkerStatus
from gpufleet.scheduling.matching import FreeGpu, FreeResources
from gpufleet.server.services import Services
from gpufleet.store import Batch, Hosts, SqlStore, StaleClaim, Store, Submitted, WorkerRow
from gpufleet.store import schema as t
from gpufleet.wire import (
    HeartbeatRequest,
    HostModel,
    JobSpecModel,
    Lease,
    LeaseRef,
    ManifestApply,
    RequirementsModel,
)
from tests.queue_steps import (
    CPU,
    GIB,
    LEASE,
    OUT,
    T0,
    FakeClock,
    Together,
    claim,
    job,
    orders,
    register,
    spec,
)

# ---- batches -------------------------------------------------------------------------


def test_migrate_twice_is_harmless(store: Store) -> None:
    assert store.submit(Batch([("j-keep", spec(), None)]), T0).created == ["j-keep"]
    store.migrate()
    assert store.ping() == store.dialect
    assert job(store, "j-keep").status is JobStatus.PENDING
    assert store.submit(Batch([("j-new", spec("other"), None)]), T0).created == ["j-new"]


def test_a_batch_skips_existing_ids(store: Store) -> None:
    assert store.submit(Batch([("j-a", spec("a"), None)]), T0).created == ["j-a"]
    both = [("j-a", spec("changed"), None), ("j-b", spec("b"), None)]
    assert store.submit(Batch(both), T0 + 5) == Submitted(["j-b"], [])
    a = job(store, "j-a")
    assert a.name == "a"
    assert a.created_at == T0


def test_a_batch_is_written_whole_or_not_at_all(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An apply's grants, hosts, new jobs and changed pending jobs are one transaction:
    a failure half way (here, after the grants and hosts are written) leaves none of it."""
    blob = "b" * 64
    store.record_blob(blob, 10, T0)
    store.submit(Batch([("j-old", spec("old"), None)]), T0)
    batch = Batch(
        [("j-new", spec("new"), None), ("j-old", spec("old", priority=3), None)],
        grants={(blob, "default")},
        hosts=Hosts("plan", {"box": '{"priority": 2}'}),
        update=True,
    )
    real = store._insert_new

    def crash(*args: Any) -> list[str]:
        raise RuntimeError("the database went away")

    monkeypatch.setattr(store, "_insert_new", crash)
    with pytest.raises(RuntimeError):
        store.submit(batch, T0 + 1)
    assert store.get_job("j-new") is None
    assert job(store, "j-old").priority == 0
    assert store.hosts() == []
    assert not store.blob_readable(blob, ["default"])

    monkeypatch.setattr(store, "_insert_new", real)
    assert store.submit(batch, T0 + 2) == Submitted(["j-new"], ["j-old"])
    assert job(store, "j-old").priority == 3
    assert [(h.name, h.manifest, h.updated_at) for h in store.hosts()] == [("box", "plan", T0 + 2)]
    assert store.blob_readable(blob, ["default"])


def test_two_applies_changing_the_same_jobs_in_opposite_orders_both_succeed(
    store: Store,
) -> None:
    """Each locks the pending jobs it changes in id order, whatever the manifest's order:
    two applies wait for each other instead of deadlocking (a 500 on PostgreSQL)."""
    ids = [f"j-{n:04d}" for n in range(600)]
    store.submit(Batch([(i, spec(i), None) for i in ids]), T0)

    def apply(order: list[str], priority: int) -> None:
        jobs = [(i, spec(i, priority=priority), None) for i in order]
        store.submit(Batch(jobs, update=True), T0)

    for round_ in range(1, 4):
        both = Together()
        both.start(apply, ids, 2 * round_)
        both.start(apply, ids[::-1], 2 * round_ + 1)
        both.join()
        assert {job(store, i).priority for i in ids} <= {2 * round_, 2 * round_ + 1}


def test_reapplying_a_changed_manifest_updates_pending_jobs_only(
    store: Store, queue: Services
) -> None:
    def plan(priority: int, vram: float) -> ManifestApply:
        jobs = [
            JobSpecModel(
                name=n,
                command=["true"],
                manifest="m",
                priority=priority,
                requirements=RequirementsModel(min_vram_gib=vram),
            )
            for n in ("a", "b")
        ]
        return ManifestApply(name="m", jobs=jobs, hosts=[HostModel(name="ghost")])

    first = queue.submission.apply(plan(0, 0))
    assert first.unknown_hosts == ["ghost"]
    w = register(queue, "cpu")
    running = claim(queue, w)
    second = queue.submission.apply(plan(5, 8))
    pending = next(i for i in first.created if i != running.job_id)
    assert second.updated == [pending] and second.unchanged == [running.job_id]
    assert job(store, pending).priority == 5
    assert job(store, pending).spec.requirements.min_vram_gib == 8
    assert job(store, running.job_id).spec.requirements.min_vram_gib == 0
    third = queue.submission.apply(plan(5, 8))
    assert third.updated == [] and sorted(third.unchanged) == sorted(first.created)


def test_job_spec_round_trips(store: Store, queue: Services) -> None:
    original = spec(
        "rt",
        hyper={"lr": 0.1, "layers": [1, 2]},
        env={"SEED": "1"},
        requirements=Requirements(
            require_cuda=True,
            min_vram_gib=12.5,
            labels={"gpu_type": "a100*"},
            allowed_hosts=("lab-*",),
        ),
        priority=7,
        max_attempts=5,
        timeout=90.0,
        pool="vision",
    )
    row = queue.submission.submit(original)
    assert row.spec == original
    assert (row.priority, row.pool, row.max_attempts) == (7, "vision", 5)


def test_a_stored_spec_the_api_would_refuse_now_is_still_listed_and_claimed(
    store: Store, queue: Services
) -> None:
    """Rows are read by the store's own tolerant models: a key a newer version wrote, or a
    value the API has since tightened, never makes a job unreadable (or a claim answer 500)."""
    w = register(queue, "w1")
    submitted = queue.submission.submit(spec())
    text = json.loads(job(store, submitted.id).spec_json)
    text.update(max_attempts=5000, a_later_field={"x": 1})
    text["requirements"]["another"] = True
    if isinstance(store, SqlStore):
        with store.engine.begin() as conn:
            conn.execute(
                sa.update(t.jobs).where(t.jobs.c.id == submitted.id).values(spec=json.dumps(text))
            )
    else:
        store.jobs[submitted.id]["spec"] = json.dumps(text)  # type: ignore[attr-defined]
    assert [j.spec.max_attempts for j in store.list_jobs()] == [5000]
    lease = claim(queue, w)
    assert lease.job_id == submitted.id


# ---- claiming ------------------------------------------------------------------------


def test_claim_hands_out_a_lease_once(store: Store, queue: Services) -> None:
    w1, w2 = register(queue, "w1"), register(queue, "w2")
    submitted = queue.submission.submit(spec())
    lease = claim(queue, w1)
    assert lease.job_id == submitted.id
    assert lease.attempt == 1
    assert lease.gpus == []
    assert lease.spec.name == "train"
    assert lease.lease_timeout == LEASE
    row = job(store, submitted.id)
    assert row.status is JobStatus.CLAIMED
    assert row.worker_id == w1.id
    assert row.claimed_at == T0
    assert row.lease_expires_at == T0 + LEASE
    assert queue.dispatch.try_claim(w2.id, CPU) is None
    assert queue.dispatch.try_claim(w1.id, CPU) is None


def test_claim_records_the_best_fitting_gpu(store: Store, queue: Services) -> None:
    w = register(queue, "gpu-box", gpus=[("NVIDIA A100-SXM4-80GB", 80), ("NVIDIA L4", 24)])
    submitted = queue.submission.submit(
        spec("gpu", requirements=Requirements(require_cuda=True, min_vram_gib=16))
    )
    free = FreeResources(cpu_slots=1, gpus=(FreeGpu(0, 80 * GIB), FreeGpu(1, 24 * GIB)))
    lease = claim(queue, w, free)
    assert lease.gpus == [1]
    assert job(store, submitted.id).gpus == (1,)
    [attempt] = store.attempts(submitted.id)
    assert attempt.gpus == (1,)
    assert attempt.worker_name == "gpu-box"


def test_concurrent_claims_hand_out_exactly_one_lease(store: Store, queue: Services) -> None:
    n = 32
    workers = [register(queue, f"w{i:02d}") for i in range(n)]
    submitted = queue.submission.submit(spec())
    barrier = threading.Barrier(n, timeout=30)
    results: list[Lease | None] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(w: WorkerRow) -> None:
        try:
            barrier.wait()
            got = queue.dispatch.try_claim(w.id, CPU)
            with lock:
                results.append(got)
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in workers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "a claimer hung"
    assert errors == []
    leases = [r for r in results if r is not None]
    assert len(results) == n
    assert len(leases) == 1
    assert leases[0].attempt == 1
    row = job(store, submitted.id)
    assert row.status is JobStatus.CLAIMED
    assert row.lease == 1
    assert len(store.attempts(submitted.id)) == 1


def test_claims_go_by_priority_then_age(queue: Services, clock: FakeClock) -> None:
    w = register(queue, "w1", cpu_slots=4)
    old = queue.submission.submit(spec("old", priority=0))
    clock.advance(1)
    young = queue.submission.submit(spec("young", priority=0))
    clock.advance(1)
    urgent = queue.submission.submit(spec("urgent", priority=5))
    clock.advance(1)
    low = queue.submission.submit(spec("low", priority=-1))
    order = [claim(queue, w).job_id for _ in range(4)]
    assert order == [urgent.id, old.id, young.id, low.id]
    assert queue.dispatch.try_claim(w.id, CPU) is None


def test_a_slot_the_server_knows_is_held_is_never_handed_out_again(
    queue: Services,
) -> None:
    """A poll sent before its worker's last claim was answered still says the slot is
    free; the server knows better, on both slots and GPUs."""
    w = register(queue, "w1", gpus=[("NVIDIA T4", 16)], cpu_slots=1)
    for _ in range(4):
        queue.submission.submit(spec())
        queue.submission.submit(spec(requirements=Requirements(require_cuda=True)))
    everything = FreeResources(cpu_slots=1, gpus=(FreeGpu(0, 16 * GIB),))
    first = claim(queue, w, everything)
    second = claim(queue, w, everything)
    assert sorted([first.gpus, second.gpus]) == [[], [0]]  # the CPU slot and the GPU
    assert queue.dispatch.try_claim(w.id, everything) is None  # a stale view changes nothing


def test_a_claim_ranked_on_a_stale_snapshot_takes_nothing(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    """Two polls of one worker rank on the same snapshot: the first claim commits, and the
    second, which counted on the slot the first took, changes nothing and ranks again."""
    w = register(queue, "w1")
    first, second = queue.submission.submit(spec("a")), queue.submission.submit(spec("b"))
    take = [
        lifecycle.claim(job(store, j.id), w.id, w.name, (), clock.now, clock.now + LEASE)
        for j in (first, second)
    ]
    with store.claiming() as one, store.claiming() as two:
        view = one.view(w.id, w.name, w.pool, clock.now, 4)
        assert two.view(w.id, w.name, w.pool, clock.now, 4) == view
        assert one.claim(w.id, view.claims, take[:1]) == first.id
    with pytest.raises(StaleClaim), store.claiming() as two:
        two.claim(w.id, view.claims, take[1:])
    assert job(store, first.id).status is JobStatus.CLAIMED
    assert job(store, second.id).status is JobStatus.PENDING
    assert store.attempts(second.id) == []
    # ranked again, the worker's one CPU slot is seen as held
    assert queue.dispatch.try_claim(w.id, CPU) is None
    with store.claiming() as session:
        assert session.view(w.id, w.name, w.pool, clock.now, 4).held == [()]


def test_a_claim_ranked_on_a_spec_a_manifest_changed_since_takes_nothing(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    w = register(queue, "w1")
    submitted = queue.submission.submit(spec("a"))
    ranked = job(store, submitted.id)
    now, expires, spec_json = clock.now, clock.now + LEASE, ranked.spec_json
    guarded = lifecycle.claim(ranked, w.id, w.name, (), now, expires, spec_json)
    changed = store.submit(Batch([(submitted.id, spec("a", priority=5), None)], update=True), T0)
    assert changed == Submitted([], [submitted.id])
    with store.claiming() as session:
        view = session.view(w.id, w.name, w.pool, clock.now, 4)
        assert session.claim(w.id, view.claims, [guarded]) is None
    assert job(store, submitted.id).status is JobStatus.PENDING
    lease = claim(queue, w)  # ranked again, on the spec it has now
    assert lease.job_id == submitted.id and lease.spec.priority == 5


def test_a_job_aimed_at_a_worker_makes_a_claim_ranked_before_it_rank_again(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    w = register(queue, "w1")
    pool_job = queue.submission.submit(spec("pool-job"))
    with store.claiming() as session:
        view = session.view(w.id, w.name, w.pool, clock.now, 4)
    row = job(store, pool_job.id)
    change = lifecycle.claim(row, w.id, w.name, (), clock.now, clock.now + LEASE)
    change = dataclasses.replace(change, guard={"spec": row.spec_json})
    aimed = queue.submission.submit(
        spec("aimed", requirements=Requirements(worker="w1")), wait_for_target=False
    )
    with pytest.raises(StaleClaim), store.claiming() as session:
        session.claim(w.id, view.claims, [change])
    assert claim(queue, w).job_id == aimed.id  # its slot went to the job aimed at it


# ---- the lease protocol and output ---------------------------------------------------


def test_lease_protocol_happy_path(store: Store, queue: Services, clock: FakeClock) -> None:
    w = register(queue, "w1")
    submitted = queue.submission.submit(spec())
    lease = claim(queue, w)
    clock.advance(1)
    queue.leases.start(lease.job_id, lease.attempt)
    row = job(store, submitted.id)
    assert row.status is JobStatus.RUNNING
    assert row.started_at == T0 + 1
    # A retried start (its answer was lost) is accepted and changes nothing.
    clock.advance(1)
    queue.leases.start(lease.job_id, lease.attempt)
    assert job(store, submitted.id).started_at == T0 + 1
    clock.advance(-1)

    clock.advance(20)
    resp = queue.leases.heartbeat(
        w.id, HeartbeatRequest(leases=[LeaseRef(job_id=lease.job_id, attempt=lease.attempt)])
    )
    assert orders(resp) == {lease.job_id: "continue"}
    assert job(store, submitted.id).lease_expires_at == T0 + 21 + LEASE
    assert queue.fleet.state_of(queue.fleet.worker(w.id)).status is WorkerStatus.BUSY

    queue.leases.append_logs(
        lease.job_id, lease.attempt, [("stdout", "epoch 1"), ("stderr", "warn")]
    )
    queue.leases.append_logs(lease.job_id, lease.attempt, [("stdout", "epoch 2")])
    logs = store.logs(submitted.id, after=0, limit=100, streams=OUT)
    assert [(x.stream, x.line, x.attempt) for x in logs] == [
        ("stdout", "epoch 1", 1),
        ("stderr", "warn", 1),
        ("stdout", "epoch 2", 1),
    ]
    assert [x.seq for x in logs] == sorted(x.seq for x in logs)
    assert [x.line for x in store.logs(submitted.id, after=logs[0].seq, limit=1, streams=OUT)] == [
        "warn"
    ]

    clock.advance(5)
    done = queue.leases.finish(lease.job_id, lease.attempt, exit_code=0, error=None)
    assert done.status is JobStatus.SUCCEEDED
    assert done.attempts == 1
    assert done.exit_code == 0
    assert done.error is None
    assert done.finished_at == T0 + 26
    assert done.lease_expires_at is None
    [attempt] = store.attempts(submitted.id)
    assert (attempt.outcome, attempt.exit_code, attempt.finished_at) == ("succeeded", 0, T0 + 26)
    assert attempt.started_at == T0 + 1


def test_a_batch_of_output_sent_again_is_stored_once(store: Store, queue: Services) -> None:
    """A worker whose upload's answer was lost sends the batch again, naming its first
    line: the lines the server has are skipped, the rest appended."""
    w = register(queue, "w1")
    queue.submission.submit(spec())
    lease = claim(queue, w)
    send = partial(queue.leases.append_logs, lease.job_id, lease.attempt)
    send([("stdout", "a"), ("stdout", "b")], 0)
    send([("stdout", "a"), ("stdout", "b")], 0)  # its answer was lost
    send([("stdout", "b"), ("stdout", "c")], 1)  # overlapping: only c is new
    send([("stderr", "d")], None)  # no first line named: after what is there
    send([("stdout", "e")], 4)
    send([("stdout", "e")], 4)
    lines = [(x.stream, x.line) for x in store.logs(lease.job_id, after=0, limit=100, streams=OUT)]
    assert lines == [("stdout", "a"), ("stdout", "b"), ("stdout", "c"), ("stderr", "d"),
                     ("stdout", "e")]  # fmt: skip


def test_a_log_read_back_from_before_a_record(queue: Services, store: Store) -> None:
    submitted = queue.submission.submit(spec())
    lease = claim(queue, register(queue, "box"))
    lines = [("stdout", f"l{i}") for i in range(10)]
    assert store.append_logs(submitted.id, lease.attempt, lines, 0.0).held
    out = store.logs(submitted.id, 0, 100, ["stdout"])
    assert [r.line for r in out] == [f"l{i}" for i in range(10)]
    back = store.logs(submitted.id, 0, 3, ["stdout"], before=out[6].seq)
    assert [r.line for r in back] == ["l3", "l4", "l5"]
    assert store.logs(submitted.id, 0, 3, None, before=out[0].seq)[-1].stream == "state"


def test_a_log_read_within_a_byte_budget_stops_at_the_line_that_fills_it(
    queue: Services, store: Store
) -> None:
    """A read with a budget holds the records up to the one that takes their lines to
    the budget (it included, so a line longer than the budget is still read, alone);
    reading on from its last record misses nothing. Sizes are UTF-8 bytes: "é" is two."""
    submitted = queue.submission.submit(spec())
    lease = claim(queue, register(queue, "box"))
    sizes = [300, 300, 500, 2000, 10, 10, 10]
    lines = [("stdout", str(i) * n) for i, n in enumerate(sizes[:-1])] + [("stdout", "é" * 5)]
    assert store.append_logs(submitted.id, lease.attempt, lines, 0.0).held
    out = ["stdout"]

    def pages(budget: int) -> list[list[int]]:
        got, after = [], 0
        for _ in range(10):
            page = store.logs(submitted.id, after, 100, out, budget=budget)
            if not page:
                return got
            got.append([len(r.line.encode()) for r in page])
            after = page[-1].seq
        raise AssertionError(got)

    assert pages(1000) == [[300, 300, 500], [2000], [10, 10, 10]]
    assert pages(600) == [[300, 300], [500, 2000], [10, 10, 10]]
    assert pages(1) == [[n] for n in sizes]
    assert store.logs(submitted.id, 0, 2, out, budget=10_000) == store.logs(submitted.id, 0, 2, out)
    # scrolled back: the newest records before the mark, within the budget, in order
    every = store.logs(submitted.id, 0, 100, out)
    back = store.logs(submitted.id, 0, 100, out, before=every[4].seq, budget=2400)
    assert [len(r.line) for r in back] == [500, 2000]
    events = store.state_events(0, 100, budget=1)
    assert len(events) == 1 and events[0][0].stream == "state"


# ---- listings and counts -------------------------------------------------------------


def test_jobs_page_back_by_cursor_and_filter_by_name(
    queue: Services, store: Store, clock: FakeClock
) -> None:
    made = []
    for name in [f"run-{i}" for i in range(7)] + ["Other_50%"]:
        made.append(queue.submission.submit(spec(name)))
        clock.advance(1)
    newest = store.list_jobs(limit=3)
    assert [j.id for j in newest] == [j.id for j in made[-3:]]
    cursor = (newest[0].created_at, newest[0].id)
    assert [j.id for j in store.list_jobs(limit=3, before=cursor)] == [j.id for j in made[2:5]]
    assert [j.name for j in store.list_jobs(name="other_50%")] == ["Other_50%"]
    # LIKE's wildcards are matched as themselves
    assert [j.name for j in store.list_jobs(name="_5")] == ["Other_50%"]
    assert [j.name for j in store.list_jobs(name="%")] == ["Other_50%"]
    assert store.list_jobs(name="n-_") == []
    assert store.job_counts(name="RUN-") == {"pending": 7}


def test_job_counts_follow_every_change_and_a_fold(queue: Services, store: Store) -> None:
    """``status`` and the jobs list read counts the database keeps as jobs change; they
    must always equal the jobs counted one by one, before and after a fold."""
    w = register(queue, "box", cpu_slots=4)
    ids = [queue.submission.submit(spec(f"j{i}")).id for i in range(5)]
    queue.submission.submit(spec("other", pool="gpu"))
    first, second = claim(queue, w), claim(queue, w)
    queue.leases.start(first.job_id, first.attempt)
    queue.leases.finish(first.job_id, first.attempt, 0, None)
    queue.leases.finish(second.job_id, second.attempt, 3, "boom")  # retries: pending
    queue.steering.cancel(next(i for i in ids if i not in (first.job_id, second.job_id)))

    def counted(pools: Sequence[str] | None = None) -> dict[str, int]:
        rows = store.list_jobs(limit=100, pools=pools)
        return {s: sum(j.status.value == s for j in rows) for s in {j.status.value for j in rows}}

    for _ in range(2):  # as written, then folded in
        assert store.job_counts() == counted() == {"pending": 4, "succeeded": 1, "cancelled": 1}
        assert store.job_counts(["gpu"]) == counted(["gpu"]) == {"pending": 1}
        gauges = store.queue_gauges().jobs
        assert gauges[("pending", "default")] == 3 and gauges[("pending", "gpu")] == 1
        store.fold_job_counts()


# ---- dependency cascades -------------------------------------------------------------


def test_a_failure_fails_a_chain_of_5000_dependents_at_once(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    w = register(queue, "w1")
    root = queue.submission.submit(spec("root", max_attempts=1))
    ids = [f"chain-{i:04d}" for i in range(5000)]
    before = [root.id, *ids[:-1]]
    chain = [(i, spec(f"step{n}"), None) for n, i in enumerate(ids)]
    deps = {i: [d] for i, d in zip(ids, before, strict=True)}
    store.submit(Batch(chain, deps=deps), clock.now)
    assert job(store, ids[0]).waiting == 1
    lease = claim(queue, w)
    assert lease.job_id == root.id  # the chain waits; nothing of it is claimable

    clock.advance(5)
    queue.leases.finish(root.id, lease.attempt, 3, None)

    rows = store.list_jobs(limit=6000)
    assert {r.status for r in rows} == {JobStatus.FAILED}
    first, second, last = job(store, ids[0]), job(store, ids[1]), job(store, ids[-1])
    assert first.error == f"dependency root ({root.id}) failed: exit code 3"
    assert second.error is not None
    assert second.error.startswith(f"dependency step0 ({ids[0]}) failed: dependency root")
    assert last.error is not None
    assert last.error.startswith(f"dependency step4998 ({ids[-2]}) failed")
    assert last.finished_at == clock.now


def test_a_job_submitted_after_its_dependency_failed_fails_at_once(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    root = queue.submission.submit(spec("prep"))
    queue.steering.cancel(root.id)
    two = [("a", spec("a"), None), ("b", spec("b"), None)]
    store.submit(Batch(two, deps={"a": [root.id], "b": ["a"]}), clock.now)
    assert job(store, "a").error == f"dependency prep ({root.id}) cancelled: cancelled"
    assert job(store, "b").status is JobStatus.FAILED
    assert job(store, "b").error == "dependency a (a) failed: " + str(job(store, "a").error)


def test_a_crash_during_the_cascade_leaves_the_finish_undone_too(
    store: Store, queue: Services, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finish and the failures it causes are one transaction: a crash half way
    through leaves the job held by its lease and every dependent pending, so the
    worker's retried finish (or the sweep) does it all again."""
    w = register(queue, "w1")
    root = queue.submission.submit(spec("root", max_attempts=1))
    ids = ["d1", "d2", "d3"]
    chain = [(i, spec(i), None) for i in ids]
    store.submit(Batch(chain, deps={"d1": [root.id], "d2": ["d1"], "d3": ["d2"]}), clock.now)
    lease = claim(queue, w)
    real = lifecycle.dependency_failed
    calls = []

    def crash_on_the_second(job: Any, dep: Any, now: float) -> Any:
        calls.append(job.id)
        if len(calls) == 2:
            raise RuntimeError("the server died here")
        return real(job, dep, now)

    monkeypatch.setattr(lifecycle, "dependency_failed", crash_on_the_second)
    with pytest.raises(RuntimeError):
        queue.leases.finish(root.id, lease.attempt, 1, None)
    assert job(store, root.id).status is JobStatus.CLAIMED
    assert [job(store, i).status for i in ids] == [JobStatus.PENDING] * 3

    monkeypatch.setattr(lifecycle, "dependency_failed", real)
    queue.leases.finish(root.id, lease.attempt, 1, None)
    assert [job(store, i).status for i in ids] == [JobStatus.FAILED] * 3
