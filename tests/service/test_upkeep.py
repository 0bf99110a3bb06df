"""``server/upkeep.py``: the sweep. A lease not kept is lost: its job is requeued (or
failed, once it has lost its machine too often, and its dependents with it), its silent
worker goes offline, and an ephemeral worker gone past its TTL is forgotten.
"""

from __future__ import annotations

import dataclasses

import pytest

from gpufleet.domain.models import JobStatus, WorkerStatus
from gpufleet.errors import NotFound
from gpufleet.server.blobs import BlobService
from gpufleet.server.services import Services
from gpufleet.store import Batch, Store
from gpufleet.wire import CapabilityModel, WorkerRegister
from tests.queue_steps import GIB, LEASE, SETTINGS, T0, FakeClock, claim, job, register, spec


def test_sweep_requeues_an_expired_lease(store: Store, queue: Services, clock: FakeClock) -> None:
    w = register(queue, "silent-box")
    submitted = queue.submission.submit(spec())
    lease = claim(queue, w)
    queue.leases.start(lease.job_id, lease.attempt)

    clock.advance(LEASE - 1)
    assert queue.upkeep.sweep() == ([], [])
    assert job(store, submitted.id).status is JobStatus.RUNNING

    clock.advance(2)
    requeued, offline = queue.upkeep.sweep()
    assert requeued == [submitted.id]
    assert offline == [w.id]
    row = job(store, submitted.id)
    assert row.status is JobStatus.PENDING
    assert (row.attempts, row.losses) == (0, 1)  # its machine's loss, not its own failure
    assert row.worker_id is None
    assert row.error is not None
    assert "lease lost" in row.error
    assert "silent-box" in row.error
    [attempt] = store.attempts(submitted.id)
    assert attempt.outcome == "lost"
    assert queue.fleet.worker(w.id).status is WorkerStatus.OFFLINE
    assert queue.upkeep.sweep() == ([], [])  # nothing left to expire
    # a live worker picks the job up again as attempt 2
    again = claim(queue, register(queue, "live-box"))
    assert (again.job_id, again.attempt) == (submitted.id, 2)


def test_a_lost_lease_is_not_counted_against_max_attempts(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    w = register(queue, "w1")
    submitted = queue.submission.submit(spec(max_attempts=1))
    claim(queue, w)  # claimed, never started
    clock.advance(LEASE + 1)
    requeued, offline = queue.upkeep.sweep()
    assert requeued == [submitted.id]
    assert offline == [w.id]
    row = job(store, submitted.id)
    assert row.status is JobStatus.PENDING, "its machine's loss, not its own failure"
    assert (row.attempts, row.losses) == (0, 1)
    [attempt] = store.attempts(submitted.id)
    assert attempt.cause == "lost"


def test_sweep_fails_a_job_that_keeps_losing_its_machines(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    queue.leases.settings = dataclasses.replace(queue.leases.settings, max_losses=2)
    submitted = queue.submission.submit(spec(max_attempts=5))
    for n in (1, 2):
        claim(queue, register(queue, f"w{n}"))
        clock.advance(LEASE + 1)
        assert queue.upkeep.sweep()[0] == [submitted.id]
    row = job(store, submitted.id)
    assert row.status is JobStatus.FAILED
    assert (row.attempts, row.losses) == (0, 2)
    assert row.finished_at == clock.now
    assert row.error is not None
    assert "lease lost" in row.error and "lost its machine 2 times" in row.error


def test_a_lost_lease_fails_dependents_naming_the_final_status(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    queue.leases.settings = dataclasses.replace(queue.leases.settings, max_losses=1)
    w = register(queue, "gone-box")
    root = queue.submission.submit(spec("prep", max_attempts=1))
    after = [("after-prep", spec("train"), None)]
    store.submit(Batch(after, deps={"after-prep": [root.id]}), clock.now)
    claim(queue, w)
    clock.advance(LEASE + 1)
    assert queue.upkeep.sweep()[0] == [root.id]
    dependent = job(store, "after-prep")
    assert dependent.status is JobStatus.FAILED
    assert dependent.error is not None
    assert dependent.error.startswith(f"dependency prep ({root.id}) failed: lease lost")
    assert "running" not in dependent.error and "claimed" not in dependent.error


def test_a_worker_s_life_is_swept_and_every_step_is_an_event(
    store: Store, clock: FakeClock, blobs: BlobService
) -> None:
    events: list[tuple[str, str]] = []
    settings = dataclasses.replace(SETTINGS, ephemeral_ttl=60.0)
    q = Services(
        store,
        settings,
        blobs,
        clock=lambda: clock.now,
        on_event=lambda event, target, detail, token: events.append((event, target)),
    )
    cap = CapabilityModel(hostname="h", cores=1, ram_mib=GIB)
    once = q.fleet.register(
        WorkerRegister(name="once", capability=cap, ephemeral=True), "default", None
    )
    keep = register(q, "keep")
    submitted = q.submission.submit(spec())
    lease = claim(q, keep)
    clock.advance(LEASE + 1)
    requeued, offline = q.upkeep.sweep()
    assert requeued == [submitted.id] and set(offline) == {once.id, keep.id}
    assert q.fleet.worker(keep.id).offline_since == T0  # gone since its last sign of life
    clock.advance(61)
    q.upkeep.sweep()
    with pytest.raises(NotFound):
        q.fleet.worker(once.id)  # ephemeral, gone past its TTL: forgotten
    assert q.fleet.worker(keep.id).status is WorkerStatus.OFFLINE  # persistent: stays
    q.upkeep.sweep()  # a second sweep (or a second replica) changes nothing more
    assert sorted(events) == sorted(
        [
            ("worker.registered", once.id),
            ("worker.registered", keep.id),
            ("lease.lost", lease.job_id),
            ("worker.offline", once.id),
            ("worker.offline", keep.id),
            ("worker.removed", once.id),
        ]
    )
