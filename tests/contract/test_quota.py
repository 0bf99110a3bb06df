"""Output quotas, in every store: what an attempt stores of its output, the marker and
the event of a cut, the bytes counted and dropped, and one quota for servers sharing one
database."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.domain.models import JobSpec
from gpufleet.domain.quota import MARKER, ROW_BYTES, OutputQuota, line_cost
from gpufleet.scheduling.matching import FreeResources
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.server.services import Services
from gpufleet.server.settings import QueueSettings
from gpufleet.store import AttemptRow, SqlStore, Store, open_store
from gpufleet.store.blobfiles import BlobFiles
from gpufleet.wire import CapabilityModel, Lease, WorkerRegister

T0 = 1_700_000_000.0
KIB = 1024
QUOTA = OutputQuota(total=64 * KIB, rate=KIB, burst=8 * KIB)
OUT = ("stdout", "stderr")


class Clock:
    def __init__(self) -> None:
        self.now = T0


def services(store: Store, tmp_path: Path, clock: Clock) -> Services:
    blobs = BlobService(store, BlobFiles(tmp_path / "blobs"), BlobSettings())
    settings = QueueSettings(output_quota=QUOTA)
    return Services(store, settings, blobs, clock=lambda: clock.now)


def running(q: Services) -> Lease:
    """A job claimed (at the clock's now) and started by a fresh worker."""
    q.submission.submit(JobSpec(name="chatty", command=("python", "chatty.py")))
    cap = CapabilityModel(hostname="box", cores=8, ram_mib=1024, gpus=[])
    w = q.fleet.register(WorkerRegister(name="box", capability=cap, cpu_slots=1), "default", None)
    lease = q.dispatch.try_claim(w.id, FreeResources(cpu_slots=1))
    assert lease is not None
    q.leases.start(lease.job_id, lease.attempt)
    return lease


def line(n: int, tag: str = "x") -> tuple[str, str]:
    """A stdout line that costs ``n`` bytes of the quota."""
    return ("stdout", tag * (n - 1 - ROW_BYTES))


def output(store: Store, job_id: str) -> list[tuple[str, str]]:
    return [(r.stream, r.line) for r in store.logs(job_id, 0, 10_000, OUT)]


def cut_events(store: Store, job_id: str) -> list[dict[str, object]]:
    found = [json.loads(r.line) for r in store.logs(job_id, 0, 10_000, ["state"])]
    return [r for r in found if r["event"] == "output_cut"]


def account(store: Store, job_id: str) -> AttemptRow:
    [attempt] = store.attempts(job_id)
    return attempt


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_output_past_the_quota_is_cut_with_one_marker_and_one_event(
    store: Store, tmp_path: Path, clock: Clock
) -> None:
    q = services(store, tmp_path, clock)
    lease = running(q)
    send = [line(3 * KIB, "a"), line(3 * KIB, "b"), ("progress", '{"step": 1}'), line(3 * KIB)]
    q.leases.append_logs(lease.job_id, lease.attempt, send)
    q.leases.append_logs(lease.job_id, lease.attempt, [line(100), ("progress", '{"step": 2}')])
    stored = output(store, lease.job_id)
    assert stored[:2] == send[:2]
    assert len(stored) == 3 and stored[2][0] == "stderr" and stored[2][1].startswith(MARKER)
    [event] = cut_events(store, lease.job_id)
    assert event["status"] == "running" and event["attempt"] == lease.attempt
    assert "output rate of 1 KiB/s" in str(event["why"])
    # progress records are counted and cut like output (the first fit, the second came
    # during the cut), yet the job's row keeps its latest progress: show stays current
    assert json.loads(store.get_job(lease.job_id).progress or "{}") == {"step": 2}  # type: ignore[union-attr]
    progress = [json.loads(r.line) for r in store.logs(lease.job_id, 0, 100, ["progress"])]
    assert progress == [{"step": 1}]
    a = account(store, lease.job_id)
    first, second = line_cost('{"step": 1}'), line_cost('{"step": 2}')
    assert (a.output_bytes, a.output_dropped, a.output_cut) == (
        6 * KIB + first,
        3 * KIB + 100 + second,
        True,
    )


def test_a_rate_cut_ends_once_half_the_burst_is_back(
    store: Store, tmp_path: Path, clock: Clock
) -> None:
    q = services(store, tmp_path, clock)
    lease = running(q)
    send = [line(5 * KIB, "a"), line(5 * KIB, "b")]
    q.leases.append_logs(lease.job_id, lease.attempt, send)  # 3 KiB of room: b is cut
    clock.now += 0.5  # 3.5 KiB of room: still cut
    q.leases.append_logs(lease.job_id, lease.attempt, [line(100, "c")])
    clock.now += 0.5  # 4 KiB, half the 8 KiB burst: stored again
    q.leases.append_logs(lease.job_id, lease.attempt, [line(100, "d"), line(9 * KIB, "e")])
    stored = output(store, lease.job_id)
    assert [s[1][:1] for s in stored] == ["a", "[", "d", "["]
    assert len(cut_events(store, lease.job_id)) == 2
    a = account(store, lease.job_id)
    assert a.output_dropped == 5 * KIB + 100 + 9 * KIB
    assert a.output_bytes == 5 * KIB + 100


def test_a_batch_sent_again_is_counted_once(store: Store, tmp_path: Path, clock: Clock) -> None:
    q = services(store, tmp_path, clock)
    lease = running(q)
    for _ in range(3):  # its answer was lost, twice
        q.leases.append_logs(lease.job_id, lease.attempt, [line(KIB), line(KIB)], 0)
    assert account(store, lease.job_id).output_bytes == 2 * KIB
    assert len(output(store, lease.job_id)) == 2


def test_servers_sharing_a_database_keep_one_quota(
    store: Store, tmp_path: Path, clock: Clock
) -> None:
    """Two servers (two stores on one database) take turns at one attempt's output: the
    total stored is the one quota's, and the cut is marked once."""
    if not isinstance(store, SqlStore):
        pytest.skip("a memory store is one server's alone")
    other = open_store(store.url)
    try:
        one, two = services(store, tmp_path / "1", clock), services(other, tmp_path / "2", clock)
        lease = running(one)
        clock.now += 3600  # the whole 64 KiB is allowed by now
        for n in range(20):
            q = (one, two)[n % 2]
            q.leases.append_logs(lease.job_id, lease.attempt, [line(4 * KIB, "ab"[n % 2])])
    finally:
        other.close()
    stored = output(store, lease.job_id)
    assert len(stored) == 17 and stored[-1][1].startswith(MARKER)
    assert "output quota of 64 KiB" in stored[-1][1]
    assert len(cut_events(store, lease.job_id)) == 1
    a = account(store, lease.job_id)
    assert (a.output_bytes, a.output_dropped) == (64 * KIB, 4 * 4 * KIB)
