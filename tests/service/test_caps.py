"""``server/caps.py``: caps on what a user or pool holds at once, and a pool's longest run.
A capped user's jobs wait while it holds its cap, others' jobs take the free slots, ``why``
names the cap and who holds it, a lowered cap ends no running job, and a job of a pool
with ``max_run`` gets that as its timeout."""

from __future__ import annotations

import random

from gpufleet.domain.models import JobStatus, Requirements
from gpufleet.domain.sharing import Share, Sharing
from gpufleet.scheduling.matching import FreeGpu, FreeResources
from gpufleet.server.blobs import BlobService
from gpufleet.server.services import Services
from gpufleet.server.sharing import SharingRules
from gpufleet.store import Store, WorkerRow
from tests.queue_steps import GIB, SETTINGS, FakeClock, job, register, spec

GPU1 = Requirements(gpu_count=1)


def _queue(store: Store, clock: FakeClock, blobs: BlobService, rules: Sharing) -> Services:
    return Services(
        store, SETTINGS, blobs, clock=lambda: clock.now, sharing=SharingRules(fixed=rules)
    )


def _gpus(n: int) -> FreeResources:
    return FreeResources(cpu_slots=1, gpus=tuple(FreeGpu(i, 80 * GIB) for i in range(n)))


def _held_gpus(store: Store, owner: str) -> int:
    return sum(len(r.gpus) for r in store.running_use() if r.owner == owner)


def _workers(q: Services, n: int, gpus: int) -> list[WorkerRow]:
    return [register(q, f"w{i}", gpus=[("A100", 80)] * gpus) for i in range(n)]


def test_a_user_capped_at_two_gpus_never_holds_three(
    store: Store, clock: FakeClock, blobs: BlobService
) -> None:
    """Three workers of two GPUs claim and finish jobs of alice (capped at 2 GPUs) and
    bob (no cap) for many rounds: alice never holds more than 2, bob's jobs take the
    GPUs she may not, and every job of both ends up run."""
    q = _queue(store, clock, blobs, Sharing(users={"alice": Share(max_gpus=2)}))
    workers = _workers(q, 3, 2)
    alice = [
        q.submission.submit(spec(f"a{i}", requirements=GPU1), by="alice").id for i in range(12)
    ]
    bob = [q.submission.submit(spec(f"b{i}", requirements=GPU1), by="bob").id for i in range(12)]
    rng = random.Random(35)
    running: list[tuple[str, int]] = []
    most = 0
    for _ in range(200):
        for w in rng.sample(workers, len(workers)):
            lease = q.dispatch.try_claim(w.id, _gpus(2))
            if lease is not None:
                q.leases.start(lease.job_id, lease.attempt)
                running.append((lease.job_id, lease.attempt))
            most = max(most, _held_gpus(store, "alice"))
            assert _held_gpus(store, "alice") <= 2
        if running:
            done = running.pop(rng.randrange(len(running)))
            q.leases.finish(done[0], done[1], 0, None)
        clock.advance(5)
        if not running and all(job(store, j).status.terminal for j in alice + bob):
            break
    assert most == 2
    assert all(job(store, j).status is JobStatus.SUCCEEDED for j in alice + bob)


def test_why_names_the_cap_and_who_holds_it(
    store: Store, clock: FakeClock, blobs: BlobService
) -> None:
    q = _queue(store, clock, blobs, Sharing(users={"alice": Share(max_gpus=2)}))
    (w,) = _workers(q, 1, 4)
    ids = [q.submission.submit(spec(f"a{i}", requirements=GPU1), by="alice").id for i in range(3)]
    for _ in range(2):
        assert q.dispatch.try_claim(w.id, _gpus(4)) is not None
    assert q.dispatch.try_claim(w.id, _gpus(4)) is None  # two GPUs free, but her cap
    waiting = next(i for i in ids if job(store, i).status is JobStatus.PENDING)
    _, summary, rows, _ = q.explain.why(waiting)
    held = "alice holds 2 of their 2 GPUs (cap users.alice.max_gpus)"
    assert summary == f"held back by a cap: {held} (place 1 in its queue)"
    assert [reasons for _, reasons in rows] == [[held]]


