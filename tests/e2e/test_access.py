"""Tokens end to end: enrolling a machine with a worker token, revoking it mid-job, and
no secret in any log."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.e2e.conftest import Fleet

pytestmark = pytest.mark.e2e


def test_enroll_run_revoke_and_no_secret_in_any_log(fleet: Fleet) -> None:
    fleet.start_server()
    made = fleet.cli("tokens", "create", "--name", "box-1", "--role", "worker", "--pool", "gpu")
    token = made.stdout.strip()
    assert re.fullmatch(r"gf_[A-Za-z0-9_-]{43}", token), made.stdout
    # The enroll command names this server and pool, and keeps the token out of argv.
    assert f"gpufleet worker --server {fleet.url} --pool gpu --name box-1" in made.stderr
    assert "read -rs GPUFLEET_TOKEN" in made.stderr and token not in made.stderr

    worker = fleet.start_worker("box-1", env_extra={"GPUFLEET_TOKEN": token})
    assert "in pool gpu" in worker.text()  # the token's pool, with no --pool given
    long = ["--", sys.executable, "-c", "import time; time.sleep(600)"]
    job = fleet.cli("submit", "--pool", "gpu", *long).stdout.split()[-1]
    fleet.wait_status(job, "running")

    listed = json.loads(fleet.cli("tokens", "ls", "--json").stdout)
    box = next(t for t in listed if t["name"] == "box-1")
    assert box["pools"] == ["gpu"] and box["hint"] == token[:7] + "…"
    box_worker = json.loads(fleet.cli("workers", "--json").stdout)[0]["id"]
    fleet.cli("tokens", "revoke", box["id"])

    # The job is back in the queue at once, its attempt not counted; the worker stops it
    # and exits non-zero at its next call.
    back = fleet.job(job)
    assert back["status"] == "pending" and back["attempts"] == 0, back
    assert worker.popen.wait(30) == 1
    assert "refused this worker's token" in worker.text()
    assert not re.search(r"job .* (finished|succeeded)", worker.text())

    audit = fleet.cli("audit", "--since", "10m", "--json").stdout
    calls = [(a["method"], a["path"], a["status"]) for a in json.loads(audit)]
    assert ("DELETE", f"/v1/tokens/{box['id']}", 200) in calls
    events = [(a["event"], a["target"]) for a in json.loads(audit) if a["event"]]
    assert ("worker.offline", box_worker) in events, events

    fleet.stop_all()
    for log in fleet.root.glob("*.log"):
        text = log.read_text(errors="replace")
        assert token not in text and token[7:] not in text, log
