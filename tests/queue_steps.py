"""The queue as tests drive it: Services on a fake clock, and the steps they take with it
(register a worker, submit, claim). Shared by the contract, service and backend tests,
whose conftests import the fixtures (``clock``, ``blobs``, ``queue``) and give each its
own ``store``.

Time comes from the fake clock the tests advance; nothing here sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpufleet.domain.models import JobSpec, Requirements
from gpufleet.scheduling.matching import FreeResources
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.server.services import Services
from gpufleet.server.settings import QueueSettings
from gpufleet.store import JobRow, Store, WorkerRow
from gpufleet.store.blobfiles import BlobFiles
from gpufleet.wire import (
    CapabilityModel,
    GpuModel,
    HeartbeatResponse,
    JobSpecModel,
    Lease,
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


def service(store: Store, clock: FakeClock, blobs: BlobService) -> Services:
    return Services(store, SETTINGS, blobs, clock=lambda: clock.now)


def blob_service(store: Store, tmp_path: Path) -> BlobService:
    """Blobs kept as files under ``tmp_path``, their rows in ``store``."""
    blobs = BlobService(store, BlobFiles(tmp_path / "blobs"), BlobSettings())
    blobs.startup()
    return blobs


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def blobs(store: Store, tmp_path: Path) -> BlobService:
    return blob_service(store, tmp_path)


@pytest.fixture
def queue(store: Store, clock: FakeClock, blobs: BlobService) -> Services:
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


def job(store: Store, job_id: str) -> JobRow:
    row = store.get_job(job_id)
    assert row is not None
    return row


def orders(resp: HeartbeatResponse) -> dict[str, str]:
    """A heartbeat's orders by job id (these tests hold one lease per job)."""
    return {o.job_id: o.order for o in resp.orders}


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


def manifest_job(name: str, model: str, **kw: Any) -> JobSpecModel:
    """A job of the manifest "plan"."""
    return JobSpecModel(
        name=name, command=["python", "train.py"], manifest="plan", model=model, **kw
    )
