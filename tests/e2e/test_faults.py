"""Faults a fleet meets: restarts, requeues onto the same worker, odd output, slow heartbeats."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil

from tests.e2e.conftest import Fleet, alive, free_port, wait_for


def test_cancel_then_requeue_onto_the_same_worker_kills_the_old_attempt(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    fleet.start_worker("w1", "--slots", "2")
    pids = tmp_path / "pids"
    job_id = fleet.cli("submit", "--shell", "--", f"echo $$ >> {pids}; sleep 300").stdout.split()[
        -1
    ]
    wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 1, 20, "attempt 1")
    fleet.cli("cancel", job_id)
    fleet.cli("requeue", job_id)
    wait_for(lambda: len(pids.read_text().split()) == 2, 20, "attempt 2 on the same worker")
    first, second = (int(p) for p in pids.read_text().split())
    wait_for(lambda: not alive(first), 10, "the cancelled attempt to die")
    assert alive(second)
    fleet.cli("cancel", job_id)
    wait_for(lambda: not alive(second), 10, "the second attempt to die")


def test_a_server_restart_within_the_lease_kills_no_job(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server("--port", str(free_port()), lease_timeout=20.0)
    fleet.start_worker("w1")
    started = tmp_path / "started"
    job_id = fleet.cli("submit", "--", "sh", "-c", f"touch {started}; sleep 6").stdout.split()[-1]
    wait_for(started.exists, 20, "the job to start")
    fleet.restart_server(down_for=0.5)  # heartbeats fail for a moment, not for a lease
    job = fleet.wait_status(job_id, "succeeded", "failed", timeout=40)
    assert (job["status"], job["attempt"]) == ("succeeded", 1)


def test_a_worker_cut_off_for_a_lease_stops_its_job_itself_and_it_runs_again(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Self-fencing: when no heartbeat is answered for a lease, the server will requeue
    the job, so the worker stops it, server or no server: two attempts never overlap."""
    lease = 3.0
    fleet.start_server("--port", str(free_port()), lease_timeout=lease)
    worker = fleet.start_worker("w1")
    pid = tmp_path / "attempt-1"
    script = f'if [ "$GPUFLEET_ATTEMPT" = 1 ]; then echo $$ > {pid}; exec sleep 300; fi'
    job_id = fleet.cli("submit", "--shell", "--", script).stdout.split()[-1]
    wait_for(lambda: pid.exists() and pid.read_text().strip(), 20, "attempt 1 to start")
    first = int(pid.read_text())
    assert fleet.server is not None
    stopping = time.monotonic()
    fleet.server.stop()
    gone = time.monotonic()
    wait_for(lambda: not alive(first), lease + 5, "the worker to stop attempt 1 itself")
    # SIGTERM goes a quarter lease before the lease ends, counted from the last heartbeat
    # answered: at most a heartbeat (0.5 s) before the server went.
    died = time.monotonic()
    assert died - stopping > lease * 3 / 4 - 0.5 - 0.25, died - stopping
    assert died - gone < lease + 1.0, died - gone
    assert "no heartbeat answered" in worker.text()
    fleet.restart_server()
    job = fleet.wait_status(job_id, "succeeded", "failed", timeout=40)
    assert (job["status"], job["attempt"]) == ("succeeded", 2)
    assert [a["outcome"] for a in job["history"]] == ["lost", "succeeded"]


def test_a_heartbeat_slower_than_the_lease_still_keeps_the_job(fleet: Fleet) -> None:
    fleet.start_server(lease_timeout=1.5)
    fleet.start_worker("w1", heartbeat=30)
    job_id = fleet.cli("submit", "--", "sleep", "4").stdout.split()[-1]
    job = fleet.wait_status(job_id, "succeeded", "failed", timeout=40)
    assert job["status"] == "succeeded" and job["attempts"] == 1


