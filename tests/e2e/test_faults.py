"""Faults a fleet meets: restarts, requeues onto the same worker, odd output, slow heartbeats."""

from __future__ import annotations

import signal
import time
from pathlib import Path

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


def test_a_server_down_longer_than_the_lease_kills_no_healthy_job(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server("--port", str(free_port()), lease_timeout=2.0)
    fleet.start_worker("w1")
    started = tmp_path / "started"
    job_id = fleet.cli("submit", "--", "sh", "-c", f"touch {started}; sleep 6").stdout.split()[-1]
    wait_for(started.exists, 20, "the job to start")
    fleet.restart_server(down_for=3.0)  # longer than the lease: no heartbeat gets through
    job = fleet.wait_status(job_id, "succeeded", "failed", timeout=40)
    assert job["status"] == "succeeded" and job["attempts"] == 1


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


def test_a_restarted_worker_kills_what_its_killed_predecessor_left(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server(lease_timeout=2.0)
    first = fleet.start_worker("w1")
    pidfile = tmp_path / "grandchild"
    script = f"sleep 300 & echo $! > {pidfile}; wait"
    fleet.cli("submit", "--shell", "--", script)
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 20, "the grandchild")
    grandchild = int(pidfile.read_text())
    first.signal(signal.SIGKILL)
    first.popen.wait(10)
    time.sleep(0.5)
    assert alive(grandchild), "the shell dies with its worker; its child is orphaned"
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
