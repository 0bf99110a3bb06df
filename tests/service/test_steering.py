"""``server/steering.py``: an operator's cancel and requeue, and the states each is refused
in.
"""

from __future__ import annotations

import pytest

from gpufleet.domain.models import JobStatus
from gpufleet.errors import Conflict
from gpufleet.server.services import Services
from gpufleet.store import Store
from gpufleet.wire import HeartbeatRequest, LeaseRef
from tests.queue_steps import CPU, FakeClock, claim, job, orders, register, spec

# ---- cancel --------------------------------------------------------------------------


def test_cancel_a_pending_job(store: Store, queue: Services, clock: FakeClock) -> None:
    w = register(queue, "w1")
    submitted = queue.submission.submit(spec())
    clock.advance(3)
    row = queue.steering.cancel(submitted.id)
    assert row.status is JobStatus.CANCELLED
    assert row.finished_at == clock.now
    assert queue.dispatch.try_claim(w.id, CPU) is None
    assert store.attempts(submitted.id) == []


def test_cancel_a_running_job(store: Store, queue: Services, clock: FakeClock) -> None:
    w = register(queue, "w1")
    submitted = queue.submission.submit(spec())
    lease = claim(queue, w)
    queue.leases.start(lease.job_id, lease.attempt)
    clock.advance(3)
    row = queue.steering.cancel(submitted.id)
    assert row.status is JobStatus.CANCELLED
    assert row.finished_at == clock.now
    [attempt] = store.attempts(submitted.id)
    assert attempt.outcome == "cancelled"
    # the worker hears it on its next heartbeat, and its late result is refused
    resp = queue.leases.heartbeat(
        w.id, HeartbeatRequest(leases=[LeaseRef(job_id=lease.job_id, attempt=lease.attempt)])
    )
    assert orders(resp) == {lease.job_id: "cancel"}
    with pytest.raises(Conflict):
        queue.leases.finish(lease.job_id, lease.attempt, exit_code=0, error=None)
    assert job(store, submitted.id).status is JobStatus.CANCELLED


def test_cancel_a_succeeded_job_is_a_conflict(store: Store, queue: Services) -> None:
    w = register(queue, "w1")
    queue.submission.submit(spec())
    lease = claim(queue, w)
    done = queue.leases.finish(lease.job_id, lease.attempt, exit_code=0, error=None)
    with pytest.raises(Conflict, match="succeeded"):
        queue.steering.cancel(done.id)
    assert job(store, done.id) == done


# ---- requeue -------------------------------------------------------------------------


def test_requeue_a_failed_job(store: Store, queue: Services) -> None:
    w = register(queue, "w1")
    submitted = queue.submission.submit(spec(max_attempts=1))
    lease = claim(queue, w)
    failed = queue.leases.finish(lease.job_id, lease.attempt, exit_code=1, error=None)
    assert failed.status is JobStatus.FAILED
    row = queue.steering.requeue(submitted.id)
    assert row.status is JobStatus.PENDING
    assert row.attempts == 0
    assert row.error is None
    assert row.exit_code is None
    assert row.finished_at is None
    assert row.worker_id is None
    again = claim(queue, w)
    assert again.job_id == submitted.id
    assert again.attempt == 2  # the lease number keeps growing; history is kept
    assert len(store.attempts(submitted.id)) == 2


def test_requeue_a_cancelled_job(queue: Services) -> None:
    submitted = queue.submission.submit(spec())
    queue.steering.cancel(submitted.id)
    assert queue.steering.requeue(submitted.id).status is JobStatus.PENDING


@pytest.mark.parametrize("state", ["pending", "running", "succeeded"])
def test_requeue_of_a_live_or_succeeded_job_is_a_conflict(
    store: Store, queue: Services, state: str
) -> None:
    w = register(queue, "w1")
    submitted = queue.submission.submit(spec())
    if state != "pending":
        lease = claim(queue, w)
        queue.leases.start(lease.job_id, lease.attempt)
        if state == "succeeded":
            queue.leases.finish(lease.job_id, lease.attempt, exit_code=0, error=None)
    before = job(store, submitted.id)
    assert before.status.value == state
    with pytest.raises(Conflict, match=state):
        queue.steering.requeue(submitted.id)
    assert job(store, submitted.id) == before
