"""Operating a fleet: timeouts, drains, an ephemeral worker, a server restart, bad input."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from tests.e2e.conftest import Fleet, free_port, wait_for


def test_job_timeout_kills_it_and_records_why(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    res = fleet.cli("submit", "--timeout", "1", "--max-attempts", "1", "--", "sleep", "30")
    job = fleet.wait_status(res.stdout.split()[-1], "failed", timeout=30)
    assert job["error"] == "timed out after 1s"


def test_sigterm_drain_hands_running_job_back_without_counting_an_attempt(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    w = fleet.start_worker("w1", "--drain-grace", "1")
    started = tmp_path / "started"
    job_id = fleet.cli("submit", "--", "sh", "-c", f"touch {started}; sleep 60").stdout.split()[-1]
    wait_for(started.exists, 20, "the job to start")
    w.signal(signal.SIGTERM)
    assert w.popen.wait(30) == 0
    job = fleet.job(job_id)
    assert job["status"] == "pending" and job["attempts"] == 0
    assert job["history"][0]["outcome"] == "released"
    assert "drained" in w.text()


def test_operator_drain_lets_the_job_finish_then_the_worker_exits(fleet: Fleet) -> None:
    fleet.start_server()
    w = fleet.start_worker("w1")
    job_id = fleet.cli("submit", "--", "sh", "-c", "sleep 2; echo finished").stdout.split()[-1]
    fleet.wait_status(job_id, "running")
    fleet.cli("drain", "w1")
    assert w.popen.wait(30) == 0
    job = fleet.job(job_id)
    assert job["status"] == "succeeded"
    workers = json.loads(fleet.cli("workers", "--json").stdout)
    assert workers[0]["status"] == "offline"  # it left: not draining any more


def test_ephemeral_worker_runs_one_job_and_exits(fleet: Fleet) -> None:
    fleet.start_server()
    first = fleet.cli("submit", "--", "true").stdout.split()[-1]
    second = fleet.cli("submit", "--", "true").stdout.split()[-1]
    w = fleet.start_worker("once", "--ephemeral")
    assert w.popen.wait(30) == 0
    statuses = {fleet.job(first)["status"], fleet.job(second)["status"]}
    assert statuses == {"succeeded", "pending"}


def test_worker_survives_a_server_restart_and_reports_its_running_job(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server("--port", str(free_port()), lease_timeout=30)
    fleet.start_worker("w1")
    started = tmp_path / "started"
    script = f"touch {started}; sleep 4; echo survived"
    job_id = fleet.cli("submit", "--", "sh", "-c", script).stdout.split()[-1]
    wait_for(started.exists, 20, "the job to start")
    fleet.restart_server()
    job = fleet.wait_status(job_id, "succeeded", timeout=40)
    assert job["attempts"] == 1
    assert "survived" in fleet.cli("logs", job_id).stdout


def test_why_names_the_constraint_for_every_worker(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("cpu-box")
    fleet.start_worker("small-gpu", "--simulate-gpus", "T4:16")
    res = fleet.cli("submit", "--require-cuda", "--min-vram-gib", "40", "--", "true")
    assert "no registered worker could ever run this job" in res.stderr
    job_id = res.stdout.split()[-1]
    why = json.loads(fleet.cli("why", job_id, "--json").stdout)
    reasons = {w["name"]: w["reason"] for w in why["workers"]}
    assert "needs a GPU" in reasons["cpu-box"]
    assert "40 GiB VRAM" in reasons["small-gpu"] and "16.0 GiB" in reasons["small-gpu"]
    assert why["summary"] == "no registered worker could ever run this job"
    text = fleet.cli("why", job_id).stdout
    assert "cpu-box" in text and "small-gpu" in text


BAD_MANIFEST = """
schema_version = 1
name = "bad"
[defaults]
command = "python train.py"
[[jobs]]
name = "gru"
require_cude = true
"""


def test_bad_input_gives_a_clear_error_and_writes_nothing(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    plan = tmp_path / "bad.toml"
    plan.write_text(BAD_MANIFEST)
    res = fleet.cli("apply", str(plan), check=False)
    assert res.returncode != 0
    assert str(plan) in res.stderr and '"gru"' in res.stderr and "require_cuda" in res.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("schema_version = 1\nname = [")
    res = fleet.cli("apply", str(broken), check=False)
    assert res.returncode != 0 and "invalid TOML" in res.stderr
    res = fleet.cli("submit", "--min-vram-gib", "-1", "--", "true", check=False)
    assert res.returncode != 0 and "min-vram-gib" in res.stderr
    res = fleet.cli("show", "j-nope", check=False)
    assert res.returncode == 1 and "no job 'j-nope'" in res.stderr
    fleet.env["GPUFLEET_TOKEN"] = "gf_wrong"
    res = fleet.cli("jobs", check=False)
    assert res.returncode == 1 and "invalid or revoked token" in res.stderr
    del fleet.env["GPUFLEET_TOKEN"]
    saved_config = fleet.env["GPUFLEET_CONFIG_DIR"]
    fleet.env["GPUFLEET_CONFIG_DIR"] = str(tmp_path / "no-token-here")
    res = fleet.cli("submit", "--", "true", check=False)
    assert res.returncode == 1 and "missing token" in res.stderr
    fleet.env["GPUFLEET_CONFIG_DIR"] = saved_config
    assert json.loads(fleet.cli("jobs", "--json").stdout) == []


def test_logs_follow_prints_lines_as_they_come_until_the_job_ends(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    script = "for i in 1 2 3; do echo line-$i; sleep 0.7; done; echo oops >&2"
    job_id = fleet.cli("submit", "--shell", "--", script).stdout.split()[-1]
    res = fleet.cli("logs", "-f", job_id, timeout=60)
    assert res.stdout.split() == ["line-1", "line-2", "line-3"]
    assert res.stderr.strip().splitlines() == ["oops", f"job {job_id} succeeded"]
    assert fleet.job(job_id)["status"] == "succeeded"
