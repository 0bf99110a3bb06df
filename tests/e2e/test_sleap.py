"""SLEAP jobs on real servers and workers, with a small fake of the ``sleap-nn`` command
line (tests/fake_sleap) at the process boundary: the package's journey, the adapter's
relay over real ZMQ sockets, stop, two jobs on two GPUs, and tracking. The real sleap-nn
runs in tests/sleap (``make test-sleap``)."""

from __future__ import annotations

import json
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import h5py
import yaml

from tests.e2e.conftest import Fleet, wait_for
from tests.sleap_pkg import FAKE_SLEAP, config, make_package, run_name

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


def test_auto_select_spreads_a_packages_models_over_free_gpus(fleet: Fleet, tmp_path: Path) -> None:
    """The first model takes the GPU with the most free memory (the 80 GiB one); the
    second is chosen once the first holds it, so it takes a GPU of the 2-GPU box at once
    rather than waiting behind the first."""
    fleet.start_server()
    env = {**SLEAP_PATH, "FAKE_SLEAP_BATCH_S": "0.2"}
    fleet.start_gpu_worker("big", [("NVIDIA A100-SXM4-80GB", 80, 78)], env_extra=env)
    fleet.start_gpu_worker("twogpu", [("NVIDIA RTX 4090", 24, 24)] * 2, env_extra=env)
    with fleet.client() as c:  # both polling for work (a loaded machine is slow to it)
        wait_for(
            lambda: {w.status for w in c.workers()} == {"available"}, 30, "both workers to poll"
        )
    pkg = make_package(tmp_path / "p.zip", epochs=6)  # about 4 s each: time to overlap
    done = fleet.cli(
        "sleap", "train", str(pkg), "--auto-select", "--wait", "-o", str(tmp_path), timeout=120
    )
    said = " ".join(done.stderr.split())
    assert "worker big" in said and "worker twogpu" in said, done.stderr
    jobs = jobs_named(fleet)
    ran = {h: jobs[run_name(h)]["worker"] for h in ("centroid", "centered_instance")}
    assert ran == {"centroid": "big", "centered_instance": "twogpu"}
    runs = [
        json.loads((tmp_path / "models" / run_name(h) / "fake-run.json").read_text())
        for h in ("centroid", "centered_instance")
    ]
    first, second = sorted(runs, key=lambda r: r["start"])
    assert second["start"] < first["end"], runs  # they ran at once


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


