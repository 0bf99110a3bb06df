"""``server/submission.py``: a manifest applied twice is applied once, and a job no
registered worker could run is flagged when it is submitted.
"""

from __future__ import annotations

from gpufleet.domain.models import JobStatus, Requirements
from gpufleet.server.services import Services
from gpufleet.store import Store
from gpufleet.wire import HostModel, ManifestApply
from tests.queue_steps import FakeClock, claim, manifest_job, register, service, spec

# ---- manifests -----------------------------------------------------------------------


def test_apply_twice_is_idempotent(store: Store, queue: Services) -> None:
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


# ---- unrunnable warnings -------------------------------------------------------------


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
