"""The real sleap-nn 0.3.5 resumed by the fleet (issue 34): a training whose worker is
SIGKILLed after its second epoch goes on, on another worker, from the run folder the
fleet kept, and the model it ends with has one ``training_log.csv`` whose epochs go on
past the second instead of starting over."""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

from tests.e2e.conftest import Fleet, wait_for
from tests.e2e.test_checkpoints import epochs_by_attempt, events
from tests.sleap.test_sleap_nn import make

EPOCHS = 6


def test_a_training_whose_worker_is_killed_goes_on_from_its_kept_run_folder(
    fleet: Fleet, sleap_venv: Path, tmp_path: Path
) -> None:
    fleet.start_server(lease_timeout=10.0)
    path = {"PATH": f"{sleap_venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    first = fleet.start_worker("w1", env_extra=path)
    made = make(
        sleap_venv, tmp_path / "p", "--frames", "8", "--epochs", str(EPOCHS), "--steps", "8"
    )
    job = fleet.cli("sleap", "train", made["package"], "--cpu").stdout.split()[0]
    with fleet.client() as c:

        def kept_epoch_two() -> bool:
            snaps = c.checkpoints(job)
            return (
                bool(snaps)
                and (snaps[0].progress.get("epoch") or 0) >= 2
                and any(f.path == "last.ckpt" for f in snaps[0].files)
            )

        wait_for(kept_epoch_two, 300, "a snapshot of epoch 2 with its last.ckpt")
        first.signal(signal.SIGKILL)
        first.popen.wait(10)
        fleet.start_worker("w2", env_extra=path)
        done = fleet.wait_status(job, "succeeded", "failed", timeout=300)
        # the records of ended epochs (batch records say the epoch under way)
        log = [e for e in events(c, job) if "loss" in e.get("record", {})]
        by_attempt = epochs_by_attempt(log)
    assert done["status"] == "succeeded", done
    assert [h["worker"] for h in done["history"]] == ["w1", "w2"]
    assert done["history"][1]["restored"]["snapshot"] > 0
    resumed_at = by_attempt[2][0]
    assert resumed_at >= 3, by_attempt  # went on after epoch 2, not from the start
    assert by_attempt[2] == list(range(resumed_at, EPOCHS + 1)), by_attempt

    got = tmp_path / "got"
    fleet.cli("download", job, "-o", str(got))
    assert sorted(p.name for p in (got / "models").iterdir()) == [made["run_name"]]  # no -1
    run = got / "models" / made["run_name"]
    assert (run / "best.ckpt").stat().st_size > 0
    with (run / "training_log.csv").open() as f:
        epochs = [int(row["epoch"]) for row in csv.DictReader(f)]
    assert epochs == list(range(EPOCHS)), epochs  # sleap-nn counts from 0: each epoch once
    assert not any(p.name.startswith(".gpufleet-") for p in run.iterdir())
