"""Reading SLEAP training packages (both zip shapes), the jobs made of them, placing the
trained models and pointing predictions at the user's data: on real files, no server."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest
import yaml

from gpufleet.client.sleap import (
    place_models,
    read_package,
    repoint,
    run_path_of,
    track_spec,
    train_specs,
)
from gpufleet.errors import PackageError
from gpufleet.wire import InputModel, RequirementsModel
from tests.sleap_pkg import config, make_package, run_name

PACKAGE = InputModel(kind="blob", ref="a" * 64, dest=".", label="p.zip")


@pytest.mark.parametrize("folder", ["", "labels.slp.training_job"])
def test_both_zip_shapes_read_as_one_package(tmp_path: Path, folder: str) -> None:
    pkg = read_package(make_package(tmp_path / "p.zip", folder=folder))
    assert pkg.root == folder
    assert [(m.model_type, m.run_name, m.ckpt_dir) for m in pkg.models] == [
        ("centroid", run_name("centroid"), "models"),
        ("centered_instance", run_name("centered_instance"), "models"),
    ]
    assert pkg.labels == ("labels.pkg.slp",)
    assert [m.epochs for m in pkg.models] == [3, 3]


def test_each_model_becomes_a_sleap_nn_train_job_with_the_lines_own_arguments(
    tmp_path: Path,
) -> None:
    pkg = read_package(make_package(tmp_path / "p.zip"))
    specs = train_specs(pkg, PACKAGE, RequirementsModel(prefer_cuda=True), epochs=7, priority=5)
    first = specs[0]
    assert first.command == [
        "sleap-nn",
        "train",
        "--config-name",
        "centroid.yaml",
        "--config-dir",
        ".",
        'trainer_config.ckpt_dir="models"',
        f'trainer_config.run_name="{run_name("centroid")}"',
        "++trainer_config.max_epochs=7",
    ]
    assert first.name == run_name("centroid") and first.priority == 5
    assert first.adapter == "sleap-train" and first.tags == ["sleap", "centroid"]
    assert first.model == "centroid" and first.mode == "train"
    assert first.outputs == [f"models/{run_name('centroid')}*"]
    assert first.checkpoint_dir == f"models/{run_name('centroid')}"  # resumed from it
    assert first.requirements.tools == ["sleap-nn"] and first.requirements.prefer_cuda
    assert first.inputs == [PACKAGE]
    assert run_path_of(first) == f"models/{run_name('centroid')}"


def test_the_run_folder_is_always_on_the_command_line(tmp_path: Path) -> None:
    """A config that names its run keeps it, and the job's command says it too: a track
    job finds the model from the training job alone."""
    cfg = config("bottomup") | {"trainer_config": {"ckpt_dir": "out", "run_name": "mine"}}
    line = b"CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=2 sleap train -c bottomup.yaml\n"
    files = {"bottomup.yaml": yaml.safe_dump(cfg).encode(), "train-script.sh": line}
    pkg = read_package(make_package(tmp_path / "p.zip", ("bottomup",), files=files))
    (spec,) = train_specs(pkg, PACKAGE, RequirementsModel())
    assert spec.command[-2:] == [
        '++trainer_config.ckpt_dir="out"',
        '++trainer_config.run_name="mine"',
    ]
    assert run_path_of(spec) == "out/mine" and spec.name == "mine"
    assert spec.checkpoint_dir == "out/mine"
    assert spec.env == {"OMP_NUM_THREADS": "2"}  # the worker pins the GPUs itself


def test_a_config_without_a_run_name_or_ckpt_dir_gets_them_added(tmp_path: Path) -> None:
    line = b"sleap-nn train --config-name bottomup.yaml trainer_config.max_epochs=2\n"
    path = make_package(tmp_path / "p.zip", ("bottomup",), files={"train-script.sh": line})
    (model,) = read_package(path).models
    assert model.ckpt_dir == "models" and model.run_name.endswith(".bottomup")
    (spec,) = train_specs(read_package(path), PACKAGE, RequirementsModel())
    assert spec.command[-2:] == [
        '++trainer_config.ckpt_dir="models"',
        f'++trainer_config.run_name="{model.run_name}"',
    ]
    assert run_path_of(spec) == f"models/{model.run_name}"
    assert read_package(path).models[0].run_name == model.run_name  # the same each time


def broken(tmp_path: Path, **kw: object) -> Path:
    return make_package(tmp_path / "p.zip", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "said"),
    [
        ({"skip": ("train-script.sh",)}, "p.zip: not a SLEAP training package"),
        ({"files": {"train-script.sh": b"echo hi\n"}}, "p.zip:train-script.sh: no train line"),
        ({"skip": ("centroid.yaml",)}, "line 1 names config centroid.yaml, which the package"),
        ({"skip": ("labels.pkg.slp",)}, "centroid.yaml: labels file labels.pkg.slp is not in"),
        ({"files": {"centroid.yaml": b"a: [1"}}, "p.zip:centroid.yaml: not YAML"),
        ({"files": {"centroid.yaml": b"- 1\n"}}, "centroid.yaml: not a sleap-nn config"),
        (
            {
                "files": {
                    "centroid.yaml": yaml.safe_dump(config("centroid", labels="/a/l.slp")).encode()
                }
            },
            "names /a/l.slp, a path on the machine that exported it",
        ),
        (
            {
                "files": {
                    "train-script.sh": b"sleap train -c centroid.yaml trainer_config.ckpt_dir=/x\n"
                }
            },
            "line 1: trainer_config.ckpt_dir '/x' is not inside the package",
        ),
        ({"folder": "a/b"}, "not a SLEAP training package"),  # two levels: not a shape we read
        (
            {
                "files": {
                    "train-script.sh": (
                        "sleap train -c centroid.yaml trainer_config.run_name=" + "r" * 201
                    ).encode()
                }
            },
            "trainer_config.run_name is over 200 characters",
        ),
        (
            {
                "files": {
                    "train-script.sh": b"sleap train -c centroid.yaml trainer_config.run_name=a/b"
                }
            },
            "trainer_config.run_name 'a/b' is not a folder name",
        ),
    ],
)
def test_a_package_gpufleet_cannot_run_is_refused_saying_what_and_where(
    tmp_path: Path, kw: dict[str, object], said: str
) -> None:
    with pytest.raises(PackageError, match=said):
        read_package(broken(tmp_path, **kw))


def test_a_file_that_is_not_a_zip_or_not_there_is_named(tmp_path: Path) -> None:
    (tmp_path / "p.zip").write_text("hello")
    with pytest.raises(PackageError, match=r"p.zip: not a zip file"):
        read_package(tmp_path / "p.zip")
    with pytest.raises(PackageError, match=r"nope.zip: no such file"):
        read_package(tmp_path / "nope.zip")


def test_run_folders_land_in_models_by_name_and_never_over_one(tmp_path: Path) -> None:
    tree = tmp_path / "artifact" / "models"
    for name in ("run.centroid", "run.centroid-1"):
        (tree / name / "viz").mkdir(parents=True)
        (tree / name / "best.ckpt").write_text(name)
        (tree / name / "training_config.yaml").write_text("x: 1")
        (tree / name / "viz" / "best.ckpt").write_text("not a run of its own")
    dest = tmp_path / "project" / "models"
    (dest / "run.centroid").mkdir(parents=True)  # from an earlier run: kept
    placed = place_models(tmp_path / "artifact", dest)
    assert [p.name for p in placed] == ["run.centroid-1", "run.centroid-1-1"]
    assert (dest / "run.centroid-1" / "best.ckpt").read_text() == "run.centroid"
    assert not any((dest / "run.centroid").iterdir())


def test_predictions_are_pointed_at_the_users_data(tmp_path: Path) -> None:
    out = tmp_path / "x.predictions.slp"
    videos = [
        {"backend": {"filename": "/work/j-1/labels.pkg.slp", "dataset": "video0/video"}},
        {"filename": "/work/j-1/v.mp4", "backend": {"filename": "/work/j-1/v.mp4"}},
    ]
    with h5py.File(out, "w") as f:
        f.create_dataset("videos_json", data=[json.dumps(v) for v in videos], maxshape=(None,))
    data = tmp_path / "mine" / "labels.pkg.slp"
    assert repoint(out, data) == 2
    with h5py.File(out, "r") as f:
        back = [json.loads(v) for v in f["videos_json"][()]]
    assert [v["backend"]["filename"] for v in back] == [str(data.resolve())] * 2
    assert back[0]["backend"]["dataset"] == "video0/video" and back[1]["filename"] == str(data)


def test_predictions_with_fixed_width_strings_are_pointed_whole(tmp_path: Path) -> None:
    """Older files keep videos_json as fixed-width strings; a longer path must not be cut."""
    out = tmp_path / "old.predictions.slp"
    video = json.dumps({"backend": {"filename": "a.slp"}}).encode()
    with h5py.File(out, "w") as f:
        f.create_dataset("videos_json", data=[video], dtype=f"S{len(video)}")
    data = tmp_path / ("deep/" * 20) / "labels.pkg.slp"
    assert repoint(out, data) == 1
    with h5py.File(out, "r") as f:
        (back,) = [json.loads(v) for v in f["videos_json"][()]]
    assert back["backend"]["filename"] == str(data.resolve())


def test_a_track_job_runs_sleap_nn_track_with_every_model_and_keeps_the_predictions() -> None:
    data = InputModel(kind="blob", ref="b" * 64, dest=".", label="labels.pkg.slp")
    job = InputModel(kind="job", ref="j-1", dest=".", label="job:j-1")
    models = [(job, "models/run.centroid"), (job, "models/run.centered_instance")]
    spec = track_spec(data, "labels.pkg.slp", models, RequirementsModel())
    assert spec.command == [
        "sleap-nn",
        "track",
        "--data_path",
        "labels.pkg.slp",
        "--model_paths",
        "models/run.centroid",
        "--model_paths",
        "models/run.centered_instance",
        "-o",
        "labels.pkg.slp.predictions.slp",
        "--gui",
    ]
    assert spec.inputs == [data, job]  # one job's artifact is fetched once
    assert spec.outputs == ["labels.pkg.slp.predictions.slp"] and spec.adapter == "sleap-track"