def test_track_by_name_takes_the_newest_training_that_succeeded(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    sleap_worker(fleet)
    pkg = make_package(tmp_path / "p.zip", ("single_instance",), epochs=1)
    name = run_name("single_instance")
    first = fleet.cli("sleap", "train", str(pkg), "--cpu").stdout.split()[0]
    fleet.wait_status(first, "succeeded", timeout=60)
    second = fleet.cli("sleap", "train", str(pkg), "--cpu", "--epochs", "2").stdout.split()[0]
    fleet.wait_status(second, "succeeded", timeout=60)
    data = tmp_path / "session.slp"
    data.write_bytes(b"frames")
    done = fleet.cli(
        "sleap", "track", "--data", str(data), "--model", f"job:{name}", "--cpu", "--wait",
        "-o", str(tmp_path / "out"),
    )  # fmt: skip
    assert (tmp_path / "out" / "session.slp.predictions.slp").is_file(), done.stderr
    (track,) = [j for j in jobs_named(fleet).values() if j["name"].startswith("track")]
    inputs = fleet.job(track["id"])["spec"]["inputs"]
    assert [i["ref"] for i in inputs if i["kind"] == "job"] == [second]


def inference_package(path: Path, script: str | None, models: tuple[str, ...]) -> Path:
    """An inference package as SLEAP's GUI exports one: trained run folders, the labels
    it embeds its frames in, and (unless None) its inference script."""
    with zipfile.ZipFile(path, "w") as zf:
        for run in models:
            zf.writestr(f"models/{run}/best.ckpt", "epoch 9\n")
            zf.writestr(f"models/{run}/training_config.yaml", "model_config: {}\n")
        zf.writestr("labels.v001.pkg.slp", b"embedded frames the fake never opens")
        if script is not None:
            zf.writestr("inference-script.sh", script)
    return path


def test_an_inference_package_tracks_with_its_own_options(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    sleap_worker(fleet)
    runs = ("260825_115048.centroid.n=4", "260825_115048.centered_instance.n=4")
    # as SLEAP writes it: the exporting machine's absolute paths, the models it did not
    # retrain by theirs too, and its options
    script = (
        "#!/bin/bash\n"
        "sleap-nn track --data_path /home/me/proj/labels.v001.slp --only_suggested_frames "
        f"--model_paths models/{runs[0]} --model_paths /home/me/proj/models/{runs[1]} "
        "-o labels.v001.slp.predictions.slp --batch_size 4\n"
    )
    pkg = inference_package(tmp_path / "labels.v001.slp.inference.zip", script, runs)
    out = tmp_path / "out"
    done = fleet.cli("sleap", "track", str(pkg), "--cpu", "--wait", "-o", str(out))
    predictions = out / "labels.v001.slp.predictions.slp"
    assert f"predictions: {predictions}" in done.stderr.replace("\n", ""), done.stderr
    with h5py.File(predictions, "r") as f:
        (video,) = [json.loads(v) for v in f["videos_json"][()]]
    # pointed at the data taken out of the package, beside the predictions
    assert video["backend"]["filename"] == str(out / "labels.v001.pkg.slp")
    assert (out / "labels.v001.pkg.slp").read_bytes().startswith(b"embedded frames")
    (track,) = jobs_named(fleet).values()
    command = fleet.job(track["id"])["spec"]["command"]
    assert command == [
        "sleap-nn", "track", "--data_path", "labels.v001.pkg.slp",
        "--model_paths", f"models/{runs[0]}", "--model_paths", f"models/{runs[1]}",
        "--only_suggested_frames", "--batch_size", "4",
        "-o", "labels.v001.slp.predictions.slp", "--gui",
    ]  # fmt: skip

    no_script = inference_package(tmp_path / "plain.zip", None, runs[:1])
    fleet.cli("sleap", "track", str(no_script), "--cpu", "--wait", "-o", str(tmp_path / "o2"))
    assert (tmp_path / "o2" / "labels.v001.pkg.slp.predictions.slp").is_file()

    lacking = inference_package(tmp_path / "lacking.zip", script, runs[:1])
    refused = fleet.cli("sleap", "track", str(lacking), check=False)
    assert refused.returncode == 2
    assert refused.stderr.replace("\n", "") == (
        f"error: lacking.zip:inference-script.sh, line 2: names model /home/me/proj/models/"
        f"{runs[1]}, which the package lacks (no training_config.yaml or best.ckpt in it); a "
        "training package trains first: gpufleet sleap train"
    )
    assert len(json.loads(fleet.cli("jobs", "--json").stdout)) == 2  # nothing submitted


def test_a_labels_file_trains_with_a_config_and_with_a_model_type(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    sleap_worker(fleet)
    labels = tmp_path / "project" / "labels.v002.slp"
    labels.parent.mkdir()
    labels.write_bytes(b"labels the fake only looks for")
    mine = tmp_path / "centroid_config.yaml"  # it names labels elsewhere: replaced
    mine.write_text(yaml.safe_dump(config("centroid", 2, labels="/old/machine/labels.slp")))
    done = fleet.cli(
        "sleap", "train", str(labels), "--config", str(mine), "--model-type", "bottomup",
        "--epochs", "2", "--cpu", "--wait", timeout=120,
    )  # fmt: skip
    runs = {p.name.split(".", 1)[1]: p for p in (labels.parent / "models").iterdir()}
    assert set(runs) == {"centroid", "bottomup"}, done.stderr
    assert (runs["centroid"] / "best.ckpt").read_text() == "epoch 2\n"
    trained = yaml.safe_load((runs["bottomup"] / "training_config.yaml").read_text())
    assert trained["data_config"]["train_labels_path"] == ["labels.v002.slp"]
    assert set(trained["model_config"]["head_configs"]) == {"bottomup"}
    tags = sorted(tuple(j["spec"]["tags"]) for j in map(fleet.job, jobs_named_ids(fleet)))
    assert tags == [("sleap", "bottomup"), ("sleap", "centroid")]

    refused = fleet.cli("sleap", "train", str(labels), check=False)
    assert refused.returncode == 2
    assert "--config CONFIG.yaml or --model-type TYPE" in refused.stderr.replace("\n", "")


def jobs_named_ids(fleet: Fleet) -> list[str]:
    return [j["id"] for j in jobs_named(fleet).values()]


def test_a_failed_training_says_why_in_sleap_nns_words_and_may_keep_its_checkpoint(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    sleap_worker(fleet, FAKE_SLEAP_FAIL_AFTER="2")
    pkg = make_package(tmp_path / "p.zip", ("single_instance",), epochs=5)
    run = tmp_path / "kept" / "models" / run_name("single_instance")
    args = ("sleap", "train", str(pkg), "--cpu", "--max-attempts", "1", "--wait")
    failed = fleet.cli(*args, "-o", str(tmp_path / "plain"), check=False)
    said = failed.stderr.replace("\n", "")
    assert failed.returncode == 1
    assert "sleap-nn said: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB" in said
    assert "--download-failed" in said
    assert "attempt 1/1 failed: " in said  # as it ended, with its stderr's last lines
    assert "stderr: RuntimeError: CUDA out of memory" in said
    assert not (tmp_path / "plain" / "models").exists()  # not asked for

    kept = fleet.cli(*args, "-o", str(tmp_path / "kept"), "--download-failed", check=False)
    assert kept.returncode == 1
    assert (run / "best.ckpt").read_text() == "epoch 2\n", kept.stderr
    assert f"model: {run}" in kept.stderr.replace("\n", "")


def test_a_worker_without_sleap_nn_builds_the_version_a_training_names(
    fleet: Fleet, tmp_path: Path
) -> None:
    """`sleap train --sleap-nn VERSION` on a worker with no sleap-nn on its PATH: the
    worker builds that version's environment once (here from a folder holding a wheel
    of the fake sleap-nn), and both models train through it."""
    import sys

    from tests.wheels import make_wheel

    wheels = tmp_path / "wheels"
    launcher = (
        '__version__ = "0.3.5"\n'
        "def main():\n"
        "    import os, sys\n"
        f"    os.execv({sys.executable!r}, [{sys.executable!r}, "
        f"{str(Path(FAKE_SLEAP) / 'sleap-nn')!r}, *sys.argv[1:]])\n"
    )
    make_wheel(wheels, "sleap-nn", "0.3.5", scripts=["sleap-nn"], module=launcher)
    fleet.env["UV_CACHE_DIR"] = str(tmp_path / "uv-cache")
    fleet.start_server()
    fleet.start_worker(
        "box", "--env-find-links", str(wheels), "--env-cache-dir", str(tmp_path / "envs")
    )
    pkg = make_package(tmp_path / "project" / "labels.slp.training_job.zip", epochs=2)
    done = fleet.cli("sleap", "train", str(pkg), "--cpu", "--sleap-nn", "0.3.5", "--wait")
    assert "epoch 2/2" in done.stderr, done.stderr
    for head in ("centroid", "centered_instance"):
        assert (tmp_path / "project" / "models" / run_name(head) / "best.ckpt").is_file()
    used = []
    for job in jobs_named(fleet).values():
        detail = fleet.job(job["id"])
        assert "sleap-nn" not in detail["spec"]["requirements"]["tools"]
        env = detail["history"][-1]["environment"]
        assert env["versions"]["sleap-nn"] == "0.3.5"
        used.append(env["built"])
    assert sorted(used) == [False, True]  # built once, for the first model