def test_postgresql_server_runs_a_job_whose_output_has_a_nul_byte(
    fleet: Fleet, pg_url: str
) -> None:
    fleet.start_server(db=pg_url)
    fleet.start_worker("w1")
    job_id = fleet.cli("submit", "--", "printf", "a\\0b\\n").stdout.split()[-1]
    job = fleet.wait_status(job_id, "succeeded", "failed", timeout=30)
    assert job["status"] == "succeeded"
    assert fleet.cli("logs", job_id).stdout == "a\ufffdb\n"


def _job_with_a_child(fleet: Fleet, tmp_path: Path) -> int:
    """Submit a shell that starts a long sleep and waits for it; the sleep's pid."""
    pidfile = tmp_path / "grandchild"
    script = f"sleep 300 & echo $! > {pidfile}; wait"
    fleet.cli("submit", "--shell", "--", script)
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 20, "the grandchild")
    return int(pidfile.read_text())


def _guard_of(worker_pid: int) -> psutil.Process:
    """The guard process a worker started (``python -I -S -c``)."""
    found = [
        p for p in psutil.Process(worker_pid).children() if p.cmdline()[1:4] == ["-I", "-S", "-c"]
    ]
    assert len(found) == 1, found
    return found[0]


def test_a_killed_workers_jobs_die_with_it_their_children_too(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server(lease_timeout=2.0)
    first = fleet.start_worker("w1")
    grandchild = _job_with_a_child(fleet, tmp_path)
    first.signal(signal.SIGKILL)
    first.popen.wait(10)
    wait_for(lambda: not alive(grandchild), 10, "the job's whole group to die with its worker")


def test_a_restarted_worker_kills_what_its_killed_predecessor_left(
    fleet: Fleet, tmp_path: Path
) -> None:
    """When the guard went too (a whole machine's processes killed), the next worker on
    the same work dir kills what the job left."""
    fleet.start_server(lease_timeout=2.0)
    first = fleet.start_worker("w1")
    grandchild = _job_with_a_child(fleet, tmp_path)
    guard = _guard_of(first.popen.pid)
    guard.kill()
    wait_for(lambda: not alive(guard.pid), 10, "the guard to die")  # a zombie till reaped
    first.signal(signal.SIGKILL)
    first.popen.wait(10)
    time.sleep(0.5)
    assert alive(grandchild), "with worker and guard killed at once, the job is orphaned"
    fleet.start_worker("w1")
    wait_for(lambda: not alive(grandchild), 10, "the restarted worker to kill the orphan")


def test_a_line_longer_than_the_server_takes_is_split_and_the_job_finishes(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    script = "print('x' * 1_500_000); print('done')"
    job_id = fleet.cli("submit", "--timeout", "60", "--", "python", "-c", script).stdout.split()[-1]
    job = fleet.wait_status(job_id, "succeeded", "failed", timeout=60)
    assert job["status"] == "succeeded"
    lines = fleet.cli("logs", job_id).stdout.splitlines()
    assert lines[-1] == "done"
    assert all(len(line) <= 1_000_000 for line in lines)
    assert "".join(lines[:-1]) == "x" * 1_500_000, "no output is lost"


def test_a_worker_killed_and_started_again_gets_its_dead_job_requeued_at_once(
    fleet: Fleet,
) -> None:
    """With a 20 s lease, the job of a worker SIGKILLed (its guard kills the job) goes
    back to the queue as the worker registers again under its name, not when the lease
    would have expired; the worker then runs it again (issue 31, item 5)."""
    fleet.start_server(lease_timeout=20.0)
    first = fleet.start_worker("w1")
    job_id = fleet.cli("submit", "--", "sleep", "600").stdout.split()[-1]
    fleet.wait_status(job_id, "running")
    first.signal(signal.SIGKILL)
    first.popen.wait(10)
    fleet.start_worker("w1")  # returns once it has registered
    back = time.monotonic()
    with fleet.client() as c:
        wait_for(lambda: c.job(job_id).attempt == 2, 10, "the job's second attempt")
    assert time.monotonic() - back < 2.0
    history = fleet.job(job_id)["history"]
    assert history[0]["outcome"] == "lost" and "started again" in history[0]["error"]
    fleet.cli("cancel", job_id)
