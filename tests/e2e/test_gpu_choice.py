"""Choosing a GPU machine gets its GPU, a freed GPU is taken at once, and two users racing
for one worker cannot both have it.

Real server and worker processes; GPUs come from the fake ``pynvml`` on each worker's
PYTHONPATH (tests/fake_nvml), so the worker's real NVML code runs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from datetime import datetime

import pytest

from gpufleet.errors import Conflict
from gpufleet.wire import JobSpecModel, RequirementsModel
from tests.e2e.conftest import Fleet, Proc, wait_for

pytestmark = pytest.mark.e2e

A100 = ("NVIDIA A100-PCIE-40GB", 40, 38)
SHOW_GPU = [
    "--",
    sys.executable,
    "-c",
    "import os; print('gpus=' + os.environ['CUDA_VISIBLE_DEVICES'])",
]


def _session(proc: Proc) -> str:
    found = wait_for(lambda: re.search(r"session: (gfs1_\S+)", proc.text()), 20, "a session")
    return str(found.group(1))


def _ran(fleet: Fleet, job_id: str) -> tuple[str, list[int], str]:
    """Where a succeeded job ran: its worker, its GPUs and what it printed."""
    job = fleet.wait_status(job_id, "succeeded", "failed")
    assert job["status"] == "succeeded", job
    with fleet.client() as c:
        printed = "\n".join(line.line for line in c.logs(job_id).lines)
    return job["worker"], job["gpus"], printed


def test_choosing_a_gpu_worker_gives_the_job_its_gpu(fleet: Fleet) -> None:
    fleet.start_server()
    gpu = fleet.start_gpu_worker("a100", [A100], "--labels", "gpu_type=a100")
    fleet.start_worker("laptop", "--slots", "2")
    ways = {
        "--auto-select": ["--auto-select"],
        "--worker": ["--worker", "a100"],
        "--session": ["--session", _session(gpu)],
        "--gpu-name alone": ["--gpu-name", "a100*"],
        "a GPU label alone": ["--label", "gpu_type=a100*"],
    }
    for what, flags in ways.items():
        job_id = fleet.cli("submit", *flags, *SHOW_GPU).stdout.split()[-1]
        worker, gpus, printed = _ran(fleet, job_id)
        assert (worker, gpus) == ("a100", [0]), f"{what}: ran on {worker} GPUs {gpus}"
        assert "gpus=0" in printed, (what, printed)

    # --cpu keeps a job aimed at a GPU machine in a CPU slot, on purpose.
    job_id = fleet.cli("submit", "--worker", "a100", "--cpu", *SHOW_GPU).stdout.split()[-1]
    assert _ran(fleet, job_id)[:2] == ("a100", [])
    # ... and cannot be combined with a GPU requirement.
    both = fleet.cli("submit", "--cpu", "--gpu-name", "a100*", *SHOW_GPU, check=False)
    assert both.returncode != 0 and "--cpu" in both.stderr and "gpu_name" in both.stderr


def test_a_freed_gpu_is_taken_at_once(fleet: Fleet) -> None:
    """A 1-GPU worker polls with its CPU slot free while its GPU runs a job; the moment
    the GPU frees, the queued GPU job must start, not at the poll's next round."""
    fleet.start_server()
    fleet.start_gpu_worker("gpu-small", [("NVIDIA GeForce RTX 3060", 12, 11)])
    # The first job holds the GPU until the test lets it go (at most 60 s).
    release = fleet.root / "release-the-gpu"
    holder = (
        f"import os, time\nfor _ in range(3000):\n    if os.path.exists({str(release)!r}): "
        "break\n    time.sleep(0.02)"
    )
    first = fleet.cli("submit", "--require-cuda", "--", sys.executable, "-c", holder)
    first_id = first.stdout.split()[-1]
    fleet.wait_status(first_id, "running")
    second = fleet.cli("submit", "--require-cuda", *SHOW_GPU).stdout.split()[-1]
    assert fleet.job(second)["status"] == "pending"
    why = " ".join(fleet.cli("why", second).stdout.split())
    assert "every worker that could run it is busy" in why, why
    assert "needs 1 free GPU(s); 0 free" in why, why
    release.touch()

    done = fleet.wait_status(second, "succeeded", timeout=40)
    freed = datetime.fromisoformat(fleet.job(first_id)["finished_at"])
    claimed = datetime.fromisoformat(done["history"][0]["claimed_at"])
    started = datetime.fromisoformat(done["started_at"])
    gaps = ((claimed - freed).total_seconds(), (started - freed).total_seconds())
    assert max(gaps) < 1.0, (
        f"the queued GPU job was claimed {gaps[0]:.2f}s and started {gaps[1]:.2f}s after "
        "the GPU freed"
    )


def test_two_users_racing_for_one_worker_cannot_both_have_it(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_gpu_worker("gpu-small", [("NVIDIA GeForce RTX 3060", 12, 11)])
    long_job = ["--", sys.executable, "-c", "import time; time.sleep(60)"]
    argv = [sys.executable, "-m", "gpufleet", "submit", "--worker", "gpu-small", *long_job]
    racers = [
        subprocess.Popen(argv, env=fleet.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    try:
        said = [p.communicate(timeout=60) for p in racers]
    finally:
        for p in racers:
            p.kill()  # only one still running after a timeout
            p.wait(10)
    results = [
        (p.returncode, o.decode(), e.decode()) for p, (o, e) in zip(racers, said, strict=True)
    ]
    won = [r for r in results if r[0] == 0]
    lost = [r for r in results if r[0] != 0]
    assert len(won) == 1 and len(lost) == 1, results
    message = " ".join(lost[0][2].split())
    assert re.search(r"gpu-small is (reserved|busy)", message), message
    assert "--queue" in message, message
    jobs = json.loads(fleet.cli("jobs", "--json").stdout)
    assert [j["id"] for j in jobs] == [won[0][1].split()[-1]]

    # Eight SDK clients at the same instant, on a free worker: exactly one is accepted.
    fleet.cli("cancel", jobs[0]["id"])
    wait_for(lambda: "available" in fleet.cli("workers").stdout, 20, "gpu-small to be free again")
    spec = JobSpecModel(
        name="race",
        command=long_job[1:],
        requirements=RequirementsModel(worker="gpu-small"),
    )
    start = threading.Barrier(8)
    outcomes: list[str] = []

    def race() -> None:
        with fleet.client() as c:
            start.wait(10)
            try:
                outcomes.append(c.submit(spec).job.id)
            except Conflict as exc:
                outcomes.append("refused: " + exc.message)

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    accepted = [o for o in outcomes if not o.startswith("refused")]
    assert len(outcomes) == 8 and len(accepted) == 1, outcomes
    fleet.cli("cancel", accepted[0])  # the worker then stops at once, not after a drain
