"""The workstation's owner comes first (issue 35, item 4), on real server and worker
processes: the GPUs are the fake NVML's (tests/fake_nvml), whose process list the test
changes while the worker runs; the foreign process is a real one the test starts; idleness
is read from input devices whose times the test sets, as a worker reads /dev/input."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Fleet, wait_for
from tests.e2e.test_checkpoints import epochs_by_attempt, events, submit_training

pytestmark = pytest.mark.e2e

RTX = [("NVIDIA GeForce RTX 4090", 24, 23)]
HEARTBEAT = 0.5


@pytest.fixture
def visitor() -> Iterator[subprocess.Popen[bytes]]:
    """The owner's own program (a real process gpufleet did not start)."""
    proc = subprocess.Popen(["sleep", "120"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def owner_worker(fleet: Fleet, name: str, policy: str, **kw: Any) -> tuple[Path, Path]:
    """A GPU worker under the owner policy ``policy``: its policy file and the file of
    the fake driver's processes (empty: nothing else on its GPU)."""
    path, processes = fleet.root / f"{name}.owner.toml", fleet.root / f"{name}.nvml.json"
    path.write_text(policy)
    processes.write_text("{}")
    env = {"FAKE_NVML_PROCESSES": str(processes)}
    fleet.start_gpu_worker(name, RTX, "--owner-policy", str(path), env_extra=env, **kw)
    return path, processes


def owner_of(fleet: Fleet, name: str) -> dict[str, Any]:
    """The worker's owner state, as `gpufleet workers --json` shows it."""
    rows = json.loads(fleet.cli("workers", "--json").stdout)
    (row,) = [w for w in rows if w["name"] == name]
    return dict(row["owner"] or {})


def stays_pending(fleet: Fleet, job_id: str, seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert fleet.job(job_id)["status"] == "pending"
        time.sleep(0.25)


def test_a_foreign_process_takes_its_gpu_out_within_a_heartbeat(
    fleet: Fleet, visitor: subprocess.Popen[bytes]
) -> None:
    fleet.start_server()
    _, processes = owner_worker(fleet, "desk", "delay = 1\n")
    processes.write_text(json.dumps({"0": [[visitor.pid, 3174]]}))
    appeared = time.monotonic()
    wait_for(lambda: owner_of(fleet, "desk").get("owned") == [0], 10, "the owner's GPU")
    assert time.monotonic() - appeared < HEARTBEAT + 1.5, "within one heartbeat (and a poll)"
    job_id = fleet.cli("submit", "--gpus", "1", "--", "python", "-c", "print(1)").stdout.split()[-1]
    stays_pending(fleet, job_id)
    said = f"GPU 0: owner's process {visitor.pid} (sleep) uses 3.1 GiB; not taking jobs"
    assert said in " ".join(fleet.cli("why", job_id).stdout.split())
    assert said in fleet.cli("workers").stdout
    processes.write_text("{}")  # the owner closed it
    assert fleet.wait_status(job_id, "succeeded", "failed", timeout=30)["status"] == "succeeded"


def test_a_foreign_process_vacates_the_job_which_resumes_elsewhere_from_its_checkpoint(
    fleet: Fleet, visitor: subprocess.Popen[bytes]
) -> None:
    delay, grace = 2.0, 5.0
    fleet.start_server()
    desk = owner_worker(fleet, "desk", f"delay = {delay}\n")[1]
    job_id = submit_training(fleet, 30, 0.35, "--gpus", "1", "--grace-period", str(grace))
    with fleet.client() as c:
        wait_for(lambda: (c.job(job_id).progress or {}).get("epoch", 0) >= 2, 60, "epoch 2")
        desk.write_text(json.dumps({"0": [[visitor.pid, 8000]]}))
        appeared = time.monotonic()
        wait_for(lambda: c.job(job_id).status == "pending", delay + grace + 5, "the vacate")
        assert time.monotonic() - appeared < delay + grace + 2 * HEARTBEAT + 1
        vacated = c.job(job_id)
        assert vacated.attempts == 0 and vacated.losses == 0, "neither a failure nor a loss"
        stays_pending(fleet, job_id, 1.0)  # not back on the owner's GPU
        fleet.start_gpu_worker("spare", RTX)
        done = fleet.wait_status(job_id, "succeeded", "failed", timeout=60)
        log = events(c, job_id)
    assert done["status"] == "succeeded", done
    first, second = done["history"]
    assert (first["worker"], first["outcome"], first["cause"]) == ("desk", "released", "owner")
    assert second["worker"] == "spare" and second["restored"]["files"] >= 1
    resumed_at = epochs_by_attempt(log)[2][0]
    assert resumed_at >= 2 and epochs_by_attempt(log)[2] == list(range(resumed_at, 31))
    worker_log = (fleet.root / "worker-desk.log").read_text()
    assert "vacated for the workstation's owner" in worker_log


def _touch(path: Path, seconds_ago: float) -> None:
    when = time.time() - seconds_ago
    os.utime(path, (when, when))


def test_an_active_user_stops_new_claims_and_an_idle_one_lets_them_start(fleet: Fleet) -> None:
    inputs = fleet.root / "inputs"
    inputs.mkdir()
    (inputs / "event0").touch()
    _touch(inputs / "event0", 300)  # idle for 5 minutes
    fleet.start_server()
    owner_worker(fleet, "desk", f'idle_minutes = 1\ninput_dir = "{inputs}"\n')
    quick = ["submit", "--", "python", "-c", "print(1)"]
    first = fleet.cli(*quick).stdout.split()[-1]
    assert fleet.wait_status(first, "succeeded", "failed", timeout=30)["status"] == "succeeded"
    _touch(inputs / "event0", 0)  # the owner is back at the keyboard
    said = "owner away rule: user active now (idle after 1 min)"
    wait_for(lambda: said in owner_of(fleet, "desk").get("reasons", []), 10, "the idle rule")
    waiting = fleet.cli(*quick).stdout.split()[-1]
    stays_pending(fleet, waiting)
    assert said in " ".join(fleet.cli("why", waiting).stdout.split())
    assert said in fleet.cli("workers").stdout
    _touch(inputs / "event0", 120)  # away again, for two minutes now
    assert fleet.wait_status(waiting, "succeeded", "failed", timeout=30)["status"] == "succeeded"


def test_a_time_window_that_closes_stops_new_claims(fleet: Fleet) -> None:
    fleet.start_server()
    policy = owner_worker(fleet, "desk", 'hours = ["00:00-24:00"]\n')[0]
    quick = ["submit", "--", "python", "-c", "print(1)"]
    first = fleet.cli(*quick).stdout.split()[-1]
    assert fleet.wait_status(first, "succeeded", "failed", timeout=30)["status"] == "succeeded"
    later = datetime.now() + timedelta(hours=2)
    window = f"{later:%H:%M}-{later + timedelta(hours=1):%H:%M}"  # not now, every day
    policy.write_text(f'hours = ["{window}"]\n')  # read again: the window has closed
    wait_for(
        lambda: f"outside hours {window}" in owner_of(fleet, "desk").get("reasons", []),
        10,
        "the hours rule",
    )
    waiting = fleet.cli(*quick).stdout.split()[-1]
    stays_pending(fleet, waiting)
    assert f"outside hours {window}" in fleet.cli("why", waiting).stdout


def test_yield_vacates_at_once_and_unyield_takes_jobs_again(fleet: Fleet) -> None:
    fleet.start_server()
    owner_worker(fleet, "desk", "")
    work_dir = str(fleet.root / "work" / "desk")
    job_id = submit_training(fleet, 20, 0.35, "--gpus", "1", "--grace-period", "5")
    with fleet.client() as c:
        wait_for(lambda: (c.job(job_id).progress or {}).get("epoch", 0) >= 1, 60, "epoch 1")
        asked = time.monotonic()
        said = fleet.cli("worker", "--yield", "--work-dir", work_dir, env={"GPUFLEET_TOKEN": ""})
        assert said.stdout.startswith("vacated 1 job;"), said.stdout
        wait_for(lambda: c.job(job_id).status == "pending", 10, "the job back in the queue")
        assert time.monotonic() - asked < 5, "at once (well inside its grace period)"
        # the server learns the worker's reason at its next heartbeat, which may come
        # after the job is back in the queue: asked for a few times, not once
        wait_for(
            lambda: any(r.startswith("yielded") for r in owner_of(fleet, "desk")["reasons"]),
            10,
            "the worker to say it is yielded",
        )
        stays_pending(fleet, job_id, 1.5)
        fleet.cli("worker", "--unyield", "--work-dir", work_dir)
        done = fleet.wait_status(job_id, "succeeded", "failed", timeout=60)
    assert done["status"] == "succeeded", done
    first, second = done["history"]
    assert (first["cause"], second["worker"]) == ("owner", "desk")
    assert second["restored"] is not None


def test_a_bad_policy_file_stops_the_worker_naming_file_and_key(fleet: Fleet) -> None:
    fleet.start_server()
    bad = fleet.root / "owner.toml"
    bad.write_text('on_return = "kill"\n')
    res = fleet.cli("worker", "--name", "x", "--owner-policy", str(bad), check=False)
    assert res.returncode != 0
    assert str(bad) in res.stderr and "on_return" in res.stderr


# A program that names itself (its /proc comm) with markup and a terminal escape.
ODD_NAME = (
    "import ctypes, time\n"
    "ctypes.CDLL(None).prctl(15, b'[b]x[/b]\\x1b[2J', 0, 0, 0)\n"  # PR_SET_NAME
    "time.sleep(120)\n"
)


def test_a_foreign_process_name_is_shown_as_text(fleet: Fleet) -> None:
    fleet.start_server()
    _, processes = owner_worker(fleet, "desk", "")
    odd = subprocess.Popen(["python3", "-c", ODD_NAME])
    try:
        wait_for(lambda: "[b]" in Path(f"/proc/{odd.pid}/comm").read_text(), 10, "its name")
        processes.write_text(json.dumps({"0": [[odd.pid, 2048]]}))
        wait_for(lambda: owner_of(fleet, "desk").get("owned") == [0], 10, "the owner's GPU")
        shown = fleet.cli("workers").stdout
    finally:
        odd.kill()
        odd.wait(10)
    assert f"owner's process {odd.pid} ([b]x[/b]\\x1b[2J) uses 2.0 GiB" in shown
    assert "\x1b" not in shown
