"""``server/preemption.py``: the sweep's preemption duty, on the memory store and a fake
clock. A waiting job of a high enough priority that has waited ``min_wait`` takes the
slot of the lowest-ranked running job that allows it: the victim is marked once, its
worker is told "preempt" at its heartbeat, and the job it hands back is pending again,
counted in neither budget and protected from a second preemption for a while.
"""

from __future__ import annotations

import json
from dataclasses import replace

from gpufleet.domain.models import JobStatus, Requirements
from gpufleet.domain.sharing import Preemption, Share, Sharing
from gpufleet.scheduling.matching import FreeGpu, FreeResources
from gpufleet.server.blobs import BlobService
from gpufleet.server.services import Services
from gpufleet.store import Store
from gpufleet.wire import HeartbeatRequest, Lease, LeaseRef
from tests.queue_steps import SETTINGS, FakeClock, claim, job, orders, register, spec

RULES = Sharing(preemption=Preemption(enabled=True, min_priority=5, min_wait=60, protection=600))


def running(q: Services, name: str, **kw: object) -> Lease:
    """A job submitted, claimed and started by a new one-slot CPU worker ``name``."""
    w = register(q, name)
    q.submission.submit(spec(f"job-on-{name}", **kw))
    lease = claim(q, w)
    q.leases.start(lease.job_id, lease.attempt)
    return lease


def beat(q: Services, lease: Lease, worker_id: str) -> str:
    ref = LeaseRef(job_id=lease.job_id, attempt=lease.attempt)
    return orders(q.leases.heartbeat(worker_id, HeartbeatRequest(leases=[ref])))[lease.job_id]


def states(store: Store, job_id: str) -> list[dict[str, object]]:
    return [json.loads(r.line) for r in store.logs(job_id, 0, 1000) if r.stream == "state"]


