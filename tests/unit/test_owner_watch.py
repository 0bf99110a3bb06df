"""A worker under an owner policy (gpufleet.worker.owner): suspend (a real SIGSTOP to a
real process group) then SIGCONT, vacate after the delay, a yield, and where idleness and
foreign processes are read from. The clock is the test's: ``apply`` takes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gpufleet.domain.models import GpuInfo
from gpufleet.domain.owner import ForeignProcess
from gpufleet.worker.jobs import JobRunner
from gpufleet.worker.nvml import GpuReading
from gpufleet.worker.owner import OwnerWatch, foreign_processes
from gpufleet.worker.owner_sources import input_idle, is_ours, logind_idle
from gpufleet.worker.owner_yield import ACK_FILE, YIELD_FILE, read_yield
from gpufleet.worker.running import StopReason
from gpufleet.worker.slots import Slots


class Proc:
    """A real child process in its own process group, as a job's."""

    def __init__(self) -> None:
        code = "import time\nfor _ in range(600): time.sleep(0.1)"
        self.popen = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        self.pid = self.popen.pid

    def signal_group(self, sig: int) -> None:
        os.killpg(self.pid, sig)

    def stopped(self, expected: bool) -> bool:
        """Whether it is stopped (state T in /proc), waiting up to 2 s for ``expected``:
        the kernel acts on a signal a moment after it is sent."""
        for _ in range(100):
            stat = Path(f"/proc/{self.pid}/stat").read_text()
            if (stat.rpartition(")")[2].split()[0] == "T") == expected:
                break
            time.sleep(0.02)
        return stat.rpartition(")")[2].split()[0] == "T"


class Jobs:
    """What the watch uses of a JobRunner: its running jobs, and its stopper."""

    def __init__(self) -> None:
        self.running: dict[tuple[str, int], Any] = {}
        self.vacated: list[tuple[str, StopReason]] = []
        self.stopper = SimpleNamespace(vacate=self._vacate)

    def _vacate(self, run: Any, reason: StopReason) -> None:
        self.vacated.append((run.lease.job_id, reason))
        run.killing = True


@pytest.fixture
def job() -> Iterator[Any]:
    proc = Proc()
    run = SimpleNamespace(lease=SimpleNamespace(job_id="j1", gpus=[0]), proc=proc, killing=False)
    try:
        yield run
    finally:
        proc.popen.kill()
        proc.popen.wait(10)


def watch(tmp_path: Path, policy: str, jobs: Jobs) -> tuple[OwnerWatch, Slots]:
    path = tmp_path / "owner.toml"
    path.write_text(policy)
    gpus = (GpuInfo(0, "GPU", 1024, 1024), GpuInfo(1, "GPU", 1024, 1024))
    slots = Slots(0, gpus)
    return OwnerWatch(path, tmp_path, cast(JobRunner, jobs), slots), slots


BLENDER = (ForeignProcess(0, 4242, "blender", 3000),)


def test_a_job_is_suspended_after_the_delay_and_continued_when_the_gpu_is_free(
    tmp_path: Path, job: Any
) -> None:
    jobs = Jobs()
    jobs.running[("j1", 1)] = job
    w, slots = watch(tmp_path, 'on_return = "suspend"\ndelay = 5\nsuspend_limit = 100', jobs)
    w.apply(BLENDER, [], now=0.0)
    assert slots.owned == {0} and slots.changed.is_set(), "GPU 0 is not offered any more"
    assert not job.proc.stopped(False), "not before the delay"
    w.apply(BLENDER, [], now=5.0)
    assert job.proc.stopped(True)
    w.apply((), [], now=6.0)
    assert not job.proc.stopped(False) and slots.owned == set()
    assert jobs.vacated == []


def test_a_job_suspended_past_the_limit_is_continued_and_vacated(tmp_path: Path, job: Any) -> None:
    jobs = Jobs()
    jobs.running[("j1", 1)] = job
    w, _ = watch(tmp_path, 'on_return = "suspend"\ndelay = 0\nsuspend_limit = 60', jobs)
    w.apply(BLENDER, [], now=0.0)
    assert job.proc.stopped(True)
    w.apply(BLENDER, [], now=59.0)
    assert job.proc.stopped(True)
    w.apply(BLENDER, [], now=60.0)
    assert not job.proc.stopped(False), "it runs, to take its grace signal"
    assert jobs.vacated == [("j1", StopReason.OWNER)]


