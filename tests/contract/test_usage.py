"""Usage for fair share, on every backend: an attempt that ran is charged once, however
it ends, for the seconds it ran; one that never started, and a pending job cancelled,
charge nothing."""

from __future__ import annotations

import contextlib

import pytest

from gpufleet.server.services import Services
from gpufleet.store import Preempt, Store
from tests.queue_steps import LEASE, FakeClock, claim, job, register, spec

RAN = 10.0


def _charged(store: Store) -> float:
    return sum(s.seconds for s in store.usage_slices(0.0))


def _running(q: Services, clock: FakeClock) -> tuple[str, int]:
    w = register(q, "w")
    q.submission.submit(spec("train", max_attempts=3))
    lease = claim(q, w)
    q.leases.start(lease.job_id, lease.attempt)
    clock.advance(RAN)
    return lease.job_id, lease.attempt


def _end(q: Services, store: Store, clock: FakeClock, end: str, job_id: str, n: int) -> None:
    """End attempt ``n`` of ``job_id`` the way ``end`` names."""
    if end in ("succeed", "retry"):
        q.leases.finish(job_id, n, 0 if end == "succeed" else 1, None)
    elif end in ("drain", "owner"):
        q.leases.release(job_id, n, end, owner=end == "owner")
    elif end == "preempt":
        waiting = q.submission.submit(spec("urgent", priority=10)).id
        assert store.request_preempt(Preempt(job_id, n, waiting, "", ""), clock.now)
        q.leases.release(job_id, n, "preempted")
    elif end == "pause":
        q.steering.pause(job_id)
        q.leases.release(job_id, n, "paused")
    elif end == "stop":
        q.steering.stop(job_id)
        q.leases.finish(job_id, n, 130, None)
    else:
        q.steering.cancel(job_id)


ENDS = ("cancel", "drain", "owner", "pause", "preempt", "retry", "stop", "succeed")


@pytest.mark.parametrize("end", ENDS)
def test_an_attempt_is_charged_once_for_the_seconds_it_ran_however_it_ends(
    store: Store, queue: Services, clock: FakeClock, end: str
) -> None:
    job_id, attempt = _running(queue, clock)
    _end(queue, store, clock, end, job_id, attempt)
    assert _charged(store) == pytest.approx(RAN), end
    assert job(store, job_id).lease == attempt
    # a late word of the same attempt (the worker's finish) charges nothing more
    with contextlib.suppress(Exception):  # refused: the lease no longer holds the job
        queue.leases.finish(job_id, attempt, 0, None)
    assert _charged(store) == pytest.approx(RAN), end


def test_a_lost_attempt_is_charged_until_the_server_found_it_lost(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    job_id, attempt = _running(queue, clock)
    clock.advance(LEASE + 1)  # the lease lapses LEASE s after the start
    assert queue.upkeep.lose_lapsed_leases() == [job_id]
    assert job(store, job_id).lease == attempt
    # charged to the moment its lapsed lease was found, not its last heartbeat
    assert _charged(store) == pytest.approx(RAN + LEASE + 1)


def test_a_job_cancelled_pending_or_claimed_charges_nothing(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    job_id, attempt = _running(queue, clock)
    queue.leases.finish(job_id, attempt, 1, None)  # retried: pending, its attempt charged
    clock.advance(60)
    queue.steering.cancel(job_id)
    assert _charged(store) == pytest.approx(RAN)
    w = register(queue, "w2")
    queue.submission.submit(spec("claimed"))
    lease = claim(queue, w)
    clock.advance(RAN)
    queue.steering.cancel(lease.job_id)
    assert _charged(store) == pytest.approx(RAN)
