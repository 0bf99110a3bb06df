"""GPU use as workers report it: each heartbeat carries free memory and utilisation
(NVML, through the fake driver at the boundary), shown in `workers` and in /metrics."""

from __future__ import annotations

import json
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import Fleet, wait_for

pytestmark = pytest.mark.e2e

GIB = 1024


def test_workers_and_metrics_show_each_gpus_memory_and_utilisation(fleet: Fleet) -> None:
    fleet.start_server()
    described = [
        {"name": "NVIDIA A100", "total_mib": 40 * GIB, "free_mib": 30 * GIB, "util": 87},
        {"name": "NVIDIA T4", "total_mib": 16 * GIB, "free_mib": 16 * GIB},  # no utilisation
    ]
    fleet.start_gpu_worker("gpu-box", [], env_extra={"FAKE_NVML_GPUS": json.dumps(described)})

    def listed() -> list[dict[str, object]] | None:
        workers = json.loads(fleet.cli("workers", "--json").stdout)
        gpus = workers[0]["gpus"] if workers else []
        return gpus if gpus and gpus[0].get("util_percent") == 87 else None

    gpus = wait_for(listed, 20, "the heartbeat to carry utilisation")
    assert [g["util_percent"] for g in gpus] == [87, None]
    assert "87%" in fleet.cli("workers").stdout

    with fleet.client() as c:
        token = c._token
    r = httpx.get(f"{fleet.url}/metrics", headers={"Authorization": f"Bearer {token}"})
    samples = {
        (s.name, s.labels.get("gpu")): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
        if s.labels.get("worker") == "gpu-box"
    }
    assert samples[("gpufleet_gpu_utilization_ratio", "0")] == pytest.approx(0.87)
    assert ("gpufleet_gpu_utilization_ratio", "1") not in samples
    assert samples[("gpufleet_gpu_memory_used_bytes", "0")] == 10 * 2**30
    assert samples[("gpufleet_gpu_memory_total_bytes", "1")] == 16 * 2**30


def test_a_running_job_shows_the_gpu_memory_its_processes_use(fleet: Fleet) -> None:
    """The fake driver lists the job's own process on GPU 0 (the job writes its pid where
    the driver reads): the worker counts it for that job, and `show` says so."""
    fleet.start_server()
    processes = fleet.root / "nvml-processes.json"
    fleet.start_gpu_worker(
        "gpu-box",
        [("NVIDIA A100", 40, 40)],
        env_extra={"FAKE_NVML_PROCESSES": str(processes)},
    )
    script = (
        "import json, os, sys, time\n"
        f"json.dump({{'0': [[os.getpid(), 3072]]}}, open({str(processes)!r}, 'w'))\n"
        "time.sleep(60)\n"
    )
    out = fleet.cli("submit", "--require-cuda", "--", sys.executable, "-c", script).stdout
    job = out.split()[-1]
    fleet.wait_status(job, "running")
    with fleet.client() as c:
        found = wait_for(lambda: c.job(job).gpu_mib == 3072, 20, "the job's GPU memory")
        assert found
    assert "GPU memory in use: 3.0 GiB" in fleet.cli("show", job).stdout
    fleet.cli("cancel", job)
    done = fleet.wait_status(job, "cancelled")
    assert done["gpu_mib"] is None  # only while it runs