def test_why_names_the_cap_when_every_worker_is_busy_too(
    store: Store, clock: FakeClock, blobs: BlobService
) -> None:
    rules = Sharing(pools={"default": Share(max_gpus=1)})
    q = _queue(store, clock, blobs, rules)
    (w,) = _workers(q, 1, 1)
    ids = {q.submission.submit(spec(n, requirements=GPU1), by=n).id for n in ("alice", "bob")}
    lease = q.dispatch.try_claim(w.id, _gpus(1))
    assert lease is not None
    (waiting,) = ids - {lease.job_id}
    _, summary, _, _ = q.explain.why(waiting)
    assert "pool default holds 1 of its 1 GPU (cap pools.default.max_gpus)" in summary


def test_cpu_slots_are_capped_apart_from_gpus(
    store: Store, clock: FakeClock, blobs: BlobService
) -> None:
    q = _queue(store, clock, blobs, Sharing(users={"alice": Share(max_cpu_slots=1)}))
    workers = [register(q, f"c{i}") for i in range(3)]
    for i in range(3):
        q.submission.submit(spec(f"c{i}"), by="alice")
    bob = q.submission.submit(spec("bob's"), by="bob").id
    got = [q.dispatch.try_claim(w.id, FreeResources(cpu_slots=1)) for w in workers]
    assert sum(1 for r in store.running_use() if r.owner == "alice") == 1
    assert bob in {lease.job_id for lease in got if lease is not None}


def test_a_lowered_cap_ends_no_running_job_and_stops_new_claims(
    store: Store, clock: FakeClock, blobs: BlobService
) -> None:
    rules = SharingRules(fixed=Sharing(users={"alice": Share(max_gpus=4)}))
    q = Services(store, SETTINGS, blobs, clock=lambda: clock.now, sharing=rules)
    (w,) = _workers(q, 1, 8)
    ids = [q.submission.submit(spec(f"a{i}", requirements=GPU1), by="alice").id for i in range(6)]
    leases = [q.dispatch.try_claim(w.id, _gpus(8)) for _ in range(3)]
    for lease in leases:
        assert lease is not None
        q.leases.start(lease.job_id, lease.attempt)
    rules.set(Sharing(users={"alice": Share(max_gpus=1)}))
    clock.advance(10)
    q.upkeep.sweep()
    assert q.dispatch.try_claim(w.id, _gpus(8)) is None
    running = [j for j in ids if job(store, j).status is JobStatus.RUNNING]
    assert len(running) == 3
    pending = next(j for j in ids if job(store, j).status is JobStatus.PENDING)
    _, summary, _, _ = q.explain.why(pending)
    assert "alice holds 3 of their 1 GPU (cap users.alice.max_gpus)" in summary


def test_a_pools_max_run_is_the_timeout_of_its_jobs(
    store: Store, clock: FakeClock, blobs: BlobService
) -> None:
    rules = Sharing(pools={"default": Share(max_run=600.0)})
    q = _queue(store, clock, blobs, rules)
    w = register(q, "cpu")
    q.submission.submit(spec("long", timeout=7200.0))
    q.submission.submit(spec("short", timeout=60.0))
    q.submission.submit(spec("none"))
    got = {}
    for _ in range(3):
        lease = q.dispatch.try_claim(w.id, FreeResources(cpu_slots=1))
        assert lease is not None
        got[lease.spec.name] = (lease.spec.timeout, lease.max_run_of)
        q.leases.finish(lease.job_id, lease.attempt, 0, None)
    assert got == {
        "long": (600.0, "default"),
        "short": (60.0, None),
        "none": (600.0, "default"),
    }
