"""A stateful property test of the queue: random claims by several workers, heartbeats,
clock jumps past the lease, finishes with stale leases, releases, cancels, requeues and
applies, against the in-memory store and SQLite. After every step the invariants a user
relies on must hold:

- a job never has two live leases (only its current attempt may be open, and only while
  the job is claimed or running);
- an attempt is recorded as finished once (its record never changes after);
- the attempt number never goes down, nor the attempts counted (but by a requeue);
- every status change is an edge of the lifecycle table;
- a dependent never waits on a dependency that ended: it fails with a failed one, and
  its count of unmet ones is exact;
- a worker never holds more jobs than it has slots.

The number of examples is bounded (``GPUFLEET_STATEFUL_EXAMPLES``, 50 by default).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from gpufleet.domain.lifecycle import TRANSITIONS
from gpufleet.domain.models import JobSpec, JobStatus
from gpufleet.errors import GpufleetError
from gpufleet.scheduling.matching import FreeResources
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.server.services import Services
from gpufleet.server.settings import QueueSettings
from gpufleet.store import Batch, Store, open_store
from gpufleet.store.blobfiles import BlobFiles
from gpufleet.store.memory import MemoryStore
from gpufleet.wire import (
    CapabilityModel,
    HeartbeatRequest,
    JobSpecModel,
    LeaseRef,
    ManifestApply,
    WorkerRegister,
)

LEASE = 30.0
SLOTS = 2
EXAMPLES = int(os.environ.get("GPUFLEET_STATEFUL_EXAMPLES", "50"))
EDGES = {(src, dst) for (src, _), dst in TRANSITIONS.items()}
SUCCEEDED = JobStatus.SUCCEEDED


class Queue(RuleBasedStateMachine):
    """One queue, three workers, and a model of what was seen before."""

    kind = "memory"
    root: Path

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.now = 1_700_000_000.0
        self.seen: dict[str, tuple[JobStatus, int, int]] = {}  # id -> status, lease, attempts
        self.ended: dict[tuple[str, int], tuple[Any, ...]] = {}  # finished attempt records
        self.job_ids: list[str] = []
        self.names = 0

    @initialize()
    def open_queue(self) -> None:
        n = len(list(self.root.iterdir()))
        if self.kind == "memory":
            self.store: Store = MemoryStore()
        else:
            path = self.root / f"q{n}.db"
            shutil.copy(self.root.parent / "template.db", path)
            self.store = open_store(f"sqlite:///{path}")
        blobs = BlobService(self.store, BlobFiles(self.root / f"blobs{n}"), BlobSettings())
        settings = QueueSettings(lease_timeout=LEASE, retry_backoff=5.0)
        self.q = Services(self.store, settings, blobs, clock=lambda: self.now)
        cap = CapabilityModel(hostname="box", cores=4, ram_mib=8192)
        self.workers = [
            self.q.fleet.register(
                WorkerRegister(name=f"w{i}", capability=cap, cpu_slots=SLOTS), "default", None
            ).id
            for i in range(3)
        ]

    def teardown(self) -> None:
        if hasattr(self, "store"):
            self.store.close()

    # ---- what users and workers do ----------------------------------------------------

    def _spec(self, attempts: int, priority: int) -> JobSpec:
        self.names += 1
        return JobSpec(
            name=f"job{self.names}",
            command=("true",),
            max_attempts=attempts,
            priority=priority,
        )

    @rule(attempts=st.integers(1, 3), priority=st.integers(0, 2), needs=st.integers(0, 5))
    def submit(self, attempts: int, priority: int, needs: int) -> None:
        spec = self._spec(attempts, priority)
        job_id = f"s{self.names}"
        deps = {job_id: [self.job_ids[needs % len(self.job_ids)]]} if needs and self.job_ids else {}
        self.store.submit(Batch([(job_id, spec, None)], deps=deps), self.now)
        self.job_ids.append(job_id)

    @rule(lease=leases, attempts=st.integers(1, 2))
    def submit_after(self, lease: tuple[str, int, str], attempts: int) -> None:
        """A job that needs the result of one a worker holds (so its end matters)."""
        if lease[0]:
            spec = self._spec(attempts, 0)
            job_id = f"s{self.names}"
            self.store.submit(Batch([(job_id, spec, None)], deps={job_id: [lease[0]]}), self.now)
            self.job_ids.append(job_id)

    @rule(count=st.integers(1, 3))
    def apply(self, count: int) -> None:
        jobs = [
            JobSpecModel(name=f"m{i}", command=["true"], manifest="plan", max_attempts=2)
            for i in range(count)
        ]
        result = self.q.submission.apply(ManifestApply(name="plan", jobs=jobs))
        self.job_ids += [i for i in result.created if i not in self.job_ids]

    @rule(target=leases, worker=st.integers(0, 2))
    def claim(self, worker: int) -> tuple[str, int, str]:
        lease = self.q.dispatch.try_claim(self.workers[worker], FreeResources(cpu_slots=SLOTS))
        if lease is None:
            return ("", 0, "")
        return (lease.job_id, lease.attempt, self.workers[worker])

    @rule(lease=leases)
    def start(self, lease: tuple[str, int, str]) -> None:
        if lease[0]:
            self._may_conflict(self.q.leases.start, lease[0], lease[1])

    @rule(lease=leases, code=st.sampled_from([0, 0, 1]))
    def finish(self, lease: tuple[str, int, str], code: int) -> None:
        if lease[0]:  # a stale lease (finished, lost, cancelled) is refused, changing nothing
            self._may_conflict(self.q.leases.finish, lease[0], lease[1], code, None)

    @rule(lease=consumes(leases))
    def release(self, lease: tuple[str, int, str]) -> None:
        if lease[0]:
            self._may_conflict(self.q.leases.release, lease[0], lease[1], "drained")

    @rule(worker=st.integers(0, 2), lease=leases)
    def heartbeat(self, worker: int, lease: tuple[str, int, str]) -> None:
        refs = [LeaseRef(job_id=lease[0], attempt=lease[1])] if lease[0] else []
        self.q.leases.heartbeat(self.workers[worker], HeartbeatRequest(leases=refs))

    @rule(seconds=st.sampled_from([1.0, LEASE / 2, LEASE + 1]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.q.upkeep.sweep()

    @rule(index=st.integers(0, 50))
    def cancel(self, index: int) -> None:
        if self.job_ids:
            self._may_conflict(self.q.steering.cancel, self.job_ids[index % len(self.job_ids)])

    @rule(index=st.integers(0, 50))
    def requeue(self, index: int) -> None:
        if self.job_ids:
            self._may_conflict(self.q.steering.requeue, self.job_ids[index % len(self.job_ids)])

    def _may_conflict(self, call: Any, *args: Any) -> None:
        try:
            call(*args)
        except GpufleetError as exc:
            assert exc.status in (404, 409), exc  # refused for a reason a user is told

    # ---- what must hold ----------------------------------------------------------------

    @invariant()
    def invariants(self) -> None:
        if not hasattr(self, "store"):
            return
        jobs = {j.id: j for j in self.store.list_jobs(limit=10_000)}
        held: dict[str, int] = {}
        for job in jobs.values():
            self._one_live_lease(job)
            self._edges_and_counts(job)
            self._dependencies(job, jobs)
            if job.status.active and job.worker_id:
                held[job.worker_id] = held.get(job.worker_id, 0) + 1
        assert all(n <= SLOTS for n in held.values()), held

    def _one_live_lease(self, job: Any) -> None:
        for a in self.store.attempts(job.id):
            assert a.attempt <= job.lease
            live = a.finished_at is None
            if a.attempt < job.lease or not job.status.active:
                assert not live, f"{job.id}: attempt {a.attempt} still open, job {job.status}"
            else:
                assert live, f"{job.id}: its current attempt {a.attempt} is closed"
            if not live:
                record = (a.finished_at, a.outcome, a.exit_code, a.error)
                before = self.ended.setdefault((job.id, a.attempt), record)
                assert before == record, f"{job.id} attempt {a.attempt} finished twice"

    def _edges_and_counts(self, job: Any) -> None:
        status, lease, attempts = self.seen.get(job.id, (JobStatus.PENDING, 0, 0))
        if job.status != status:
            assert (status, job.status) in EDGES, f"{job.id}: {status} -> {job.status}"
        assert job.lease >= lease, f"{job.id}: attempt {lease} -> {job.lease}"
        requeued = status.terminal and job.status == JobStatus.PENDING
        assert job.attempts >= attempts or requeued, f"{job.id}: attempts went down"
        self.seen[job.id] = (job.status, job.lease, job.attempts)

    def _dependencies(self, job: Any, jobs: dict[str, Any]) -> None:
        if job.status != JobStatus.PENDING:
            return
        deps = self.store.dependencies(job.id)
        ended = [d for d in deps if d.status in (JobStatus.FAILED, JobStatus.CANCELLED)]
        assert not ended, f"{job.id} waits on {ended[0].id}, which is {ended[0].status}"
        assert job.waiting == sum(1 for d in deps if d.status != SUCCEEDED), job.id


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite database to copy for each example (migrating each costs more)."""
    root = tmp_path_factory.mktemp("stateful")
    store = open_store(f"sqlite:///{root / 'template.db'}")
    store.migrate()
    store.close()
    return root


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_the_queue_keeps_its_invariants(kind: str, template: Path) -> None:
    root = template / kind
    root.mkdir()

    class Machine(Queue):
        pass

    Machine.kind, Machine.root = kind, root
    bounded = settings(
        max_examples=EXAMPLES,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    run_state_machine_as_test(Machine, settings=bounded)
