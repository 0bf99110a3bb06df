"""The real sleap-nn 0.3.5, on the CPU, with no fakes: a tiny package made here from
synthetic frames (examples/sleap/make_package.py) is trained through ``gpufleet sleap
train --wait``, its model comes back, ``gpufleet sleap track`` runs it, and sleap-io reads
the predictions; and a second run is stopped early with ``gpufleet stop``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.e2e.conftest import Fleet, wait_for
from tests.sleap.conftest import run_in_venv

EXAMPLE = Path(__file__).parents[2] / "examples" / "sleap" / "make_package.py"
READ_PREDICTIONS = """
import json, sys
import sleap_io as sio
labels = sio.load_slp(sys.argv[1])
video = labels.videos[0]
print(json.dumps({
    "frames": sorted(lf.frame_idx for lf in labels),
    "instances": sum(len(lf.instances) for lf in labels),
    "filename": video.filename,
    "shape": list(video[0].shape),
}))
"""


def make(venv: Path, out: Path, *args: str) -> dict[str, str]:
    made: dict[str, str] = json.loads(run_in_venv(venv, str(EXAMPLE), str(out), *args))
    return made


def job_named(fleet: Fleet, name: str) -> dict[str, Any]:
    (job,) = [j for j in json.loads(fleet.cli("jobs", "--json").stdout) if j["name"] == name]
    return job


def test_train_watch_get_the_model_and_track_with_the_real_sleap_nn(
    sleap_fleet: Fleet, sleap_venv: Path, tmp_path: Path
) -> None:
    made = make(sleap_venv, tmp_path / "project", "--frames", "12", "--epochs", "3")
    done = sleap_fleet.cli("sleap", "train", made["package"], "--cpu", "--wait", timeout=600)
    assert "epoch 3/3, loss" in done.stderr, done.stderr
    model = tmp_path / "project" / "models" / made["run_name"]
    assert (model / "best.ckpt").stat().st_size > 0, done.stderr
    assert (model / "training_config.yaml").is_file()

    job = job_named(sleap_fleet, made["run_name"])
    with sleap_fleet.client() as c:
        page = c.events(job["id"], after=0, limit=10_000)
    records = [e.data["record"] for e in page.events if e.type == "progress"]
    epochs: list[dict[str, Any]] = [r for r in records if "loss" in r]  # type: ignore[misc]
    assert [(r["epoch"], r["epochs"]) for r in epochs] == [(1, 3), (2, 3), (3, 3)], records
    assert all(isinstance(r["loss"], float) and "val_loss" in r for r in epochs), epochs

    data = Path(made["labels"])
    out = tmp_path / "predicted"
    sleap_fleet.cli(
        "sleap", "track", "--data", str(data), "--model", str(model), "--cpu", "--wait",
        "-o", str(out), timeout=600,
    )  # fmt: skip
    predictions = out / f"{data.name}.predictions.slp"
    read = json.loads(run_in_venv(sleap_venv, "-c", READ_PREDICTIONS, str(predictions)))
    assert read["frames"] == list(range(12)), read
    assert read["filename"] == str(data.resolve())  # the user's own copy: it opens at once
    assert read["shape"] == [64, 64, 1]


def test_stop_ends_real_training_early_and_keeps_its_model(
    sleap_fleet: Fleet, sleap_venv: Path, tmp_path: Path
) -> None:
    made = make(sleap_venv, tmp_path / "long", "--epochs", "1000", "--steps", "2")
    job = sleap_fleet.cli("sleap", "train", made["package"], "--cpu").stdout.split()[0]
    with sleap_fleet.client() as c:
        wait_for(lambda: (c.job(job).progress or {}).get("epoch", 0) >= 2, 300, "two epochs")
    asked = time.monotonic()
    sleap_fleet.cli("stop", job, "--stop-grace", "120")
    ended = sleap_fleet.wait_status(job, "succeeded", "failed", timeout=120)
    assert ended["status"] == "succeeded" and ended["stopped_early"], ended
    assert ended["exit_code"] == 0
    assert time.monotonic() - asked < 100  # sleap-nn's own stop, not the escalation
    logs = sleap_fleet.cli("logs", job).stdout + sleap_fleet.cli("logs", job).stderr
    assert "Received control message" in logs  # sleap-nn heard the stop command
    got = tmp_path / "got"
    sleap_fleet.cli("download", job, "-o", str(got))
    assert (got / "models" / made["run_name"] / "best.ckpt").is_file()
    assert ended["progress"]["epoch"] < 1000


#: Where the worker of the next test keeps what it builds, between runs on one machine
#: (torch and its CUDA libraries: about 6 GB, and as much again in uv's cache).
KEPT = Path.home() / ".cache" / "gpufleet" / "test-sleap-worker-env"
#: This machine's own copy of torch's wheels (a local index), when it has one: uv reads
#: it before PyPI, as a lab's mirror would be read.
LOCAL_INDEX = Path("/opt/pypi-more/simple")
SLEAP_ENV = ("--sleap-nn", "0.3.5", "--with", "torch==2.14.1", "--with", "torchvision==0.29.1")


def test_a_worker_without_sleap_nn_builds_its_environment_and_trains_and_tracks_in_it(
    fleet: Fleet, sleap_venv: Path, tmp_path: Path
) -> None:
    """`--sleap-nn 0.3.5` on a worker with no sleap-nn on its PATH: the worker builds the
    environment itself with uv (from the registry), trains in it, and the track job finds
    it built."""
    fleet.start_server(lease_timeout=30.0)
    env = {"UV_CACHE_DIR": str(KEPT / "uv-cache")}
    if LOCAL_INDEX.is_dir():
        env["UV_EXTRA_INDEX_URL"] = LOCAL_INDEX.as_uri()
    fleet.start_worker(
        "box",
        "--env-cache-dir",
        str(KEPT / "envs"),
        "--env-build-timeout",
        "3000",
        env_extra=env,
    )
    made = make(sleap_venv, tmp_path / "project", "--frames", "12", "--epochs", "2")
    done = fleet.cli("sleap", "train", made["package"], "--cpu", *SLEAP_ENV, "--wait", timeout=3600)
    assert "epoch 2/2, loss" in done.stderr, done.stderr
    model = tmp_path / "project" / "models" / made["run_name"]
    assert (model / "best.ckpt").stat().st_size > 0, done.stderr
    trained = fleet.job(job_named(fleet, made["run_name"])["id"])
    assert "sleap-nn" not in trained["spec"]["requirements"]["tools"]
    assert trained["history"][-1]["environment"]["versions"]["sleap-nn"] == "0.3.5"

    data = Path(made["labels"])
    out = tmp_path / "predicted"
    fleet.cli(
        "sleap", "track", "--data", str(data), "--model", str(model), "--cpu", *SLEAP_ENV,
        "--wait", "-o", str(out), timeout=1200,
    )  # fmt: skip
    tracked = [
        j for j in json.loads(fleet.cli("jobs", "--json").stdout) if j["id"] != trained["id"]
    ]
    (track,) = tracked
    assert fleet.job(track["id"])["history"][-1]["environment"]["built"] is False  # as trained
    predictions = out / f"{data.name}.predictions.slp"
    read = json.loads(run_in_venv(sleap_venv, "-c", READ_PREDICTIONS, str(predictions)))
    assert read["frames"] == list(range(12)), read
