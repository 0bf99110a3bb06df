"""Checkpoints kept by the fleet, on real server and worker processes (issue 34): a
training job whose worker is SIGKILLed resumes on another worker from its last snapshot,
and ends with every epoch trained once in the attempt that finished it."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from gpufleet.client import Client
from tests.e2e.conftest import Fleet, wait_for

TRAIN = Path(__file__).parents[2] / "examples" / "checkpoints" / "train.py"


def submit_training(fleet: Fleet, epochs: int = 10, seconds: float = 0.5, *more: str) -> str:
    """The example training job (examples/checkpoints/train.py) with a checkpoint folder."""
    argv = ["submit", "--checkpoint-dir", "checkpoints", "--name", "train", *more, "--"]
    argv += ["python", str(TRAIN), "--epochs", str(epochs), "--epoch-seconds", str(seconds)]
    return fleet.cli(*argv).stdout.split()[-1]


def events(c: Client, job_id: str) -> list[dict[str, Any]]:
    """Every record of the job's event log, as dicts."""
    out, after = [], 0
    for _ in range(100):
        page = c.events(job_id, after=after, limit=10_000)
        out += [{"type": e.type, **e.data} for e in page.events]
        after = page.next
        if not page.more:
            break
    return out


def epochs_by_attempt(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """The epochs each attempt reported, in order."""
    found: dict[int, list[int]] = {}
    for r in records:
        if r["type"] == "progress" and "epoch" in r.get("record", {}):
            found.setdefault(int(r["attempt"]), []).append(int(r["record"]["epoch"]))
    return found


def last_state(c: Client, job_id: str, dest: Path) -> dict[str, Any]:
    """The state.json of the job's newest snapshot, downloaded."""
    snap = c.checkpoints(job_id)[0]
    (state,) = [f for f in snap.files if f.path == "state.json"]
    c.get_blob(state.sha256, dest)
    return dict(json.loads(dest.read_text()))


def test_a_training_whose_worker_is_killed_resumes_on_another_worker(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server(lease_timeout=3.0)
    first = fleet.start_worker("w1")
    job_id = submit_training(fleet)
    with fleet.client() as c:
        wait_for(
            lambda: (p := c.job(job_id).progress) is not None and p.get("epoch", 0) >= 4,
            60,
            "epoch 4 to end",
        )
        first.signal(signal.SIGKILL)  # during epoch 5
        first.popen.wait(10)
        fleet.start_worker("w2")
        done = fleet.wait_status(job_id, "succeeded", "failed", timeout=90)
        assert done["status"] == "succeeded", done
        log = events(c, job_id)
        state = last_state(c, job_id, tmp_path / "state.json")
    history = done["history"]
    assert [h["worker"] for h in history] == ["w1", "w2"]
    assert history[1]["restored"]["snapshot"] > 0
    (restore,) = [r for r in log if r["type"] == "state" and "restored" in r]
    assert restore["attempt"] == 2 and restore["restored"]["files"] >= 1
    assert restore["restored"]["bytes"] > 0 and restore["restored"]["seconds"] >= 0
    by_attempt = epochs_by_attempt(log)
    resumed_at = by_attempt[2][0]
    assert resumed_at >= 5, by_attempt  # it went on from epoch 4's checkpoint, or later
    assert by_attempt[2] == list(range(resumed_at, 11)), "every epoch once in the last attempt"
    merged = sorted({*(e for e in by_attempt[1] if e < resumed_at), *by_attempt[2]})
    assert merged == list(range(1, 11))
    assert state["epoch"] == 10
    trained = [epoch for epoch, _attempt in state["trained"]]
    assert trained == list(range(1, 11)), "its final checkpoint has all 10 epochs, once each"
    output = fleet.cli("logs", job_id).stdout
    assert f"resumed from epoch {resumed_at - 1}" in output


def test_a_snapshot_lists_the_folder_and_a_job_without_one_has_none(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    job_id = submit_training(fleet, 2, 0.1)
    plain = fleet.cli("submit", "--", "python", "-c", "print(1)").stdout.split()[-1]
    assert fleet.wait_status(job_id, "succeeded", "failed", timeout=60)["status"] == "succeeded"
    fleet.wait_status(plain, "succeeded", timeout=60)
    with fleet.client() as c:
        snaps = c.checkpoints(job_id)
        assert c.checkpoints(plain) == []
    assert snaps and snaps[0].progress.get("epoch") == 2
    assert [f.path for f in snaps[0].files] == ["state.json"], "no temporary file is kept"
    assert len(snaps) <= 3


# A job that saves in its grace period: on SIGTERM it writes grace.json and exits; the
# attempt after it prints what it finds restored.
GRACEFUL = r"""
import json, os, signal, sys, time
folder = os.environ["GPUFLEET_CHECKPOINT_DIR"]
attempt = os.environ["GPUFLEET_ATTEMPT"]
saved = os.path.join(folder, "grace.json")
if os.environ.get("GPUFLEET_RESUMED") and os.path.exists(saved):
    print("found", open(saved).read(), flush=True)
    sys.exit(0)
def on_term(signum, frame):
    time.sleep(0.5)  # saving takes a moment, inside the grace period
    with open(saved + ".tmp", "w") as f:
        json.dump({"attempt": attempt, "signal": signum}, f)
    os.replace(saved + ".tmp", saved)
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, on_term)
print("running", flush=True)
for _ in range(600):
    time.sleep(0.1)
"""


def _graceful_job(fleet: Fleet, tmp_path: Path) -> str:
    script = tmp_path / "graceful.py"
    script.write_text(GRACEFUL)
    argv = ["submit", "--checkpoint-dir", "ck", "--grace-period", "10", "--"]
    job_id = fleet.cli(*argv, "python", str(script)).stdout.split()[-1]
    with fleet.client() as c:
        wait_for(lambda: "running" in fleet.cli("logs", job_id).stdout, 30, "the job to run")
        assert c.job(job_id).status == "running"
    return job_id


def _resumed_from_its_grace(fleet: Fleet, job_id: str) -> None:
    """The attempt after the vacated one found what it wrote in its grace period."""
    fleet.start_worker("w2")
    done = fleet.wait_status(job_id, "succeeded", "failed", timeout=60)
    assert done["status"] == "succeeded", done
    first, second = done["history"]
    assert (first["outcome"], first["cause"]) == ("released", "drained")
    assert done["attempts"] == 1, "a drained attempt is not counted against max_attempts"
    assert second["restored"]["files"] == 1
    assert 'found {"attempt": "1", "signal": 15}' in fleet.cli("logs", job_id).stdout


def test_a_drain_with_a_deadline_vacates_a_job_with_its_grace_checkpoint(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    first = fleet.start_worker("w1")
    job_id = _graceful_job(fleet, tmp_path)
    fleet.cli("drain", "w1", "--deadline", "1")
    wait_for(lambda: "SIGTERM now" in first.text(), 15, "the grace signal")
    first.popen.wait(30)  # it handed the job back and stopped
    assert fleet.job(job_id)["status"] == "pending"
    _resumed_from_its_grace(fleet, job_id)


def test_a_worker_sent_sigterm_vacates_a_checkpointing_job_at_once(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    first = fleet.start_worker("w1")
    job_id = _graceful_job(fleet, tmp_path)
    first.signal(signal.SIGTERM)  # a spot instance about to be reclaimed
    assert first.popen.wait(30) == 0
    _resumed_from_its_grace(fleet, job_id)
