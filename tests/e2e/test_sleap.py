"""SLEAP jobs on real servers and workers, with a small fake of the ``sleap-nn`` command
line (tests/fake_sleap) at the process boundary: the package's journey, the adapter's
relay over real ZMQ sockets, stop, two jobs on two GPUs, and tracking. The real sleap-nn
runs in tests/sleap (``make test-sleap``)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import h5py

from tests.e2e.conftest import Fleet, wait_for
from tests.sleap_pkg import FAKE_SLEAP, make_package, run_name

SLEAP_PATH = {"PATH": f"{FAKE_SLEAP}{os.pathsep}{os.environ['PATH']}"}


def sleap_worker(fleet: Fleet, name: str = "lab", **env: str) -> None:
    fleet.start_worker(name, env_extra={**SLEAP_PATH, **env})


def events(fleet: Fleet, job: str, types: str) -> list[dict[str, Any]]:
    with fleet.client() as c:
        page = c.events(job, after=0, limit=5000)
    return [e.data for e in page.events if e.type in types.split(",")]


def jobs_named(fleet: Fleet) -> dict[str, dict[str, Any]]:
    listed = json.loads(fleet.cli("jobs", "--json").stdout)
    return {j["name"]: j for j in listed}


def test_a_package_trains_one_job_per_model_and_its_models_come_back(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    sleap_worker(fleet)
    pkg = make_package(tmp_path / "project" / "labels.slp.training_job.zip", epochs=4)
    done = fleet.cli("sleap", "train", str(pkg), "--cpu", "--wait", timeout=120)
    assert "epoch 4/4, loss 0.25, val_loss 0.375" in done.stderr, done.stderr
    for head in ("centroid", "centered_instance"):
        run = tmp_path / "project" / "models" / run_name(head)  # beside the package
        assert (run / "best.ckpt").read_text() == "epoch 4\n"
        assert (run / "training_config.yaml").is_file()
        assert f"model: {run}" in done.stderr.replace("\n", "")
    jobs = jobs_named(fleet)
    job = jobs[run_name("centroid")]
    assert job["status"] == "succeeded" and job["model"] == "centroid"
    detail = fleet.job(job["id"])
    assert detail["spec"]["tags"] == ["sleap", "centroid"]
    assert detail["progress"] == {"message": "training ended", "epoch": 4}
    assert detail["metrics"]["loss"] == 0.25 and detail["metrics"]["val_loss"] == 0.375
    epochs = [r["record"] for r in events(fleet, job["id"], "progress")]
    ends = [r for r in epochs if "loss" in r]
    assert [(r["epoch"], r["epochs"], r["loss"]) for r in ends] == [
        (e, 4, 1.0 / e) for e in (1, 2, 3, 4)
    ]

    again = fleet.cli("sleap", "train", str(pkg), "--cpu")  # the same package: nothing sent
    assert "unchanged, 0 bytes sent" in again.stderr, again.stderr
    assert len(again.stdout.split()) == 2


def test_a_folder_shaped_package_trains_too_and_a_broken_one_sends_nothing(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    sleap_worker(fleet)
    nested = make_package(tmp_path / "old.zip", ("bottomup",), folder="old_export", epochs=1)
    out = tmp_path / "out"
    done = fleet.cli("sleap", "train", str(nested), "--cpu", "--wait", "-o", str(out))
    assert (out / "models" / run_name("bottomup") / "best.ckpt").is_file(), done.stderr
    broken = make_package(tmp_path / "broken.zip", skip=("centroid.yaml",))
    refused = fleet.cli("sleap", "train", str(broken), check=False)
    assert refused.returncode == 2
    assert refused.stderr == (
        "error: broken.zip:train-script.sh, line 1 names config centroid.yaml, which the "
        "package lacks\n"
    )
    assert len(jobs_named(fleet)) == 1  # nothing was submitted for it


def test_stop_asks_sleap_nn_itself_and_the_model_is_kept(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    sleap_worker(fleet, FAKE_SLEAP_BATCH_S="0.1")
    pkg = make_package(tmp_path / "p.zip", ("single_instance",), epochs=500)
    job = fleet.cli("sleap", "train", str(pkg), "--cpu").stdout.split()[0]
    with fleet.client() as c:
        wait_for(lambda: (c.job(job).progress or {}).get("epoch", 0) >= 1, 30, "an epoch")
    said = fleet.cli("stop", job, "--stop-grace", "60").stdout
    assert "sent sleap-nn's stop command (SIGINT after 60s" in said  # not "SIGINT" alone
    ended = fleet.wait_status(job, "succeeded", "failed", timeout=30)
    assert ended["status"] == "succeeded" and ended["stopped_early"], ended
    assert ended["exit_code"] == 0
    out = tmp_path / "got"
    fleet.cli("download", job, "-o", str(out))
    assert (out / "models" / run_name("single_instance") / "best.ckpt").is_file()
    logs = fleet.cli("logs", job).stdout
    assert "stopped by the controller" in logs  # the ZMQ command, not a signal


def test_two_sleap_jobs_run_at_once_on_two_gpus_each_on_its_own_ports(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    fleet.start_gpu_worker(
        "twogpu",
        [("NVIDIA RTX 4090", 24, 24), ("NVIDIA RTX 4090", 24, 24)],
        env_extra={**SLEAP_PATH, "FAKE_SLEAP_BATCH_S": "0.2"},
    )
    pkg = make_package(tmp_path / "p.zip", epochs=6)  # about 4 s each: time to overlap
    done = fleet.cli("sleap", "train", str(pkg), "--auto-select", "--wait", "-o", str(tmp_path))
    assert "worker twogpu" in done.stderr and "chosen" in done.stderr, done.stderr
    runs = [
        json.loads((tmp_path / "models" / run_name(h) / "fake-run.json").read_text())
        for h in ("centroid", "centered_instance")
    ]
    assert {r["cuda"] for r in runs} == {"0", "1"}
    ports = [p for r in runs for p in r["ports"]]
    assert len(set(ports)) == 4, ports
    first, second = sorted(runs, key=lambda r: r["start"])
    assert second["start"] < first["end"], runs  # they overlapped


def test_track_runs_the_trained_models_and_points_predictions_at_the_users_data(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    sleap_worker(fleet)
    pkg = make_package(tmp_path / "p.zip", ("single_instance",), epochs=1)
    job = fleet.cli("sleap", "train", str(pkg), "--cpu").stdout.split()[0]
    data = tmp_path / "mine" / "session1.slp"
    data.parent.mkdir()
    data.write_bytes(b"frames the fake never opens")
    out = tmp_path / "predicted"
    done = fleet.cli(
        "sleap", "track", "--data", str(data), "--model", f"job:{job}", "--cpu", "--wait",
        "-o", str(out),
    )  # fmt: skip
    predictions = out / "session1.slp.predictions.slp"
    assert f"predictions: {predictions}" in done.stderr.replace("\n", ""), done.stderr
    with h5py.File(predictions, "r") as f:
        (video,) = [json.loads(v) for v in f["videos_json"][()]]
    assert video["backend"]["filename"] == str(data.resolve())
    tracks = [j for j in jobs_named(fleet).values() if j["name"].startswith("track")]
    progress = [r["record"] for r in events(fleet, tracks[0]["id"], "progress")]
    assert progress[-1]["step"] == progress[-1]["steps"] == 8 and progress[-1]["progress"] == 1.0
    logs = fleet.cli("logs", tracks[0]["id"]).stdout
    assert "n_processed" not in logs  # progress lines are records, not output


def test_train_then_track_chains_the_jobs(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    sleap_worker(fleet)
    pkg = make_package(tmp_path / "p.zip", epochs=1)
    data = tmp_path / "video.mp4"
    data.write_bytes(b"not a video")
    out = tmp_path / "out"
    done = fleet.cli(
        "sleap", "train", str(pkg), "--cpu", "--then-track", str(data), "--wait", "-o", str(out),
        timeout=120,
    )  # fmt: skip
    assert (out / "models" / run_name("centered_instance") / "best.ckpt").is_file()
    with h5py.File(out / "video.mp4.predictions.slp", "r") as f:
        (video,) = [json.loads(v) for v in f["videos_json"][()]]
    assert video["backend"]["filename"] == str(data.resolve()), done.stderr


def test_a_sleap_job_waits_for_a_worker_with_sleap_nn_and_why_says_so(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    fleet.start_worker("plain")
    pkg = make_package(tmp_path / "p.zip", ("bottomup",))
    submitted = fleet.cli("sleap", "train", str(pkg), "--cpu")
    assert "no registered worker could ever run" in submitted.stderr.lower(), submitted.stderr
    job = submitted.stdout.split()[0]
    why = fleet.cli("why", job).stdout
    assert "needs sleap-nn on the worker's PATH" in why, why
    sleap_worker(fleet, "lab")
    assert fleet.wait_status(job, "succeeded", "failed", timeout=60)["status"] == "succeeded"
    capability = json.loads(fleet.cli("workers", "--json").stdout)
    tools = {w["name"]: w["capability"]["tools"] for w in capability}
    assert tools == {"plain": {}, "lab": {"sleap-nn": "0.3.5"}}


def test_a_session_string_sends_the_package_to_that_worker(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    fleet.start_worker("other", env_extra=SLEAP_PATH)
    chosen = fleet.start_worker("chosen", env_extra=SLEAP_PATH)
    session = wait_for(lambda: re.search(r"session: (gfs1_\S+)", chosen.text()), 20, "session")
    pkg = make_package(tmp_path / "p.zip", epochs=1)
    fleet.cli("sleap", "train", str(pkg), "--cpu", "--session", session[1], "--wait")
    ran = {j["worker"] for j in jobs_named(fleet).values()}
    assert ran == {"chosen"}