def test_a_waiting_job_preempts_after_its_wait_and_the_victim_goes_back_uncounted(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    queue.sharing.set(RULES)
    low = running(queue, "box", preemptible=True)
    urgent = queue.submission.submit(spec("urgent", priority=10))
    clock.advance(59)
    assert queue.preemption.sweep() == [], "it has not waited min_wait yet"
    clock.advance(1)
    assert queue.preemption.sweep() == [(low.job_id, urgent.id)]
    assert queue.preemption.sweep() == [], "one victim at a time"
    summary = queue.explain.why(urgent.id)[1]
    assert f"job {low.job_id} (job-on-box) is making way for it (preempted)" in summary
    victim = job(store, low.job_id)
    assert victim.status is JobStatus.RUNNING and victim.preempted_by == urgent.id
    w = victim.worker_id
    assert w is not None and beat(queue, low, w) == "preempt"
    said = states(store, low.job_id)[-1]
    assert said["event"] == "preempting"
    assert f"preempted by job {urgent.id} (no owner, priority 10)" in str(said["why"])
    assert f"preempted job {low.job_id}" in str(states(store, urgent.id)[-1]["why"])

    back = queue.leases.release(low.job_id, low.attempt, "worker box vacated it")
    assert back.status is JobStatus.PENDING
    assert (back.attempts, back.losses, back.preempt_requested_at) == (0, 0, None)
    assert store.attempts(low.job_id)[-1].cause == "preempted"
    got = claim(queue, queue.fleet.worker(w))
    assert got.job_id == urgent.id, "the slot goes to the job that preempted"


def test_no_preemption_of_a_job_that_does_not_allow_it_or_ranks_as_high(
    queue: Services, clock: FakeClock
) -> None:
    queue.sharing.set(RULES)
    running(queue, "a")  # not preemptible
    running(queue, "b", preemptible=True, priority=10)  # as high as the waiting job
    queue.submission.submit(spec("urgent", priority=10))
    queue.submission.submit(spec("not-urgent-enough", priority=4))
    clock.advance(120)
    assert queue.preemption.sweep() == []


def test_a_job_a_cap_holds_back_preempts_only_a_job_whose_slot_counts_against_that_cap(
    queue: Services, clock: FakeClock
) -> None:
    """A cap on another user holds the waiting job back whoever leaves: it preempts
    nobody. A cap on its pool, full of the pool's own jobs, is made room in by the victim
    leaving: the pool's cap does not stop its urgent jobs preempting its low ones."""
    low = running(queue, "box", preemptible=True)
    queue.sharing.set(replace(RULES, users={"": Share(max_cpu_slots=0)}))
    urgent = queue.submission.submit(spec("urgent", priority=10))
    clock.advance(60)
    assert queue.preemption.sweep() == [], "its owner may hold no CPU slot at all"
    queue.sharing.set(replace(RULES, pools={"default": Share(max_cpu_slots=1)}))
    assert queue.explain.why(urgent.id)[1]  # held back by the pool's cap now
    assert queue.preemption.sweep() == [(low.job_id, urgent.id)]


def test_a_pool_s_policy_allows_preemption_and_the_lowest_newest_job_goes(
    queue: Services, clock: FakeClock
) -> None:
    queue.sharing.set(
        Sharing(preemption=RULES.preemption, pools={"default": Share(preemptible=True)})
    )
    running(queue, "old", priority=1)
    clock.advance(10)
    newer = running(queue, "new", priority=1)
    running(queue, "mid", priority=2)
    urgent = queue.submission.submit(spec("urgent", priority=10))
    clock.advance(60)
    assert queue.preemption.sweep() == [(newer.job_id, urgent.id)]


def test_a_preempted_job_is_protected_for_its_protection_time(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    queue.sharing.set(RULES)
    low = running(queue, "box", preemptible=True)
    first = queue.submission.submit(spec("first", priority=10))
    clock.advance(60)
    assert queue.preemption.sweep() == [(low.job_id, first.id)]
    box = queue.fleet.worker(job(store, low.job_id).worker_id or "")
    queue.leases.release(low.job_id, low.attempt, "vacated")
    assert claim(queue, box).job_id == first.id
    again = claim(queue, register(queue, "second"))
    assert again.job_id == low.job_id
    queue.leases.start(again.job_id, again.attempt)
    second = queue.submission.submit(spec("second", priority=10))
    clock.advance(599)  # 599 s after the first preemption
    assert queue.preemption.sweep() == [], "protected"
    clock.advance(1)
    assert queue.preemption.sweep() == [(low.job_id, second.id)]


def test_no_preemption_when_a_slot_comes_free_within_the_grace_period(
    queue: Services, clock: FakeClock
) -> None:
    queue.sharing.set(RULES)
    running(queue, "low", preemptible=True, grace_period=30.0)
    running(queue, "ending", priority=20, timeout=100.0)
    urgent = queue.submission.submit(spec("urgent", priority=10))
    clock.advance(75)  # the job with a timeout ends within 25 s: within the grace period
    assert queue.preemption.sweep() == []
    ending_later = running(queue, "later", priority=20, timeout=1000.0)
    queue.leases.release(ending_later.job_id, ending_later.attempt, "gone")  # a free slot...
    assert queue.preemption.sweep() == [], "...which the waiting job can take now"
    assert urgent.id


def test_a_job_reaching_its_pools_max_run_within_the_grace_period_is_a_slot_coming(
    queue: Services, clock: FakeClock
) -> None:
    """The pool's max_run is the attempt's timeout: its end is a slot coming free."""
    queue.sharing.set(replace(RULES, pools={"default": Share(max_run=100.0)}))
    running(queue, "low", preemptible=True, grace_period=30.0)
    running(queue, "ending", priority=20)  # no timeout of its own: the pool's 100 s
    queue.submission.submit(spec("urgent", priority=10))
    clock.advance(75)  # it reaches the pool's max_run within 25 s: within the grace period
    assert queue.preemption.sweep() == []


def test_a_worker_whose_owner_policy_takes_no_jobs_offers_no_slot_to_a_waiting_job(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    """A desktop outside its hours has a free slot it will not give: the urgent job
    preempts on the server instead of waiting for it; nor is a job on the desktop chosen
    as the victim, its slot could not be taken."""
    queue.sharing.set(RULES)
    desk = register(queue, "desk")
    low = running(queue, "box", preemptible=True)
    clock.advance(1)
    on_desk = running(queue, "desk2", preemptible=True)  # the newest start: first in line
    outside = json.dumps({"reasons": ["outside hours mon-fri 19:00-08:00"]})
    store.set_worker_owner_state(desk.id, outside)
    desk2 = job(store, on_desk.job_id).worker_id
    assert desk2 is not None
    store.set_worker_owner_state(desk2, outside)
    urgent = queue.submission.submit(spec("urgent", priority=10))
    clock.advance(60)
    assert queue.preemption.sweep() == [(low.job_id, urgent.id)]


def test_a_job_on_a_gpu_that_is_its_workstation_owners_is_not_the_victim(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    """The owner's GPU takes no new job: its job's slot would free nothing for the
    waiting job, so the victim is another."""
    queue.sharing.set(RULES)
    gpu = Requirements(require_cuda=True, gpu_count=1)
    free = FreeResources(cpu_slots=0, gpus=(FreeGpu(0, 24 * 1024),))
    leases = []
    for name in ("box", "desk"):  # the desk's job starts last: the first in line
        w = register(queue, name, gpus=[("A10", 24)], cpu_slots=0)
        queue.submission.submit(spec(f"low-{name}", preemptible=True, requirements=gpu))
        lease = claim(queue, w, free)
        queue.leases.start(lease.job_id, lease.attempt)
        leases.append((w, lease))
        clock.advance(1)
    (_, low), (desk, _) = leases
    owned = {"foreign": [{"gpu": 0, "pid": 4242, "name": "blender", "mib": 3000}], "owned": [0]}
    store.set_worker_owner_state(desk.id, json.dumps(owned))
    urgent = queue.submission.submit(spec("urgent", priority=10, requirements=gpu))
    clock.advance(60)
    assert queue.preemption.sweep() == [(low.job_id, urgent.id)]


def test_preemption_is_off_without_the_rules_and_is_audited_with_them(
    store: Store, clock: FakeClock, blobs: BlobService
) -> None:
    events: list[tuple[str, str, str]] = []
    q = Services(
        store,
        SETTINGS,
        blobs,
        clock=lambda: clock.now,
        on_event=lambda event, target, detail, token: events.append((event, target, detail)),
    )
    low = running(q, "box", preemptible=True)
    urgent = q.submission.submit(spec("urgent", priority=10))
    clock.advance(3600)
    assert q.preemption.sweep() == [], "no [preemption] in the rules: off"
    q.sharing.set(RULES)
    assert q.preemption.sweep() == [(low.job_id, urgent.id)]
    [(_, target, detail)] = [e for e in events if e[0] == "job.preempted"]
    assert target == low.job_id and f"preempted by job {urgent.id}" in detail


def test_the_freed_slot_goes_to_the_job_that_preempted_not_one_fair_share_ranks_first(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    """Alice's urgent job preempts; bob's job of the same priority, queued later, ranks
    first by fair share (bob has used nothing). The victim's worker, freed, still takes
    alice's job: else she would wait, and preempt again, losing another job's work."""
    queue.sharing.set(replace(RULES, fair_share=True, users={"alice": Share(weight=1)}))
    low = running(queue, "box", preemptible=True)
    mine = register(queue, "alice-box")  # alice has used a CPU slot for a while
    queue.submission.submit(spec("alice-long"), by="alice")
    old = claim(queue, mine)
    queue.leases.start(old.job_id, old.attempt)
    queue.submission.submit(spec("alice-urgent", priority=10), by="alice")
    clock.advance(600)
    urgent = next(j for j in store.list_jobs(name="alice-urgent"))
    assert queue.preemption.sweep() == [(low.job_id, urgent.id)]
    queue.submission.submit(spec("bob-urgent", priority=10), by="bob")
    assert job(store, old.job_id).status is JobStatus.RUNNING
    w = job(store, low.job_id).worker_id
    assert w is not None
    queue.leases.release(low.job_id, low.attempt, "worker box vacated it")
    got = claim(queue, queue.fleet.worker(w))
    assert got.job_id == urgent.id, "the preempting job takes the slot it freed"
    assert queue.preemption.sweep() == [], "and preempts nobody else"
