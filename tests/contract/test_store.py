"""Queue operations through Services over the SQL store, on SQLite and PostgreSQL.

Time comes from a fake clock the tests advance; nothing here sleeps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from gpufleet.domain import lifecycle
from gpufleet.domain.models import JobSpec, JobStatus, Requirements, Role, WorkerStatus
from gpufleet.errors import Conflict, Forbidden, NotFound, Unauthorized
from gpufleet.scheduling.matching import FreeGpu, FreeResources
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.server.services import Services
from gpufleet.server.settings import QueueSettings
from gpufleet.store import (
    Batch,
    Hosts,
    JobRow,
    SqlStore,
    StaleClaim,
    Submitted,
    WorkerRow,
    open_store,
)
from gpufleet.store import schema as t
from gpufleet.store.blobfiles import BlobFiles
from gpufleet.store.postgres import PostgresStore
from gpufleet.store.postgres.claims import _FIRST_FREE
from gpufleet.store.postgres.claims import _VIEW as _VIEW_POSTGRES
from gpufleet.store.sqlite import SqliteStore
from gpufleet.store.sqlite.store import _VIEW as _VIEW_SQLITE
from gpufleet.wire import (
    CapabilityModel,
    GpuModel,
    HeartbeatRequest,
    HeartbeatResponse,
    HostModel,
    JobSpecModel,
    Lease,
    LeaseRef,
    ManifestApply,
    RequirementsModel,
    WorkerRegister,
)

T0 = 1_700_000_000.0
LEASE = 30.0
BACKOFF = 10.0
SETTINGS = QueueSettings(lease_timeout=LEASE, prefer_cuda_grace=60.0, retry_backoff=BACKOFF)
CPU = FreeResources(cpu_slots=1)
GIB = 1024
OUT = ("stdout", "stderr")  # a job's output, of its event log


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def service(store: SqlStore, clock: FakeClock, blobs: BlobService) -> Services:
    return Services(store, SETTINGS, blobs, clock=lambda: clock.now)


@pytest.fixture
def blobs(store: SqlStore, tmp_path: Path) -> BlobService:
    service = BlobService(store, BlobFiles(tmp_path / "blobs"), BlobSettings())
    service.startup()
    return service


@pytest.fixture
def queue(store: SqlStore, clock: FakeClock, blobs: BlobService) -> Services:
    return service(store, clock, blobs)


def register(
    q: Services, name: str, *, gpus: Sequence[tuple[str, int]] = (), cpu_slots: int = 1
) -> WorkerRow:
    """A worker with the given GPUs as (name, GiB) pairs."""
    cap = CapabilityModel(
        hostname=name,
        cores=8,
        ram_mib=64 * GIB,
        gpus=[
            GpuModel(index=i, name=gname, total_mib=gib * GIB, free_mib=gib * GIB)
            for i, (gname, gib) in enumerate(gpus)
        ],
    )
    return q.fleet.register(
        WorkerRegister(name=name, capability=cap, cpu_slots=cpu_slots), "default", None
    )


def spec(name: str = "train", **kw: Any) -> JobSpec:
    req = kw.pop("requirements", Requirements())
    return JobSpec(name=name, command=("python", "train.py"), requirements=req, **kw)


def claim(q: Services, w: WorkerRow, free: FreeResources = CPU) -> Lease:
    lease = q.dispatch.try_claim(w.id, free)
    assert lease is not None
    return lease


def job(store: SqlStore, job_id: str) -> JobRow:
    row = store.get_job(job_id)
    assert row is not None
    return row


# ---- plumbing ---------------------------------------------------------------------------


def test_migrate_twice_is_harmless(store: SqlStore) -> None:
    assert store.submit(Batch([("j-keep", spec(), None)]), T0).created == ["j-keep"]
    store.migrate()
    assert store.ping() == store.dialect
    assert job(store, "j-keep").status is JobStatus.PENDING
    assert store.submit(Batch([("j-new", spec("other"), None)]), T0).created == ["j-new"]


def test_a_batch_skips_existing_ids(store: SqlStore) -> None:
    assert store.submit(Batch([("j-a", spec("a"), None)]), T0).created == ["j-a"]
    both = [("j-a", spec("changed"), None), ("j-b", spec("b"), None)]
    assert store.submit(Batch(both), T0 + 5) == Submitted(["j-b"], [])
    a = job(store, "j-a")
    assert a.name == "a"
    assert a.created_at == T0


def test_a_batch_is_written_whole_or_not_at_all(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
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


class Together:
    """Calls run side by side, each in a thread of its own. ``join`` waits for them all
    (bounded), and fails with the first error any of them raised."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def start(self, call: Callable[..., object], *args: object) -> None:
        def run() -> None:
            try:
                call(*args)
            except BaseException as exc:  # raised again by join
                self.errors.append(exc)

        thread = threading.Thread(target=run)
        self.threads.append(thread)
        thread.start()

    def join(self, timeout: float = 30) -> None:
        for thread in self.threads:
            thread.join(timeout)
        assert not any(thread.is_alive() for thread in self.threads)
        if self.errors:
            raise self.errors[0]


