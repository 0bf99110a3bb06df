"""Checkpoints kept by the fleet, on real server and worker processes (issue 34): a
training job whose worker is SIGKILLed resumes on another worker from its last snapshot,
and ends with every epoch trained once in the attempt that finished it."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from gpufleet.client import Client
from tests.e2e.conftest import Fleet, wait_for

TRAIN = Path(__file__).parents[2] / "examples" / "checkpoints" / "train.py"


def submit_training(fleet: Fleet, epochs: int = 10, seconds: float = 0.35, *more: str) -> str:
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


def test_pause_frees_the_gpu_and_resume_goes_on_from_the_checkpoint_elsewhere(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    first = fleet.start_gpu_worker("gpu-a", [("NVIDIA GeForce RTX 4090", 24, 23)])
    job_id = submit_training(fleet, 6, 0.35, "--gpus", "1", "--grace-period", "5")
    with fleet.client() as c:
        wait_for(lambda: (c.job(job_id).progress or {}).get("epoch", 0) >= 2, 60, "epoch 2")
        paused_at = time.monotonic()
        said = fleet.cli("pause", job_id).stdout
        assert "pausing" in said
        fleet.wait_status(job_id, "paused", timeout=15)
        assert time.monotonic() - paused_at < 5 + 3, "held within its grace period"
        gpu = c.workers()[0]
        assert gpu.name == "gpu-a" and gpu.status == "available" and not gpu.running
        held = c.job(job_id)
        assert held.attempts == 0 and held.losses == 0, "a pause is no failure and no loss"
        kept = c.checkpoints(job_id)[0].progress["epoch"]
        time.sleep(1.0)
        assert c.job(job_id).status == "paused", "a paused job is not claimed"
        first.signal(signal.SIGTERM)
        first.popen.wait(30)
        fleet.start_gpu_worker("gpu-b", [("NVIDIA GeForce RTX 4090", 24, 23)])
        fleet.cli("resume", job_id)
        done = fleet.wait_status(job_id, "succeeded", "failed", timeout=60)
        log = events(c, job_id)
    assert done["status"] == "succeeded", done
    first_attempt, second = done["history"]
    assert (first_attempt["outcome"], first_attempt["cause"]) == ("paused", "paused")
    assert second["worker"] == "gpu-b" and second["restored"]["files"] == 1
    assert epochs_by_attempt(log)[2] == list(range(kept + 1, 7)), "on from its checkpoint"


def test_a_cuda_out_of_memory_is_retried_only_on_a_bigger_gpu(fleet: Fleet) -> None:
    fleet.start_server()
    a100 = [("NVIDIA A100-SXM4-80GB", 80, 79)]
    away = fleet.start_gpu_worker("big", a100)  # of the fleet, but away for now
    away.signal(signal.SIGTERM)
    away.popen.wait(30)
    fleet.start_gpu_worker("small", [("NVIDIA GeForce RTX 4090", 24, 23)])
    big = ["--gpus", "1", "--", "python", str(TRAIN), "--epochs", "4", "--epoch-seconds", "0.2"]
    argv = ["submit", "--checkpoint-dir", "checkpoints", *big[:2], "--max-attempts", "3"]
    job_id = fleet.cli(*argv, *big[2:], "--oom-at-epoch", "3").stdout.split()[-1]
    with fleet.client() as c:
        wait_for(lambda: c.job(job_id).raised is not None, 60, "the out-of-memory retry")
        waiting = c.job(job_id)
        assert waiting.status == "pending" and waiting.attempts == 1
        why = " ".join(fleet.cli("why", job_id).stdout.split())  # as one line, unwrapped
        assert "ran out of GPU memory on a GPU with 24 GiB; the next needs more" in why, why
        assert "needs 24577 MiB" in why, why
        time.sleep(1.0)
        assert c.job(job_id).status == "pending", "the 24 GiB worker does not take it again"
        fleet.start_gpu_worker("big", a100)  # back
        done = fleet.wait_status(job_id, "succeeded", "failed", timeout=60)
        log = events(c, job_id)
    assert done["status"] == "succeeded", done
    first, second = done["history"]
    assert (first["worker"], first["cause"]) == ("small", "gpu_oom")
    assert second["worker"] == "big" and second["restored"] is not None
    assert epochs_by_attempt(log)[2] == [3, 4], "it resumed from epoch 2's checkpoint"
    assert "ran out of GPU memory on a GPU with 24 GiB" in done["raised"]


def test_a_cuda_out_of_memory_with_no_bigger_gpu_fails_at_once(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_gpu_worker("small", [("NVIDIA GeForce RTX 4090", 24, 23)])
    argv = ["submit", "--gpus", "1", "--max-attempts", "3", "--"]
    argv += ["python", str(TRAIN), "--epochs", "2", "--epoch-seconds", "0.1", "--oom-at-epoch", "1"]
    job_id = fleet.cli(*argv).stdout.split()[-1]
    done = fleet.wait_status(job_id, "succeeded", "failed", timeout=60)
    assert done["status"] == "failed" and done["attempts"] == 1
    assert done["history"][0]["cause"] == "gpu_oom"
    assert "no worker of pool default has a GPU with more than 24 GiB" in done["error"]


def test_a_job_that_fills_its_gpu_and_dies_silently_is_an_out_of_memory_by_nvml(
    fleet: Fleet, tmp_path: Path
) -> None:
    """No framework's message: the worker's NVML readings say its processes held nearly
    all its GPU's memory before it failed."""
    processes = tmp_path / "processes.json"
    fleet.start_server()
    fleet.start_gpu_worker(
        "small",
        [("NVIDIA GeForce RTX 4090", 24, 23)],
        env_extra={"FAKE_NVML_PROCESSES": str(processes)},
    )
    script = (
        "import json, os, sys, time\n"
        f"json.dump({{'0': [[os.getpid(), 24000]]}}, open({str(processes)!r}, 'w'))\n"
        "time.sleep(2.5)\n"  # some heartbeats read it
        "sys.exit(1)\n"
    )
    argv = ["submit", "--gpus", "1", "--max-attempts", "3", "--", "python", "-c", script]
    done = fleet.wait_status(fleet.cli(*argv).stdout.split()[-1], "failed", timeout=60)
    assert done["history"][0]["cause"] == "gpu_oom" and done["attempts"] == 1
    assert "no worker of pool default has a GPU with more than 24 GiB" in done["error"]
    assert "held 24000 of its GPUs' 24576 MiB" in fleet.cli("logs", done["id"]).stderr