def test_a_job_is_vacated_after_the_delay_and_one_on_another_gpu_is_left(
    tmp_path: Path, job: Any
) -> None:
    jobs = Jobs()
    jobs.running[("j1", 1)] = job
    other = SimpleNamespace(lease=SimpleNamespace(job_id="j2", gpus=[1]), proc=None, killing=False)
    jobs.running[("j2", 1)] = other
    w, _ = watch(tmp_path, "delay = 30", jobs)
    w.apply(BLENDER, [], now=100.0)
    w.apply(BLENDER, [], now=129.0)
    assert jobs.vacated == []
    w.apply(BLENDER, [], now=130.0)
    assert jobs.vacated == [("j1", StopReason.OWNER)]
    assert not job.proc.stopped(False)


def test_a_process_under_the_amount_leaves_the_gpu_to_jobs(tmp_path: Path) -> None:
    w, slots = watch(tmp_path, "foreign_gpu_mib = 500", Jobs())
    w.apply((ForeignProcess(0, 1, "Xorg", 300),), [], now=0.0)
    assert slots.owned == set() and w.state.owned == ()
    w.apply((ForeignProcess(0, 1, "Xorg", 300), ForeignProcess(0, 2, "game", 300)), [], 1.0)
    assert slots.owned == {0}


def test_the_rules_close_claims_and_open_them_again(tmp_path: Path) -> None:
    w, slots = watch(tmp_path, "", Jobs())
    slots.cpu_free = 1
    w.apply((), ["on battery"], now=0.0)
    assert slots.closed and not slots.any_free() and slots.owners([])
    w.apply((), [], now=1.0)
    assert not slots.closed and slots.any_free()


def test_a_yield_vacates_every_job_and_answers_how_many(tmp_path: Path, job: Any) -> None:
    jobs = Jobs()
    jobs.running[("j1", 1)] = job
    w, slots = watch(tmp_path, "", jobs)
    (tmp_path / YIELD_FILE).write_text(json.dumps({"nonce": "n1", "until": None}))
    w.on_signal()
    assert jobs.vacated == [("j1", StopReason.OWNER)] and slots.closed
    assert json.loads((tmp_path / ACK_FILE).read_text()) == {"nonce": "n1", "vacated": 1}
    assert "until --unyield" in w.state.reasons[0]
    (tmp_path / YIELD_FILE).unlink()
    w.on_signal()
    assert not slots.closed


def test_a_yield_for_a_time_ends_by_itself(tmp_path: Path) -> None:
    (tmp_path / YIELD_FILE).write_text(json.dumps({"nonce": "n", "until": 1000.0}))
    assert read_yield(tmp_path, 999.0) is not None
    assert read_yield(tmp_path, 1000.0) is None
    (tmp_path / YIELD_FILE).write_text("not json")
    assert read_yield(tmp_path, 0.0) is None


def test_idle_time_from_input_devices(tmp_path: Path) -> None:
    assert input_idle(tmp_path, 1000.0) is None, "no device: it cannot tell"
    for name, touched in (("event0", 400.0), ("event1", 700.0), ("mouse0", 990.0)):
        (tmp_path / name).touch()
        os.utime(tmp_path / name, (touched, touched))
    assert input_idle(tmp_path, 1000.0) == 300.0  # event1; mouse0 is not an event device


def test_idle_time_from_logind() -> None:
    sessions = {
        "2": "Type=x11\nRemote=no\nIdleHint=yes\nIdleSinceHint=900000000\n",
        "5": "Type=unspecified\nRemote=no\nIdleHint=no\n",  # a cron or ssh-less session
        "7": "Type=tty\nRemote=yes\nIdleHint=no\n",  # remote: not the machine's user
    }

    def run(args: list[str]) -> str:
        if args[0] == "list-sessions":
            return "".join(f"{s} 1000 alice seat0\n" for s in sessions)
        return sessions[args[1]]

    assert logind_idle(1000.0, run) == 100.0
    sessions["2"] = "Type=wayland\nRemote=no\nIdleHint=no\nIdleSinceHint=0\n"
    assert logind_idle(1000.0, run) == 0.0

    def missing(args: list[str]) -> str:
        raise FileNotFoundError("loginctl")

    assert logind_idle(1000.0, missing) is None


def test_a_process_of_a_job_is_ours_and_another_is_foreign(job: Any) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert is_ours(job.proc.pid, [job.proc.pid])
        assert not is_ours(child.pid, [job.proc.pid])
        readings = {0: GpuReading(100, None, ((job.proc.pid, 500), (child.pid, 700)))}
        (found,) = foreign_processes(readings, [job.proc.pid])
        assert (found.gpu, found.pid, found.mib) == (0, child.pid, 700)
        assert found.name and found.name.startswith("python")
    finally:
        child.kill()
        child.wait(10)
