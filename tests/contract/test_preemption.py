"""The store's preemption operations, on every backend: the waiting jobs that may preempt,
a victim marked once (and only while it runs on that lease, is asked nothing else, and its
waiting job has no other victim), the leases a heartbeat is told to vacate, and the jobs
a job preempted."""

from __future__ import annotations

import json

from gpufleet.domain.models import JobStatus
from gpufleet.server.services import Services
from gpufleet.store import Preempt, Store
from tests.queue_steps import FakeClock, claim, job, register, spec


def _running(q: Services, name: str, priority: int = 0) -> tuple[str, int]:
    w = register(q, name)
    q.submission.submit(spec(f"on-{name}", priority=priority))
    lease = claim(q, w)
    q.leases.start(lease.job_id, lease.attempt)
    return lease.job_id, lease.attempt


def test_preemptors_are_the_waiting_jobs_of_a_priority_that_waited_long_enough(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    old_high = queue.submission.submit(spec("old-high", priority=10)).id
    queue.submission.submit(spec("low", priority=1))
    clock.advance(30)
    new_higher = queue.submission.submit(spec("new-higher", priority=20)).id
    queue.submission.submit(spec("other-pool", priority=20, pool="lab"))
    since = clock.now - 10
    assert [j.id for j in store.preemptors("default", 5, since, 10)] == [old_high]
    clock.advance(10)
    found = store.preemptors("default", 5, clock.now - 10, 10)
    assert [j.id for j in found] == [new_higher, old_high], "in claim order"
    assert store.preemptors("default", 5, clock.now - 10, 1)[0].id == new_higher


def test_a_victim_is_marked_once_and_both_logs_say_so(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    victim, lease = _running(queue, "a")
    other, other_lease = _running(queue, "b")
    waiting = queue.submission.submit(spec("urgent", priority=10)).id
    ask = Preempt(victim, lease, waiting, "made way", "took its slot")
    assert not store.request_preempt(Preempt(victim, lease + 1, waiting, "", ""), clock.now)
    assert store.request_preempt(ask, clock.now)
    assert not store.request_preempt(ask, clock.now), "once"
    second = Preempt(other, other_lease, waiting, "", "")
    assert not store.request_preempt(second, clock.now), "one victim per waiting job"
    row = job(store, victim)
    assert (row.preempt_requested_at, row.preempted_at, row.preempted_by) == (
        clock.now,
        clock.now,
        waiting,
    )
    assert store.preempting([(victim, lease), (other, other_lease)]) == {victim}
    assert [j.id for j in store.preempted_for(waiting, 5)] == [victim]
    said = [json.loads(r.line) for r in store.logs(victim, 0, 100) if r.stream == "state"]
    assert said[-1]["event"] == "preempting" and said[-1]["why"] == "made way"
    theirs = [json.loads(r.line) for r in store.logs(waiting, 0, 100) if r.stream == "state"]
    assert theirs[-1]["why"] == "took its slot"
    # Handed back: pending, unmarked, and the waiting job may have another victim.
    queue.leases.release(victim, lease, "vacated")
    assert job(store, victim).status is JobStatus.PENDING
    assert job(store, victim).preempt_requested_at is None
    assert store.preempting([(victim, lease)]) == set()
    assert store.request_preempt(second, clock.now)


def test_a_job_asked_to_stop_or_a_waiting_job_gone_is_not_preempted(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    stopping, lease = _running(queue, "a")
    waiting = queue.submission.submit(spec("urgent", priority=10)).id
    assert store.request_stop(stopping, clock.now, 5.0)
    assert not store.request_preempt(Preempt(stopping, lease, waiting, "", ""), clock.now)
    victim, victim_lease = _running(queue, "b")
    queue.steering.cancel(waiting, None, None)
    assert not store.request_preempt(Preempt(victim, victim_lease, waiting, "", ""), clock.now)
