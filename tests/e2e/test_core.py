"""The core promises, with real server and worker processes on loopback."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

from gpufleet.wire import (
    CapabilityModel,
    ClaimRequest,
    WorkerRegister,
)
from tests.e2e.conftest import Fleet, alive, wait_for


def test_job_runs_succeeds_and_its_output_is_kept(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1", "--simulate-gpus", "RTX 4090:24,T4:16")
    script = (
        "import os, sys; print('gpus=' + os.environ['CUDA_VISIBLE_DEVICES']); print(sys.argv[1:])"
    )
    res = fleet.cli(
        "submit",
        "--name",
        "hello",
        "--require-cuda",
        "--min-vram-gib",
        "20",
        "--",
        "python",
        "-c",
        script,
    )
    job_id = res.stdout.strip().splitlines()[-1]
    job = fleet.wait_status(job_id, "succeeded")
    assert job["exit_code"] == 0 and job["attempts"] == 1 and job["worker"] == "w1"
    assert job["gpus"] == [0], "best fit: the 24 GiB GPU is the only one with 20 GiB"
    out = fleet.cli("logs", job_id).stdout
    assert "gpus=0" in out
    listed = json.loads(fleet.cli("jobs", "--json").stdout)
    assert [j["id"] for j in listed] == [job_id]
    for key in (
        "id",
        "name",
        "status",
        "attempts",
        "worker",
        "created_at",
        "started_at",
        "finished_at",
        "exit_code",
        "error",
    ):
        assert key in listed[0]
    assert listed[0]["finished_at"].endswith("Z")


def test_failing_job_is_retried_then_failed_with_each_error_kept(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    res = fleet.cli(
        "submit",
        "--max-attempts",
        "2",
        "--",
        "python",
        "-c",
        "import sys; print('boom', file=sys.stderr); sys.exit(3)",
    )
    job_id = res.stdout.strip().splitlines()[-1]
    job = fleet.wait_status(job_id, "failed")
    assert job["attempts"] == 2 and job["exit_code"] == 3
    assert [a["error"] for a in job["history"]] == ["exit code 3", "exit code 3"]
    logs = fleet.cli("logs", job_id)
    assert "boom" in logs.stderr


def test_sigkilled_worker_job_is_finished_elsewhere_exactly_once(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server(lease_timeout=2.0)
    first = fleet.start_worker("first")
    marker = tmp_path / "runs"
    script = (
        f"import time; open({str(marker)!r}, 'a').write('run\\n'); time.sleep(4); print('done')"
    )
    job_id = fleet.cli("submit", "--name", "victim", "--", "python", "-c", script).stdout.split()[
        -1
    ]
    wait_for(lambda: marker.exists(), 20, "the job to start on the first worker")
    first.signal(signal.SIGKILL)
    first.popen.wait(10)
    fleet.start_worker("second")
    job = fleet.wait_status(job_id, "succeeded", timeout=40)
    assert (job["attempts"], job["losses"]) == (1, 1), "the lost attempt was its machine's"
    assert job["worker"] == "second"
    outcomes = [(a["worker"], a["outcome"]) for a in job["history"]]
    assert outcomes == [("first", "lost"), ("second", "succeeded")]
    assert "lease lost" in job["history"][0]["error"]
    # The orphan of the dead worker was killed with it, so it never finished a second run.
    assert marker.read_text().count("run") == 2


def test_cancel_kills_the_whole_process_group(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    pids = tmp_path / "pids"
    script = f"sleep 300 & echo $! >> {pids}; echo $$ >> {pids}; wait"
    job_id = fleet.cli("submit", "--shell", "--", script).stdout.split()[-1]
    wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 2, 20, "both processes")
    procs = [int(p) for p in pids.read_text().split()]
    assert all(alive(p) for p in procs)
    fleet.cli("cancel", job_id)
    wait_for(lambda: not any(alive(p) for p in procs), 10, "the process group to die")
    job = fleet.job(job_id)
    assert job["status"] == "cancelled"
    assert job["history"][0]["outcome"] == "cancelled"


def test_32_concurrent_claimers_one_job_exactly_one_wins(fleet: Fleet) -> None:
    # a lease longer than the claimers wait: the winner's lease must not expire (no
    # heartbeats here) and hand the job, as attempt 2, to a claimer still waiting
    fleet.start_server(lease_timeout=30)
    cap = CapabilityModel(hostname="h", cores=2, ram_mib=4096)
    with fleet.client() as c:
        ids = [c.register(WorkerRegister(name=f"c{i}", capability=cap)).id for i in range(32)]
    results: list[object] = []
    lock = threading.Lock()
    barrier = threading.Barrier(33, timeout=30)

    def claimer(worker_id: str) -> None:
        with fleet.client() as c:
            barrier.wait()
            lease = c.claim(worker_id, ClaimRequest(cpu_slots=1, wait=4))
        with lock:
            results.append(lease)

    threads = [threading.Thread(target=claimer, args=(w,)) for w in ids]
    for t in threads:
        t.start()
    barrier.wait()
    fleet.cli("submit", "--", "true")
    for t in threads:
        t.join(30)
    assert len(results) == 32
    winners = [r for r in results if r is not None]
    assert len(winners) == 1


MANIFEST = """
schema_version = 1
name = "e2e-plan"
[defaults]
command = "python -c 'import sys; print(sys.argv[1:])' --model {model}"
seed = 7
[hosts.alpha]
priority = 1
allow_jobs = ["gbt"]
[hosts.beta]
deny_jobs = ["gbt"]
[[jobs]]
name = "gbt-a"
model = "gbt"
hyper.depth = 3
[[jobs]]
name = "gbt-b"
model = "gbt"
hyper.depth = 5
[[jobs]]
name = "mlp-a"
model = "mlp"
[[jobs]]
name = "rf-a"
model = "rf"
"""


def test_manifest_host_allow_deny_and_idempotent_reapply(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    plan = tmp_path / "plan.toml"
    plan.write_text(MANIFEST)
    first = json.loads(fleet.cli("apply", str(plan), "--json").stdout)
    assert len(first["created"]) == 4 and first["unchanged"] == []
    fleet.start_worker("alpha")
    fleet.start_worker("beta")
    with fleet.client() as c:
        wait_for(lambda: all(j.status == "succeeded" for j in c.jobs()), 60, "all jobs to succeed")
        ran_on = {j.name: j.worker for j in c.jobs()}
        before = [(j.id, j.status, j.attempts, j.finished_at) for j in c.jobs()]
    assert ran_on == {"gbt-a": "alpha", "gbt-b": "alpha", "mlp-a": "beta", "rf-a": "beta"}
    logs = fleet.cli("logs", "gbt-b").stdout
    assert "'--model', 'gbt', '--depth', '5'" in logs
    second = json.loads(fleet.cli("apply", str(plan), "--json").stdout)
    assert second["created"] == [] and sorted(second["unchanged"]) == sorted(first["created"])
    with fleet.client() as c:
        after = [(j.id, j.status, j.attempts, j.finished_at) for j in c.jobs()]
    assert after == before
