"""Preemption that keeps the work (issue 35), on real server and worker processes: the
server reads its sharing file (``--sharing``), a job of a high priority arriving when the
only GPU is busy starts within its minimum wait plus the victim's grace period plus 5 s,
the preempted training resumes from its checkpoint and ends with all its epochs, and a job
preempted once is protected from a second preemption for its protection time."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.e2e.conftest import Fleet, wait_for
from tests.e2e.test_checkpoints import epochs_by_attempt, events, last_state, submit_training

MIN_WAIT, GRACE, PROTECTION = 2.0, 5.0, 60.0
EPOCHS = 30  # of 0.4 s: it still trains for seconds after it resumes
SHARING = f"""
[preemption]
min_priority = 10
min_wait = "{MIN_WAIT:g}s"
protection = "{PROTECTION:g}s"
"""
GPU = [("NVIDIA GeForce RTX 4090", 24, 23)]


def _urgent(fleet: Fleet, name: str, seconds: float) -> str:
    argv = ["submit", "--gpus", "1", "--priority", "10", "--name", name, "--"]
    cmd = ["python", "-c", f"import time; time.sleep({seconds})"]
    return fleet.cli(*argv, *cmd).stdout.split()[-1]


def test_an_urgent_job_preempts_a_training_that_resumes_and_is_then_protected(
    fleet: Fleet, tmp_path: Path
) -> None:
    rules = tmp_path / "sharing.toml"
    rules.write_text(SHARING)
    fleet.start_server("--sharing", str(rules))
    fleet.start_gpu_worker("gpu-a", GPU)
    grace = ("--grace-period", f"{GRACE:g}", "--preemptible")
    low = submit_training(fleet, EPOCHS, 0.4, "--gpus", "1", *grace)
    with fleet.client() as c:
        wait_for(lambda: (c.job(low).progress or {}).get("epoch", 0) >= 2, 60, "epoch 2")
        asked = time.monotonic()
        urgent = _urgent(fleet, "urgent", 1.5)
        wait_for(lambda: c.job(urgent).status != "pending", 30, "the urgent job to start")
        waited = time.monotonic() - asked
        assert waited < MIN_WAIT + GRACE + 5, waited
        # The training went back to the queue: pending, not held, and counted as neither a
        # failure nor a loss; it resumes once the urgent job is done.
        first = fleet.wait_status(low, "pending", "claimed", "running", timeout=30)
        assert (first["attempts"], first["losses"]) == (0, 0), first
        assert first["history"][0]["cause"] == "preempted"
        fleet.wait_status(urgent, "succeeded", timeout=30)
        wait_for(lambda: c.job(low).attempt == 2 and c.job(low).status == "running", 30, "resume")
        # A second urgent job waits past its minimum wait: the training is protected.
        second = _urgent(fleet, "urgent-2", 0.5)
        time.sleep(MIN_WAIT + 2)
        assert c.job(second).status == "pending", "no second preemption within the protection"
        done = fleet.wait_status(low, "succeeded", "failed", timeout=60)
        fleet.wait_status(second, "succeeded", timeout=30)
        log = events(c, low)
        state = last_state(c, low, tmp_path / "state.json")
        audit = [a for a in c.audit(limit=10_000) if a.event == "job.preempted"]
    assert done["status"] == "succeeded", done
    assert [h["cause"] for h in done["history"]] == ["preempted", None]
    assert done["history"][1]["restored"]["snapshot"] > 0, "it resumed from its checkpoint"
    by_attempt = epochs_by_attempt(log)
    assert by_attempt[2][0] > 1, by_attempt
    trained = [e for e, _ in state["trained"]]
    assert trained == list(range(1, EPOCHS + 1)), "all its epochs, once each"
    preempting = [r for r in log if r["type"] == "state" and r.get("event") == "preempting"]
    assert len(preempting) == 1 and f"preempted by job {urgent}" in preempting[0]["why"]
    assert [a.target for a in audit] == [low]
    shown = fleet.cli("show", low).stdout
    assert f"preempted by job {urgent} (urgent;" in shown and "priority 10" in shown
    assert f"preempted job {low} (train;" in fleet.cli("show", urgent).stdout
    detail = json.loads(fleet.cli("show", urgent, "--json").stdout)
    assert [v["job_id"] for v in detail["preemption"]["preempted"]] == [low]