def test_two_applies_naming_one_host_at_once_both_succeed(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first apply holds its transaction open, its host written, while the second
    starts; the second waits for it and then writes over it. Written as delete and
    insert, the second failed on the host's key (a 500) on PostgreSQL."""
    real = store._insert_new
    written, second_started = threading.Event(), threading.Event()

    def slow_first(*args: Any) -> list[str]:
        if not written.is_set():
            written.set()
            second_started.wait(5)
            time.sleep(0.3)  # long enough for the second to reach the host's row
        return real(*args)

    monkeypatch.setattr(store, "_insert_new", slow_first)

    def apply(manifest: str, job_id: str) -> None:
        batch = Batch([(job_id, spec(job_id), None)], hosts=Hosts(manifest, {"box": "{}"}))
        store.submit(batch, T0)

    both = Together()
    both.start(apply, "a", "j-a")
    assert written.wait(5)
    both.start(apply, "b", "j-b")
    second_started.set()
    both.join(10)
    assert [(h.name, h.manifest) for h in store.hosts()] == [("box", "b")]
    assert store.get_job("j-a") is not None and store.get_job("j-b") is not None


def test_two_applies_changing_the_same_jobs_in_opposite_orders_both_succeed(
    store: SqlStore,
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


def test_two_first_registrations_of_one_name_at_once_are_one_worker(
    store: SqlStore, queue: Services
) -> None:
    """A worker restarted while its first registration is still in flight registers
    twice at once: both get the one worker. Read-then-insert failed the second on the
    name's key (a 500) on PostgreSQL."""

    def first_registration(name: str, start: threading.Barrier, ids: list[str]) -> None:
        start.wait()
        ids.append(register(queue, name).id)

    for round_ in range(10):
        ids: list[str] = []
        start = threading.Barrier(2, timeout=5)
        both = Together()
        for _ in range(2):
            both.start(first_registration, f"box-{round_}", start, ids)
        both.join(10)
        assert len(ids) == 2 and ids[0] == ids[1]
    assert len(store.list_workers()) == 10


def test_a_manifests_hosts_replace_only_its_own_entries_and_the_hosts_it_names(
    store: SqlStore,
) -> None:
    store.submit(Batch([], hosts=Hosts("a", {"box-1": "{}", "box-2": "{}"})), T0)
    store.submit(Batch([], hosts=Hosts("b", {"box-3": "{}"})), T0)
    # b names box-2 (a's until now); box-3 is b's, but b's operator may change box-1 only
    store.submit(Batch([], hosts=Hosts("b", {"box-2": "{}"}, within=["box-1"])), T0 + 1)
    owners = {h.name: h.manifest for h in store.hosts()}
    assert owners == {"box-1": "a", "box-2": "b", "box-3": "b"}
    store.submit(Batch([], hosts=Hosts("a", {})), T0 + 2)
    assert {h.name: h.manifest for h in store.hosts()} == {"box-2": "b", "box-3": "b"}


def test_job_spec_round_trips(store: SqlStore, queue: Services) -> None:
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


# ---- claiming ---------------------------------------------------------------------------


def test_claim_hands_out_a_lease_once(store: SqlStore, queue: Services) -> None:
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


def test_claim_records_the_best_fitting_gpu(store: SqlStore, queue: Services) -> None:
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


def test_concurrent_claims_hand_out_exactly_one_lease(store: SqlStore, queue: Services) -> None:
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


def test_a_follower_of_an_ended_job_gets_every_record_its_feed_had_not_read(
    store: SqlStore, queue: Services
) -> None:
    """A follower that reconnects after the job ended, while this server's feed of the
    job (kept for a moment after its last follower left) has not yet read the job's last
    records, is sent them before the ``end``: none is lost to the feed's lag."""
    import asyncio

    from gpufleet.server.events import Hub

    w = register(queue, "w1")
    submitted = queue.submission.submit(spec())
    lease = claim(queue, w)
    queue.leases.start(lease.job_id, lease.attempt)
    queue.leases.append_logs(lease.job_id, lease.attempt, [("stdout", "line 1")])

    async def scenario() -> tuple[bytes, bytes]:
        hub, open_ = Hub(store), asyncio.Event()  # the follower's token stays valid
        try:
            first = hub.follow(submitted.id, "running", 0, open_)
            seen = await anext(first)  # what the feed has: up to "line 1"
            await first.aclose()  # the follower breaks off; its feed lingers
            last = store.logs(submitted.id, 0, 100)[-1].seq
            queue.leases.append_logs(lease.job_id, lease.attempt, [("stdout", "line 2")])
            queue.leases.finish(lease.job_id, lease.attempt, 0, None)
            rest = b"".join(
                [chunk async for chunk in hub.follow(submitted.id, "succeeded", last, open_)]
            )
            return seen, rest
        finally:
            hub.bind(None)

    seen, rest = asyncio.run(scenario())
    assert b"line 1" in seen and b"line 2" not in seen
    assert b"line 2" in rest and rest.index(b"line 2") < rest.index(b"event: end")


# ---- the lease protocol -----------------------------------------------------------------


def test_lease_protocol_happy_path(store: SqlStore, queue: Services, clock: FakeClock) -> None:
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


def test_a_batch_of_output_sent_again_is_stored_once(store: SqlStore, queue: Services) -> None:
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


def _stale_setup(
    store: SqlStore, queue: Services, clock: FakeClock
) -> tuple[WorkerRow, Lease, Lease]:
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


@pytest.mark.parametrize("write", sorted(STALE_WRITES))
def test_stale_lease_is_a_conflict_and_changes_nothing(
    store: SqlStore, queue: Services, clock: FakeClock, write: str
) -> None:
    _w1, old, new = _stale_setup(store, queue, clock)
    before = job(store, new.job_id)
    logs_before = store.logs(new.job_id, after=0, limit=100)
    attempts_before = store.attempts(new.job_id)
    clock.advance(1)
    with pytest.raises(Conflict, match="stale lease"):
        STALE_WRITES[write](queue, old)
    assert job(store, new.job_id) == before
    assert before.status is JobStatus.RUNNING
    assert before.lease == 2
    assert store.logs(new.job_id, after=0, limit=100) == logs_before
    assert store.attempts(new.job_id) == attempts_before


@pytest.mark.parametrize("write", sorted(STALE_WRITES))
def test_wrong_attempt_number_is_a_conflict(store: SqlStore, queue: Services, write: str) -> None:
    w = register(queue, "w1")
    queue.submission.submit(spec())
    lease = claim(queue, w)
    before = job(store, lease.job_id)
    forged = lease.model_copy(update={"attempt": lease.attempt + 1})
    with pytest.raises(Conflict):
        STALE_WRITES[write](queue, forged)
    assert job(store, lease.job_id) == before
    assert store.logs(lease.job_id, after=0, limit=100, streams=OUT) == []


def test_stale_heartbeat_orders_cancel_and_extends_nothing(
    store: SqlStore, queue: Services, clock: FakeClock
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


# ---- retries and backoff ----------------------------------------------------------------


def test_failures_retry_with_backoff_then_fail(
    store: SqlStore, queue: Services, clock: FakeClock
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
    store: SqlStore, queue: Services
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
    store: SqlStore, queue: Services, clock: FakeClock
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


# ---- the sweep --------------------------------------------------------------------------


def test_sweep_requeues_an_expired_lease(
    store: SqlStore, queue: Services, clock: FakeClock
) -> None:
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
    assert row.attempts == 1
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


def test_sweep_fails_the_job_when_no_attempts_are_left(
    store: SqlStore, queue: Services, clock: FakeClock
) -> None:
    w = register(queue, "w1")
    submitted = queue.submission.submit(spec(max_attempts=1))
    claim(queue, w)  # claimed, never started
    clock.advance(LEASE + 1)
    requeued, offline = queue.upkeep.sweep()
    assert requeued == [submitted.id]
    assert offline == [w.id]
    row = job(store, submitted.id)
    assert row.status is JobStatus.FAILED
    assert row.attempts == 1
    assert row.finished_at == clock.now
    assert row.error is not None
    assert "lease lost" in row.error


def test_heartbeats_keep_the_lease(store: SqlStore, queue: Services, clock: FakeClock) -> None:
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


def test_a_worker_whose_heartbeats_wait_in_memory_is_never_swept_offline(
    store: SqlStore, queue: Services, clock: FakeClock
) -> None:
    """A heartbeat that changes nothing but liveness waits in memory and is written with
    the fleet's others (a transaction a second, not one each). The sweep writes what
    waits before it judges who went silent: a worker that beat within the lease stays
    available, and its GPUs' last readings land with it. A heartbeat that changes the
    worker's status is written at once."""
    w = register(queue, "w1", gpus=[("A100", 40)])
    queue.leases.heartbeat(w.id, HeartbeatRequest())  # connecting -> available: at once
    assert queue.fleet.worker(w.id).status is WorkerStatus.AVAILABLE
    clock.advance(LEASE - 1)
    reading = GpuModel(index=0, name="A100", total_mib=40 * GIB, free_mib=1234)
    queue.leases.heartbeat(w.id, HeartbeatRequest(gpus=[reading]))
    queue.leases.heartbeat(w.id, HeartbeatRequest())  # no reading: the last one stays
    clock.advance(2)  # over a lease after the beat written at once
    assert queue.upkeep.sweep() == ([], [])
    row = queue.fleet.worker(w.id)
    assert row.status is WorkerStatus.AVAILABLE
    assert row.last_heartbeat == T0 + LEASE - 1
    assert [g.free_mib for g in row.gpu_stats] == [1234]
    store.record_beats([(w.id, T0, None)])  # a beat written late never goes back in time
    assert queue.fleet.worker(w.id).last_heartbeat == T0 + LEASE - 1
    # draining by its own word changes its status: shown at once
    queue.leases.heartbeat(w.id, HeartbeatRequest(draining=True))
    assert queue.fleet.worker(w.id).status is WorkerStatus.DRAINING
    clock.advance(LEASE + 1)  # and silent for a lease after that: offline
    assert queue.upkeep.sweep() == ([], [w.id])


def test_a_heartbeat_that_crosses_a_status_change_still_counts(
    store: SqlStore, queue: Services, clock: FakeClock
) -> None:
    """A heartbeat read the worker offline; before it wrote, a poll (on another replica)
    made it available. The status change then applies to no row, and the beat is kept
    as a plain one: the sweep does not take the worker for silent."""
    w = register(queue, "w1")
    queue.leases.heartbeat(w.id, HeartbeatRequest())  # available
    clock.advance(LEASE + 1)
    assert queue.upkeep.sweep() == ([], [w.id])  # silent: offline
    read = queue.fleet.worker(w.id)  # the heartbeat's read: offline
    queue.dispatch.poll(w.id, FreeResources(cpu_slots=1), 0)  # meanwhile: available
    clock.advance(LEASE - 1)
    queue.fleet.beat(read, False, None)  # offline -> available: matches no row now
    clock.advance(2)  # over a lease after the poll, within one of the heartbeat
    assert queue.upkeep.sweep() == ([], [])
    row = queue.fleet.worker(w.id)
    assert (row.status, row.last_heartbeat) == (WorkerStatus.AVAILABLE, T0 + 2 * LEASE)


def test_release_does_not_count_an_attempt(
    store: SqlStore, queue: Services, clock: FakeClock
) -> None:
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


# ---- operators --------------------------------------------------------------------------


def test_cancel_a_pending_job(store: SqlStore, queue: Services, clock: FakeClock) -> None:
    w = register(queue, "w1")
    submitted = queue.submission.submit(spec())
    clock.advance(3)
    row = queue.steering.cancel(submitted.id)
    assert row.status is JobStatus.CANCELLED
    assert row.finished_at == clock.now
    assert queue.dispatch.try_claim(w.id, CPU) is None
    assert store.attempts(submitted.id) == []


def test_cancel_a_running_job(store: SqlStore, queue: Services, clock: FakeClock) -> None:
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


def test_cancel_a_succeeded_job_is_a_conflict(store: SqlStore, queue: Services) -> None:
    w = register(queue, "w1")
    queue.submission.submit(spec())
    lease = claim(queue, w)
    done = queue.leases.finish(lease.job_id, lease.attempt, exit_code=0, error=None)
    with pytest.raises(Conflict, match="succeeded"):
        queue.steering.cancel(done.id)
    assert job(store, done.id) == done


def test_requeue_a_failed_job(store: SqlStore, queue: Services) -> None:
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
    store: SqlStore, queue: Services, state: str
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


def test_jobs_can_be_found_by_unique_name(queue: Services) -> None:
    a = queue.submission.submit(spec("only-one"))
    assert queue.reads.job("only-one").id == a.id
    queue.submission.submit(spec("twice"))
    queue.submission.submit(spec("twice"))
    with pytest.raises(NotFound, match="several"):
        queue.reads.job("twice")


# ---- manifests and host policies --------------------------------------------------------


def manifest_job(name: str, model: str, **kw: Any) -> JobSpecModel:
    return JobSpecModel(
        name=name, command=["python", "train.py"], manifest="plan", model=model, **kw
    )


def test_apply_twice_is_idempotent(store: SqlStore, queue: Services) -> None:
    w = register(queue, "w1")
    req = ManifestApply(
        name="plan",
        hosts=[HostModel(name="w1", priority=1)],
        jobs=[manifest_job("mlp", "mlp"), manifest_job("gbt", "gbt", hyper={"depth": 3})],
    )
    first = queue.submission.apply(req)
    assert len(first.created) == 2
    assert first.unchanged == []
    assert first.hosts == ["w1"]

    lease = claim(queue, w)
    queue.leases.finish(lease.job_id, lease.attempt, exit_code=0, error=None)
    statuses = {j.id: j.status for j in store.list_jobs()}

    second = service(store, FakeClock(), queue.blobs).submission.apply(req)
    assert second.created == []
    assert sorted(second.unchanged) == sorted(first.created)
    assert {j.id: j.status for j in store.list_jobs()} == statuses
    assert sorted(statuses.values()) == [JobStatus.PENDING, JobStatus.SUCCEEDED]

    grown = ManifestApply(
        name="plan", jobs=[*req.jobs, manifest_job("gru", "gru")], hosts=req.hosts
    )
    third = queue.submission.apply(grown)
    assert len(third.created) == 1
    assert sorted(third.unchanged) == sorted(first.created)
    assert len(store.list_jobs()) == 3


def test_host_policies_from_apply_limit_claims(store: SqlStore, queue: Services) -> None:
    queue.submission.apply(
        ManifestApply(
            name="plan",
            hosts=[
                HostModel(name="bert-box", allow_jobs=["bert*"]),
                HostModel(name="no-resnet", deny_jobs=["resnet*"]),
            ],
            jobs=[manifest_job("resnet-train", "resnet50")],
        )
    )
    fresh = service(store, FakeClock(), queue.blobs)
    bert_box = register(fresh, "bert-box")
    no_resnet = register(fresh, "no-resnet")
    anyone = register(fresh, "anyone")
    assert fresh.dispatch.try_claim(bert_box.id, CPU) is None
    assert fresh.dispatch.try_claim(no_resnet.id, CPU) is None
    lease = fresh.dispatch.try_claim(anyone.id, CPU)
    assert lease is not None
    assert lease.spec.model == "resnet50"


def test_host_declared_capability_from_apply(store: SqlStore, queue: Services) -> None:
    queue.submission.apply(
        ManifestApply(
            name="plan",
            hosts=[HostModel(name="shared-gpu", declared={"cuda": False})],
            jobs=[
                manifest_job("cuda-job", "gru", requirements={"require_cuda": True}),
            ],
        )
    )
    fresh = service(store, FakeClock(), queue.blobs)
    w = register(fresh, "shared-gpu", gpus=[("NVIDIA A100-SXM4-80GB", 80)])
    free = FreeResources(cpu_slots=1, gpus=(FreeGpu(0, 80 * GIB),))
    assert fresh.dispatch.try_claim(w.id, free) is None


# ---- unrunnable warnings ----------------------------------------------------------------


def test_unrunnable_job_is_flagged_at_submit(queue: Services) -> None:
    register(queue, "laptop")
    row = queue.submission.submit(spec("needs-gpu", requirements=Requirements(require_cuda=True)))
    assert row.unrunnable is not None
    assert "needs a GPU" in row.unrunnable
    assert "laptop" in row.unrunnable
    assert queue.reads.job(row.id).unrunnable == row.unrunnable
    assert queue.submission.submit(spec("cpu-ok")).unrunnable is None


def test_no_unrunnable_warning_without_workers(queue: Services) -> None:
    row = queue.submission.submit(spec("needs-gpu", requirements=Requirements(require_cuda=True)))
    assert row.unrunnable is None


def test_runnable_on_some_worker_is_not_flagged(queue: Services) -> None:
    register(queue, "laptop")
    register(queue, "gpu-box", gpus=[("NVIDIA L4", 24)])
    row = queue.submission.submit(spec("needs-gpu", requirements=Requirements(require_cuda=True)))
    assert row.unrunnable is None


# ---- tokens -----------------------------------------------------------------------------


def test_dashboard_sessions_live_until_they_end_sign_out_or_their_token_changes(
    store: SqlStore, clock: FakeClock
) -> None:
    auth = Auth(store, clock=lambda: clock.now)
    row, secret = auth.create("alice", Role.OPERATOR)
    _, session, ends = auth.sign_in(secret)
    assert ends == clock.now + 12 * 3600
    assert session.startswith("gs_") and session != secret
    assert store.session_token(session, clock.now) is None  # kept as a hash only
    assert auth.session(session).id == row.id
    auth.sign_out(session)
    with pytest.raises(Unauthorized, match="sign in again"):
        auth.session(session)

    _, session, _ = auth.sign_in(secret)
    clock.advance(12 * 3600 + 1)
    auth.forget()
    with pytest.raises(Unauthorized):
        auth.session(session)  # ended by time
    _, later, _ = auth.sign_in(secret)  # signing in drops ended sessions as it goes
    auth.rotate(row.id)
    with pytest.raises(Unauthorized):
        auth.session(later)  # the token changed: its sessions end
    worker_secret = auth.create("w", Role.WORKER)[1]
    with pytest.raises(Forbidden):
        auth.sign_in(worker_secret)


def test_jobs_page_back_by_cursor_and_filter_by_name(
    queue: Services, store: SqlStore, clock: FakeClock
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


def test_a_log_read_back_from_before_a_record(queue: Services, store: SqlStore) -> None:
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
    queue: Services, store: SqlStore
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


def test_a_server_key_is_made_once_and_read_alike_after(store: SqlStore) -> None:
    """The first server to ask makes the fleet's key; every later ask (any server sharing
    the database) reads that one, whatever it offers."""
    assert store.server_key("event-ids", "first") == "first"
    assert store.server_key("event-ids", "second") == "first"
    assert store.server_key("other", "third") == "third"


def test_tokens_are_stored_as_hashes_and_revocable(store: SqlStore, clock: FakeClock) -> None:
    auth = Auth(store, clock=lambda: clock.now)
    row, secret = auth.create("ci-runner", Role.SUBMITTER, ["vision", "nlp"])
    assert secret.startswith("gf_")
    assert row.hash == hashlib.sha256(secret.encode()).hexdigest()

    stored = store.token_by_hash(row.hash)
    assert stored == row
    assert stored.role == "submitter"
    assert stored.pools == ("vision", "nlp")
    assert stored.hint == secret[:7]
    assert stored.revoked_at is None
    for tok in store.list_tokens():
        assert secret not in repr(tok)
    assert store.token_by_hash(secret) is None

    other, other_secret = auth.create("worker-1", Role.WORKER)
    assert auth.check(f"Bearer {secret}").id == row.id
    with pytest.raises(Unauthorized):
        auth.check(f"Bearer {secret}x")
    with pytest.raises(Unauthorized):
        auth.check(None)

    clock.advance(7)
    auth.revoke(row.id)
    revoked = store.token_by_hash(row.hash)
    assert revoked is not None
    assert revoked.revoked_at == clock.now
    with pytest.raises(Unauthorized, match="revoked"):
        auth.check(f"Bearer {secret}")
    assert auth.check(f"Bearer {other_secret}").id == other.id
    with pytest.raises(NotFound):
        auth.revoke(row.id)
    assert store.count_tokens("submitter") == 0
    assert store.count_tokens("worker") == 1


def test_ensure_admin_creates_one_admin_once(store: SqlStore) -> None:
    auth = Auth(store)
    secret = auth.ensure_admin()
    assert secret is not None
    assert secret.startswith("gf_")
    assert auth.check(f"Bearer {secret}").role == "admin"
    assert auth.ensure_admin() is None


def orders(resp: HeartbeatResponse) -> dict[str, str]:
    """A heartbeat's orders by job id (these tests hold one lease per job)."""
    return {o.job_id: o.order for o in resp.orders}


def test_reapplying_a_changed_manifest_updates_pending_jobs_only(
    store: SqlStore, queue: Services
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


def test_a_worker_s_life_is_swept_and_every_step_is_an_event(
    store: SqlStore, clock: FakeClock, blobs: BlobService
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


def test_a_postgresql_claim_reads_no_more_than_the_jobs_it_needs(
    store: SqlStore, queue: Services
) -> None:
    """With statistics that lag a large apply (here: none yet), PostgreSQL planned the
    claim's reads of the aimed jobs, and its pick of the chosen ids, as walks of every
    pending job: each claim cost O(queue) (about 2,000 index entries a claim in
    bench/claims.py). They must come from the target index and the primary key."""
    if getattr(store, "dialect", None) != "postgresql":
        pytest.skip("a PostgreSQL plan")
    jobs = [(f"j-{n:04d}", spec(f"q{n}"), None) for n in range(400)]
    store.submit(Batch(jobs), T0)
    w = register(queue, "box").id
    ids = [f"j-{n:04d}" for n in range(200, 204)]

    def plan(sql: str, params: Any) -> str:
        with store.engine.connect() as conn:
            cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
            cursor.execute("EXPLAIN (FORMAT JSON) " + sql, params)
            return json.dumps(cursor.fetchone()[0])

    view = plan(_VIEW_POSTGRES, (T0, w))
    assert "ix_jobs_target" in view and "ix_jobs_queue" not in view, view
    pick = plan(_FIRST_FREE, (ids, ids))
    assert "jobs_pkey" in pick and "ix_jobs_queue" not in pick, pick
    fleet = plan(PostgresStore.aimed_jobs_sql, ())
    assert "ix_jobs_target" in fleet and "ix_jobs_queue" not in fleet, fleet


def test_a_postgresql_batch_holds_its_jobs_rows_before_it_writes(store: SqlStore) -> None:
    """A batch of reports (``transaction``) locks its jobs' rows first, in id order, as a
    heartbeat extending several leases takes them: a batch that held one row while it
    waited for another could deadlock with a heartbeat taking them the other way."""
    if getattr(store, "dialect", None) != "postgresql":
        pytest.skip("PostgreSQL's row locks")
    store.submit(Batch([(f"j-{n}", spec(f"q{n}"), None) for n in range(3)]), T0)
    locked = "SELECT id FROM jobs WHERE id = '{}' FOR UPDATE NOWAIT"
    with store.transaction(["j-1", "j-0"]), store.engine.connect() as other:
        for held in ("j-0", "j-1"):  # before any write of the batch
            with pytest.raises(sa.exc.OperationalError, match="could not obtain lock"):
                other.exec_driver_sql(locked.format(held))
            other.rollback()
        other.exec_driver_sql(locked.format("j-2"))  # not one of the batch's
        other.rollback()


def test_claims_read_the_queue_in_the_order_of_its_index(tmp_path: Path) -> None:
    """The claim page walks ix_jobs_queue in claim order. A migration that rebuilt the
    table once dropped the index's "priority DESC", and every claim then sorted the whole
    queue (claims went from about 560 to 200 a second). SQLite only: its plan does not
    depend on the table's size, PostgreSQL's does."""
    store = open_store(f"sqlite:///{tmp_path}/plan.db")
    store.migrate()
    params = {"pool": "default", "now": T0, "p": 0, "c": T0, "i": "j-1", "n": 8}

    def plan(statement: Any) -> str:
        compiled = statement.compile(store.engine)
        values = compiled.construct_params(params)
        with store.engine.connect() as conn:
            rows = conn.exec_driver_sql(
                f"EXPLAIN QUERY PLAN {compiled}",
                tuple(values[k] for k in compiled.positiontup or ()),
            ).all()
        return " | ".join(str(row[-1]) for row in rows)

    head, after = store.page_q
    steps = plan(head)
    assert "ix_jobs_queue" in steps and "TEMP B-TREE" not in steps, steps
    # The next page starts where the last one ended (the position is in the index's
    # search, not a filter on a walk from the queue's head); only its own 2 x 8 rows
    # are sorted.
    steps = plan(after)
    assert (
        "USING INDEX ix_jobs_queue (status=? AND pool=? AND priority=? AND (created_at,id)>(?,?))"
        in steps
    ), steps
    assert "USING INDEX ix_jobs_queue (status=? AND pool=? AND priority<?)" in steps, steps
    # The jobs aimed at the claiming worker come from the small partial index, not from a
    # walk of the whole queue (which made every claim cost O(pending jobs)).
    with store.engine.connect() as conn:
        aimed = conn.exec_driver_sql(
            f"EXPLAIN QUERY PLAN {_VIEW_SQLITE}", ("w-1", "w-1", "box", "default", T0, "w-1")
        ).all()
    assert "ix_jobs_target" in " | ".join(str(row[-1]) for row in aimed), aimed
    # So do every worker's aimed jobs, read for `status` and each worker's free slots (a
    # walk of the queue made `status` cost 150 ms with 100,000 jobs pending)
    with store.engine.connect() as conn:
        fleet = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {SqliteStore.aimed_jobs_sql}").all()
    steps = " | ".join(str(row[-1]) for row in fleet)
    assert "ix_jobs_target" in steps and "ix_jobs_queue" not in steps, steps
    # The jobs list's newest page reads 50 rows of an index, never sorts every job
    listed: list[str] = []
    sa.event.listen(
        store.engine, "before_cursor_execute", lambda *a: listed.append(a[2]), named=False
    )
    store.list_jobs(limit=50)
    with store.engine.connect() as conn:
        newest = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {listed[-1]}", (50, 0)).all()
    steps = " | ".join(str(row[-1]) for row in newest)
    assert "ix_jobs_created" in steps and "TEMP B-TREE" not in steps, steps
    store.close()


# ---- dependency cascades ----------------------------------------------------------------


def test_a_failure_fails_a_chain_of_5000_dependents_at_once(
    store: SqlStore, queue: Services, clock: FakeClock
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


def test_a_lost_lease_fails_dependents_naming_the_final_status(
    store: SqlStore, queue: Services, clock: FakeClock
) -> None:
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


def test_a_job_submitted_after_its_dependency_failed_fails_at_once(
    store: SqlStore, queue: Services, clock: FakeClock
) -> None:
    root = queue.submission.submit(spec("prep"))
    queue.steering.cancel(root.id)
    two = [("a", spec("a"), None), ("b", spec("b"), None)]
    store.submit(Batch(two, deps={"a": [root.id], "b": ["a"]}), clock.now)
    assert job(store, "a").error == f"dependency prep ({root.id}) cancelled: cancelled"
    assert job(store, "b").status is JobStatus.FAILED
    assert job(store, "b").error == "dependency a (a) failed: " + str(job(store, "a").error)


def test_a_crash_during_the_cascade_leaves_the_finish_undone_too(
    store: SqlStore, queue: Services, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
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


def test_a_claim_ranked_on_a_stale_snapshot_takes_nothing(
    store: SqlStore, queue: Services, clock: FakeClock
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


def test_a_stored_spec_the_api_would_refuse_now_is_still_listed_and_claimed(
    store: SqlStore, queue: Services
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


def test_a_claim_ranked_on_a_spec_a_manifest_changed_since_takes_nothing(
    store: SqlStore, queue: Services, clock: FakeClock
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
    store: SqlStore, queue: Services, clock: FakeClock
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


def test_retention_deletes_finished_jobs_output_and_old_audit_records_only(
    store: SqlStore, clock: FakeClock, blobs: BlobService
) -> None:
    """Output of a job that ended past the retention goes (the job and its history stay);
    a running job's output, a recent job's and recent audit records stay, and a job's
    line numbers go on."""
    day = 86400.0
    settings = QueueSettings(lease_timeout=LEASE, log_retention=7 * day, audit_retention=30 * day)
    q = Services(store, settings, blobs, clock=lambda: clock.now)
    w = register(q, "w", cpu_slots=3)
    ids = [q.submission.submit(spec(n, max_attempts=1)).id for n in ("old", "recent", "running")]
    for _ in ids:
        lease = claim(q, w)
        q.leases.append_logs(
            lease.job_id, lease.attempt, [("stdout", f"{lease.job_id} {n}") for n in range(7)]
        )
    store.insert_audit([{"at": clock.now, "address": "-", "event": "x", "target": "old"}])
    q.leases.finish(ids[0], 1, exit_code=0, error=None)
    clock.advance(10 * day)
    q.leases.finish(ids[1], 1, exit_code=1, error=None)
    store.insert_audit([{"at": clock.now, "address": "-", "event": "x", "target": "new"}])
    last = max(r.seq for r in store.logs(ids[2], 0, 100))

    # the old job's lines and its 3 status changes; the audit record is 10 days old
    assert q.retention.run() == 7 + 3
    assert [len(store.logs(i, 0, 100, streams=OUT)) for i in ids] == [0, 7, 7]
    assert job(store, ids[0]).status is JobStatus.SUCCEEDED
    assert [a.outcome for a in store.attempts(ids[0])] == ["succeeded"]
    clock.advance(25 * day)
    assert q.retention.run() == 7 + 3 + 1  # now the recent job's records and the first audit
    assert [a.target for a in store.audit(0, 10)] == ["new"]
    q.leases.append_logs(ids[2], 1, [("stdout", "later")])
    assert (
        store.logs(ids[2], last, 100, streams=OUT)[0].line == "later"
    )  # a follower's cursor holds
    assert q.retention.run() == 0


def test_job_counts_follow_every_change_and_a_fold(queue: Services, store: SqlStore) -> None:
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


def test_a_postgresql_store_reconnects_after_its_connections_were_closed(
    store: SqlStore, queue: Services, pg_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database restart closes every pooled connection. One idle for a while is checked
    before use, so the call after the restart is answered, not failed."""
    if getattr(store, "dialect", None) != "postgresql":
        pytest.skip("PostgreSQL's connections")
    import psycopg

    import gpufleet.store.postgres.store as sql

    made = queue.submission.submit(spec("kept"))
    assert store.get_job(made.id) is not None  # a pooled connection now exists
    with store.engine.connect() as conn:
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    monkeypatch.setattr(sql, "IDLE_PING", 0.0)  # as if it had sat idle
    job = store.get_job(made.id)
    assert job is not None and job.name == "kept"
