"""``server/leases.py``: the lease protocol's rules. A write with a lease the job no
longer (or never) gave is refused and changes nothing; failures retry after a backoff
until the attempts run out; heartbeats keep a lease; a release gives the job back
without counting an attempt.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from gpufleet.domain.models import JobStatus, WorkerStatus
from gpufleet.errors import Conflict, NotFound
from gpufleet.server.services import Services
from gpufleet.store import Store, WorkerRow
from gpufleet.wire import HeartbeatRequest, Lease, LeaseRef
from tests.queue_steps import (
    BACKOFF,
    CPU,
    LEASE,
    FakeClock,
    claim,
    job,
    orders,
    register,
    spec,
)

# ---- stale leases --------------------------------------------------------------------


def _stale_setup(store: Store, queue: Services, clock: FakeClock) -> tuple[WorkerRow, Lease, Lease]:
    """w1 holds attempt 1 and goes silent; the sweep hands the job to w2 as attempt 2."""
    w1 = register(queue, "w1")
    queue.submission.submit(spec())
    old = claim(queue, w1)
    queue.leases.start(old.job_id, old.attempt)
    queue.leases.append_logs(old.job_id, old.attempt, [("stdout", "from attempt 1")])
    clock.advance(LEASE + 1)
    assert queue.upkeep.sweep()[0] == [old.job_id]
    w2 = register(queue, "w2")
    new = claim(queue, w2)
    assert new.job_id == old.job_id
    assert new.attempt == 2
    queue.leases.start(new.job_id, new.attempt)
    queue.leases.append_logs(new.job_id, new.attempt, [("stdout", "from attempt 2")])
    return w1, old, new


STALE_WRITES: dict[str, Callable[[Services, Lease], object]] = {
    "start": lambda q, lease: q.leases.start(lease.job_id, lease.attempt),
    "append_logs": lambda q, lease: q.leases.append_logs(
        lease.job_id, lease.attempt, [("stdout", "x")]
    ),
    "finish_ok": lambda q, lease: q.leases.finish(lease.job_id, lease.attempt, 0, None),
    "finish_fail": lambda q, lease: q.leases.finish(lease.job_id, lease.attempt, 1, "boom"),
    "release": lambda q, lease: q.leases.release(lease.job_id, lease.attempt, "drained"),
}


def _never_held(queue: Services) -> tuple[Lease, Lease]:
    """w1 holds attempt 1, claimed; the write names attempt 2, which was never handed out."""
    w1 = register(queue, "w1")
    queue.submission.submit(spec())
    lease = claim(queue, w1)
    return lease.model_copy(update={"attempt": lease.attempt + 1}), lease


@pytest.mark.parametrize("write", sorted(STALE_WRITES))
@pytest.mark.parametrize("stale", ["superseded", "never held"])
def test_stale_lease_is_a_conflict_and_changes_nothing(
    store: Store, queue: Services, clock: FakeClock, write: str, stale: str
) -> None:
    """A write naming a lease the job does not hold now is refused, whether the lease was
    handed on since (the sweep gave the job to another worker) or never given (a wrong
    attempt number), and changes nothing: not the job, its output or its attempts."""
    if stale == "superseded":
        _w1, old, new = _stale_setup(store, queue, clock)
    else:
        old, new = _never_held(queue)
    before = job(store, new.job_id)
    logs_before = store.logs(new.job_id, after=0, limit=100)
    attempts_before = store.attempts(new.job_id)
    clock.advance(1)
    with pytest.raises(Conflict, match="stale lease"):
        STALE_WRITES[write](queue, old)
    assert job(store, new.job_id) == before
    assert before.status is (JobStatus.RUNNING if stale == "superseded" else JobStatus.CLAIMED)
    assert before.lease == new.attempt
    assert store.logs(new.job_id, after=0, limit=100) == logs_before
    assert store.attempts(new.job_id) == attempts_before


def test_stale_heartbeat_orders_cancel_and_extends_nothing(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    w1, old, new = _stale_setup(store, queue, clock)
    before = job(store, new.job_id)
    clock.advance(5)
    resp = queue.leases.heartbeat(
        w1.id, HeartbeatRequest(leases=[LeaseRef(job_id=old.job_id, attempt=old.attempt)])
    )
    assert orders(resp) == {old.job_id: "cancel"}
    assert job(store, new.job_id) == before


def test_unknown_job_is_not_found(queue: Services) -> None:
    with pytest.raises(NotFound):
        queue.leases.start("j-nope", 1)
    with pytest.raises(NotFound):
        queue.steering.cancel("j-nope")


# ---- retries and backoff -------------------------------------------------------------


def test_failures_retry_with_backoff_then_fail(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    w = register(queue, "w1")
    submitted = queue.submission.submit(spec(max_attempts=3))

    first = claim(queue, w)
    queue.leases.start(first.job_id, first.attempt)
    row = queue.leases.finish(first.job_id, first.attempt, exit_code=1, error=None)
    assert row.status is JobStatus.PENDING
    assert row.attempts == 1
    assert row.not_before == clock.now + BACKOFF
    assert row.worker_id is None
    assert row.error == "exit code 1"
    assert row.finished_at is None

    clock.advance(BACKOFF - 1)
    assert queue.dispatch.try_claim(w.id, CPU) is None  # still backing off
    clock.advance(1)
    second = claim(queue, w)
    assert second.attempt == 2
    row = queue.leases.finish(
        second.job_id, second.attempt, exit_code=137, error="CUDA out of memory"
    )
    assert row.status is JobStatus.PENDING
    assert row.attempts == 2
    assert row.not_before == clock.now + 2 * BACKOFF

    clock.advance(2 * BACKOFF - 1)
    assert queue.dispatch.try_claim(w.id, CPU) is None
    clock.advance(1)
    third = claim(queue, w)
    queue.leases.start(third.job_id, third.attempt)
    row = queue.leases.finish(third.job_id, third.attempt, exit_code=2, error="disk full")
    assert row.status is JobStatus.FAILED
    assert row.attempts == 3
    assert row.finished_at == clock.now
    assert row.not_before is None
    assert row.error == "disk full"
    assert queue.dispatch.try_claim(w.id, CPU) is None

    history = store.attempts(submitted.id)
    assert [a.attempt for a in history] == [1, 2, 3]
    assert [a.error for a in history] == ["exit code 1", "CUDA out of memory", "disk full"]
    assert [a.exit_code for a in history] == [1, 137, 2]
    assert {a.outcome for a in history} == {"failed"}


def test_an_exit_code_the_job_names_as_not_retried_fails_it_at_once(
    store: Store, queue: Services
) -> None:
    w = register(queue, "w1")
    submitted = queue.submission.submit(spec(max_attempts=3, no_retry_on=(4,)))
    first = claim(queue, w)
    row = queue.leases.finish(first.job_id, first.attempt, 4, None, ["bad input"])
    assert (row.status, row.attempts) == (JobStatus.FAILED, 1)
    assert row.error == "exit code 4, never retried (the job's no_retry_on names it)"
    said = [r for r in store.logs(submitted.id, 0, 100) if r.stream == "state"][-1]
    assert json.loads(said.line)["stderr_tail"] == ["bad input"]


def test_success_after_a_retry_counts_both_attempts(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    w = register(queue, "w1")
    queue.submission.submit(spec())
    first = claim(queue, w)
    queue.leases.finish(first.job_id, first.attempt, exit_code=1, error=None)
    clock.advance(BACKOFF)
    second = claim(queue, w)
    row = queue.leases.finish(second.job_id, second.attempt, exit_code=0, error=None)
    assert row.status is JobStatus.SUCCEEDED
    assert row.attempts == 2
    assert row.error is None
    assert [a.outcome for a in store.attempts(row.id)] == ["failed", "succeeded"]


# ---- heartbeats and releases ---------------------------------------------------------


def test_heartbeats_keep_the_lease(store: Store, queue: Services, clock: FakeClock) -> None:
    w = register(queue, "w1")
    submitted = queue.submission.submit(spec())
    lease = claim(queue, w)
    queue.leases.start(lease.job_id, lease.attempt)
    for _ in range(4):
        clock.advance(LEASE - 5)
        resp = queue.leases.heartbeat(
            w.id, HeartbeatRequest(leases=[LeaseRef(job_id=lease.job_id, attempt=lease.attempt)])
        )
        assert orders(resp) == {lease.job_id: "continue"}
        assert queue.upkeep.sweep() == ([], [])
    assert job(store, submitted.id).status is JobStatus.RUNNING
    assert queue.fleet.state_of(queue.fleet.worker(w.id)).status is WorkerStatus.BUSY


def test_release_does_not_count_an_attempt(store: Store, queue: Services, clock: FakeClock) -> None:
    w1, w2 = register(queue, "w1"), register(queue, "w2")
    submitted = queue.submission.submit(spec(max_attempts=1))
    lease = claim(queue, w1)
    queue.leases.start(lease.job_id, lease.attempt)
    row = queue.leases.release(lease.job_id, lease.attempt, "worker drained")
    assert row.status is JobStatus.PENDING
    assert row.attempts == 0
    assert row.worker_id is None
    assert row.not_before is None
    # claimable again at once, and the one allowed attempt is still there
    again = claim(queue, w2)
    assert again.job_id == submitted.id
    done = queue.leases.finish(again.job_id, again.attempt, exit_code=0, error=None)
    assert done.status is JobStatus.SUCCEEDED
    assert done.attempts == 1
    assert [a.outcome for a in store.attempts(submitted.id)] == ["released", "succeeded"]
