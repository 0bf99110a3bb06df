"""Job environments, in every store: a pool's lock of an unlocked spec (the first
recorded stands, an upgrade replaces it), which workers have a spec built, the class of an
attempt's failure (an environment that cannot be built fails the job at once, one that
failed for a passing reason is retried), and the environment an attempt ran in."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from gpufleet.domain.environments import EnvSpec
from gpufleet.domain.models import JobSpec, JobStatus
from gpufleet.scheduling.matching import FreeResources
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.server.services import Services
from gpufleet.server.settings import QueueSettings
from gpufleet.store import EnvLockRow, Store, WorkerRow
from gpufleet.store.blobfiles import BlobFiles
from gpufleet.wire import (
    CapabilityModel,
    EnvBuiltModel,
    EnvUsed,
    HeartbeatRequest,
    Lease,
    WorkerRegister,
)

T0 = 1_700_000_000.0
BACKOFF = 10.0
KEY, SPEC, BUILD = "a" * 64, "b" * 64, "c" * 64
NOT_FOUND = "environment: No solution found: nonexistent-pkg was not found in the registry"


class Clock:
    def __init__(self) -> None:
        self.now = T0


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def q(store: Store, tmp_path: Path, clock: Clock) -> Services:
    blobs = BlobService(store, BlobFiles(tmp_path / "blobs"), BlobSettings())
    settings = QueueSettings(retry_backoff=BACKOFF)
    return Services(store, settings, blobs, clock=lambda: clock.now)


def lock(sha: str = "1" * 64, job: str = "j-1", at: float = T0, **kw: object) -> EnvLockRow:
    row = EnvLockRow("default", KEY, sha, SPEC, "3.12", "cu124", job, "box", at)
    return replace(row, **kw)  # type: ignore[arg-type]


def worker(q: Services, name: str, pool: str = "default") -> WorkerRow:
    cap = CapabilityModel(hostname=name, cores=8, ram_mib=1024, gpus=[])
    return q.fleet.register(WorkerRegister(name=name, capability=cap, cpu_slots=1), pool, None)


def built(spec_key: str, key: str = BUILD) -> EnvBuiltModel:
    return EnvBuiltModel(
        key=key,
        spec_key=spec_key,
        python="3.12.4",
        size_bytes=123_456_789,
        last_used=T0,
        describe="requirements.txt, --python 3.12",
    )


def running(q: Services, max_attempts: int = 3) -> Lease:
    """A job with an environment, claimed by a fresh worker."""
    env = EnvSpec(with_=("numpy>=2",), python="3.12")
    spec = JobSpec(
        name="train", command=("python", "t.py"), max_attempts=max_attempts, environment=env
    )
    q.submission.submit(spec)
    w = worker(q, "box")
    lease = q.dispatch.try_claim(w.id, FreeResources(cpu_slots=1))
    assert lease is not None
    return lease


# ---- each pool's locks -------------------------------------------------------------------


def test_the_first_lock_recorded_for_a_key_stands_and_an_upgrade_replaces_it(
    store: Store,
) -> None:
    assert store.get_env_lock("default", KEY) is None
    first = lock()
    assert store.put_env_lock(first, replace=False) == (first, True)
    # a second build of the spec, finished later, gets the recorded lock back
    assert store.put_env_lock(lock("2" * 64, "j-2", T0 + 5), replace=False) == (first, False)
    assert store.get_env_lock("default", KEY) == first
    # a job asking for a fresh resolution replaces it; the key's first date is kept
    got, created = store.put_env_lock(lock("3" * 64, "j-3", T0 + 9), replace=True)
    assert not created
    assert (got.sha256, got.job_id, got.created_at, got.replaced_at) == (
        "3" * 64,
        "j-3",
        T0,
        T0 + 9,
    )
    assert store.get_env_lock("default", KEY) == got
    assert store.get_env_lock("default", "f" * 64) is None


def test_two_first_builds_ending_at_once_record_one_lock(store: Store) -> None:
    rows = [lock(str(n) * 64, f"j-{n}", T0 + n) for n in range(1, 5)]
    answers: list[tuple[EnvLockRow, bool]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(len(rows))

    def put(row: EnvLockRow) -> None:
        try:
            start.wait(10)
            answers.append(store.put_env_lock(row, replace=False))
        except BaseException as exc:  # raised below
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(r,)) for r in rows]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert sum(created for _, created in answers) == 1
    [winner] = [row for row, created in answers if created]
    assert {row for row, _ in answers} == {winner}  # every build got the same lock
    assert store.get_env_lock("default", KEY) == winner


def test_a_pools_lock_is_its_own_and_answers_no_other_pool(store: Store) -> None:
    mine = lock(pool="a")
    assert store.put_env_lock(mine, replace=False) == (mine, True)
    assert store.get_env_lock("b", KEY) is None  # pool b's workers resolve for themselves
    theirs = lock("2" * 64, "j-2", T0 + 5, pool="b")
    assert store.put_env_lock(theirs, replace=False) == (theirs, True)
    # an upgrade in pool b replaces b's lock only
    got, _ = store.put_env_lock(lock("3" * 64, "j-3", T0 + 9, pool="b"), replace=True)
    assert (got.pool, got.sha256) == ("b", "3" * 64)
    assert store.get_env_lock("a", KEY) == mine
    assert store.get_env_lock("b", KEY) == got


# ---- what each worker has built ----------------------------------------------------------


def test_a_heartbeat_listing_a_workers_environments_tells_who_has_a_spec_built(
    store: Store, q: Services
) -> None:
    a, b, c = worker(q, "a"), worker(q, "b"), worker(q, "c", pool="other")
    q.leases.heartbeat(a.id, HeartbeatRequest(environments=[built(SPEC), built("d" * 64)]))
    q.leases.heartbeat(b.id, HeartbeatRequest(environments=[built("d" * 64)]))
    q.leases.heartbeat(c.id, HeartbeatRequest(environments=[built(SPEC)]))
    assert store.workers_with_env(SPEC) == [a.id, c.id]
    assert store.workers_with_env(SPEC, ["default"]) == [a.id]
    assert store.workers_with_env("d" * 64) == [a.id, b.id]
    # a build key (in the same lists) is not a spec key
    assert store.workers_with_env(BUILD) == []
    shown = q.fleet.worker(a.id).environments
    assert [(e.key, e.spec_key, e.size_bytes, e.describe) for e in shown] == [
        (BUILD, SPEC, 123_456_789, "requirements.txt, --python 3.12"),
        (BUILD, "d" * 64, 123_456_789, "requirements.txt, --python 3.12"),
    ]

    q.leases.heartbeat(a.id, HeartbeatRequest())  # None: unchanged
    assert store.workers_with_env(SPEC) == [a.id, c.id]
    q.leases.heartbeat(a.id, HeartbeatRequest(environments=[]))  # its cache emptied
    assert store.workers_with_env(SPEC) == [c.id]
    assert q.fleet.worker(a.id).environments == ()


def test_a_waiting_worker_that_has_just_built_a_spec_is_the_one_left_its_jobs(
    q: Services,
) -> None:
    # Both poll and wait before the warm one's heartbeat lists what it built: the job is
    # still left to it, not to whichever worker asks first.
    env = EnvSpec(with_=("numpy>=2",), python="3.12")
    warm, cold = worker(q, "warm"), worker(q, "cold")
    free = FreeResources(cpu_slots=1)
    q.dispatch.wait_begin(warm.id, free)
    q.dispatch.wait_begin(cold.id, free)
    q.leases.heartbeat(warm.id, HeartbeatRequest(environments=[built(env.key())]))
    job = q.submission.submit(JobSpec(name="t", command=("python", "t.py"), environment=env))
    assert q.dispatch.try_claim(cold.id, free) is None
    lease = q.dispatch.try_claim(warm.id, free)
    assert lease is not None and lease.job_id == job.id


# ---- failure classes --------------------------------------------------------------------


def _state(store: Store, job_id: str) -> dict[str, object]:
    said = [r for r in store.logs(job_id, 0, 100) if r.stream == "state"][-1]
    record: dict[str, object] = json.loads(said.line)
    return record


def test_an_environment_no_worker_can_build_fails_the_job_at_once(
    store: Store, q: Services
) -> None:
    lease = running(q, max_attempts=3)
    row = q.leases.finish(
        lease.job_id, lease.attempt, None, NOT_FOUND, failure="environment", final=True
    )
    assert (row.status, row.attempts, row.failure) == (JobStatus.FAILED, 1, "environment")
    assert row.error is not None and row.error.startswith(NOT_FOUND)
    assert "not retried: the environment cannot be built on any worker" in row.error
    [attempt] = store.attempts(lease.job_id)
    assert (attempt.failure, attempt.outcome) == ("environment", "failed")
    said = _state(store, lease.job_id)
    assert said["failure"] == "environment"
    assert said["not_retried"] == "not retried: the environment cannot be built on any worker"


def test_an_environment_that_failed_for_a_passing_reason_is_retried_and_success_clears_it(
    store: Store, q: Services, clock: Clock
) -> None:
    lease = running(q)
    row = q.leases.finish(
        lease.job_id, lease.attempt, None, "environment: connection reset", failure="environment"
    )
    assert (row.status, row.attempts, row.failure) == (JobStatus.PENDING, 1, "environment")
    assert row.not_before == clock.now + BACKOFF
    assert _state(store, lease.job_id)["failure"] == "environment"
    clock.now += BACKOFF
    w = q.fleet.worker("box")
    again = q.dispatch.try_claim(w.id, FreeResources(cpu_slots=1))
    assert again is not None and again.attempt == 2
    done = q.leases.finish(again.job_id, again.attempt, 0, None)
    assert (done.status, done.failure) == (JobStatus.SUCCEEDED, None)
    assert [a.failure for a in store.attempts(lease.job_id)] == ["environment", None]


def test_a_requeue_clears_the_failure_class_as_it_clears_the_error(
    store: Store, q: Services
) -> None:
    lease = running(q, max_attempts=1)
    failed = q.leases.finish(lease.job_id, lease.attempt, None, None, failure="environment")
    assert (failed.status, failed.failure) == (JobStatus.FAILED, "environment")
    assert failed.error == "the environment could not be built"
    row = q.steering.requeue(lease.job_id)
    assert (row.status, row.error, row.failure) == (JobStatus.PENDING, None, None)
    assert store.attempts(lease.job_id)[0].failure == "environment"  # the history keeps it


# ---- the environment an attempt ran in ------------------------------------------------------


def test_a_start_keeps_the_environment_its_attempt_ran_in_and_counts_the_build(
    store: Store, q: Services
) -> None:
    lease = running(q)
    used = EnvUsed(
        key=BUILD,
        spec_key=SPEC,
        python="3.12.4",
        built=True,
        seconds=42.5,
        versions={"numpy": "2.1.3"},
        torch_backend=None,
    )
    q.leases.start(lease.job_id, lease.attempt, environment=used)
    q.leases.start(lease.job_id, lease.attempt, environment=used)  # retried: counted once
    [attempt] = store.attempts(lease.job_id)
    assert attempt.environment is not None
    assert EnvUsed.model_validate_json(attempt.environment) == used
    r = q.metrics.registry
    assert r.get_sample_value("gpufleet_environment_builds_total", {"result": "built"}) == 1
    assert r.get_sample_value("gpufleet_environment_build_seconds_count") == 1
    assert r.get_sample_value("gpufleet_environment_build_seconds_sum") == 42.5
    reused = r.get_sample_value("gpufleet_environment_builds_total", {"result": "reused"})
    assert (reused or 0) == 0
