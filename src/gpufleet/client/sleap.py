"""SLEAP on the fleet, the client's part: read a training package, make its jobs, put the
trained models where SLEAP looks for them, and point predictions at the user's own data.

    pkg = read_package(Path("labels.slp.training_job.zip"))   # checked; PackageError says why
    specs = train_specs(pkg, package_input, requirements)     # one job per model
    ...
    place_models(unpacked_artifact, Path("project/models"))   # project/models/<run_name>/
    repoint(Path("x.predictions.slp"), Path("labels.pkg.slp"))

The package zip holds its files at the root (SLEAP 1.6's export) or in one folder (older
tools); both are read. PyYAML (configs) and h5py (predictions) come with
``pip install 'gpufleet[sleap]'``.
"""

from __future__ import annotations

import json
import posixpath
import shutil
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpufleet.domain import sleap
from gpufleet.domain.models import Adapter
from gpufleet.errors import GpufleetError, PackageError
from gpufleet.wire import InputModel, JobOut, JobSpecModel, RequirementsModel

DEFAULT_CKPT_DIR = "models"
MAX_RUN_NAME = 200  # a job's name
MARKERS = ("training_config.yaml", "training_config.json", "best.ckpt")  # a run folder has one


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:
        raise PackageError(
            "reading a SLEAP package needs PyYAML: pip install 'gpufleet[sleap]'"
        ) from None
    return yaml


@dataclass(frozen=True)
class SleapModel:
    """One model of a package: its train line and what the job needs to know."""

    line: sleap.TrainLine
    model_type: str
    ckpt_dir: str
    run_name: str
    epochs: int | None  # from the config (None: it does not say)
    added: tuple[str, ...]  # overrides gpufleet adds (a ckpt_dir or run_name it lacks)

    @property
    def run_path(self) -> str:
        """Where the run folder lands, relative to the job directory."""
        return posixpath.join(self.ckpt_dir, self.run_name)


@dataclass(frozen=True)
class SleapPackage:
    """A checked training package: where it is, the zip's folder that holds it, and its
    models in the order of its script."""

    path: Path
    root: str  # the zip's folder that holds the package ("" when at the root)
    models: tuple[SleapModel, ...]
    labels: tuple[str, ...]  # the labels files the configs train on


def read_package(path: Path) -> SleapPackage:
    """Read and check a SLEAP training package. Raises :class:`PackageError` naming the
    file (and the line or config) when it is not one gpufleet can run."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = {n.rstrip("/") for n in zf.namelist()}
            root = _root_of(path, names)
            inside = f"{path.name}:{root + '/' if root else ''}"
            script = zf.read(_join(root, sleap.SCRIPT)).decode("utf-8", "replace")
            lines = sleap.parse_train_script(script, f"{inside}{sleap.SCRIPT}")
            pairs = [_model(zf, names, root, inside, line) for line in lines]
    except FileNotFoundError:
        raise PackageError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise PackageError(f"{path}: a folder; give the exported .zip") from None
    except (zipfile.BadZipFile, RuntimeError, NotImplementedError, OSError) as exc:
        # not a zip, a damaged one (bad CRC), an encrypted one, an unknown compression
        raise PackageError(f"{path}: not a zip file SLEAP exported, or damaged ({exc})") from None
    labels = sorted({label for _, used in pairs for label in used})
    return SleapPackage(path, root, tuple(m for m, _ in pairs), tuple(labels))


def _root_of(path: Path, names: set[str]) -> str:
    if sleap.SCRIPT in names:
        return ""
    tops = {n.split("/", 1)[0] for n in names}
    if len(tops) == 1 and f"{next(iter(tops))}/{sleap.SCRIPT}" in names:
        return next(iter(tops))
    raise PackageError(
        f"{path}: not a SLEAP training package (no {sleap.SCRIPT} at its root or in its one "
        "folder); export one from SLEAP with File > Export Training Job Package"
    )


def _join(root: str, name: str) -> str:
    return f"{root}/{name}" if root else name


def _model(
    zf: zipfile.ZipFile, names: set[str], root: str, inside: str, line: sleap.TrainLine
) -> tuple[SleapModel, tuple[str, ...]]:
    where = f"{inside}{sleap.SCRIPT}, line {line.number}"
    if _join(root, line.config) not in names:
        raise PackageError(f"{where} names config {line.config}, which the package lacks")
    config = f"{inside}{line.config}"
    facts = sleap.config_facts(_load_yaml(zf.read(_join(root, line.config)), config), config)
    if not facts.train_labels:
        raise PackageError(f"{config}: names no labels (data_config.train_labels_path)")
    labels = facts.train_labels + facts.val_labels
    for label in labels:
        _check_labels(label, names, root, config)
    model_type = sleap.model_type_of(line.config, facts)
    ckpt_dir = line.value(sleap.CKPT_DIR) or facts.ckpt_dir or DEFAULT_CKPT_DIR
    sleap.inside_package(ckpt_dir, f"{where}: {sleap.CKPT_DIR} {ckpt_dir!r}")
    run_name = line.value(sleap.RUN_NAME) or facts.run_name or _run_name(zf, model_type)
    _check_run_name(run_name, where)
    # Set on the command line even when the config has them: the job's run folder is
    # then known from the job alone (a track job finds the model by it).
    added = [
        f"++{key}={sleap.hydra_quoted(value)}"
        for key, value in ((sleap.CKPT_DIR, ckpt_dir), (sleap.RUN_NAME, run_name))
        if line.value(key) is None
    ]
    model = SleapModel(line, model_type, ckpt_dir, run_name, facts.max_epochs, tuple(added))
    return model, labels


def _load_yaml(text: bytes, config: str) -> Any:
    yaml = _yaml()
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PackageError(f"{config}: not YAML ({exc})") from None


def _check_labels(label: str, names: set[str], root: str, config: str) -> None:
    if posixpath.isabs(label):
        raise PackageError(
            f"{config}: data_config names {label}, a path on the machine that exported it; "
            "export the package with the labels inside it"
        )
    if _join(root, posixpath.normpath(label)) not in names:
        raise PackageError(f"{config}: labels file {label} is not in the package")


def _check_run_name(run_name: str, where: str) -> None:
    """A run name is a folder name and the job's name (at most 200 characters)."""
    if "/" in run_name or run_name in (".", "..") or "\0" in run_name:
        raise PackageError(f"{where}: {sleap.RUN_NAME} {run_name!r} is not a folder name")
    if len(run_name) > MAX_RUN_NAME:
        raise PackageError(f"{where}: {sleap.RUN_NAME} is over {MAX_RUN_NAME} characters")


def _run_name(zf: zipfile.ZipFile, model_type: str) -> str:
    """A run name for a config that sets none: the package's newest entry's time (so the
    same package gives the same name) and the model type, as SLEAP names its runs."""
    newest = max((info.date_time for info in zf.infolist()), default=(1980, 1, 1, 0, 0, 0))
    try:
        stamp = datetime(*newest, tzinfo=UTC).strftime("%y%m%d_%H%M%S")
    except ValueError:  # a zip entry with an impossible date
        stamp = "000000_000000"
    return f"{stamp}.{model_type}"


def with_tool(requirements: RequirementsModel) -> RequirementsModel:
    """``requirements`` and sleap-nn on the worker's PATH."""
    return requirements.model_copy(update={"tools": sorted({*requirements.tools, sleap.TOOL})})


def train_specs(
    pkg: SleapPackage,
    package: InputModel | list[InputModel],
    requirements: RequirementsModel,
    epochs: int | None = None,
    **common: Any,
) -> list[JobSpecModel]:
    """One job per model: ``sleap-nn train`` with the line's own arguments (and an
    ``--epochs`` override), run in the unpacked package (and beside the labels file it
    trains on, for :func:`read_labels_job`'s), keeping its run folder: as its outputs,
    and while it trains as its checkpoint folder, so a later attempt resumes from it."""
    needs = with_tool(requirements)
    inputs = package if isinstance(package, list) else [package]
    specs = []
    for m in pkg.models:
        args = [*m.line.args, *m.added]
        if epochs is not None:
            args = sleap.with_override(args, sleap.MAX_EPOCHS, str(epochs))
        specs.append(
            JobSpecModel(
                name=m.run_name,
                command=[sleap.TOOL, "train", *args],
                # what the line sets before its command, but the GPUs: the worker pins them
                env={k: v for k, v in m.line.env if k != "CUDA_VISIBLE_DEVICES"},
                requirements=needs,
                inputs=inputs,
                outputs=[f"{m.run_path}*"],
                checkpoint_dir=m.run_path,
                adapter=Adapter.SLEAP_TRAIN.value,
                tags=["sleap", m.model_type],
                model=m.model_type,
                mode="train",
                **common,
            )
        )
    return specs


def read_labels_job(
    labels: Path,
    configs: Sequence[Path],
    model_types: Sequence[str],
    into: Path,
    now: datetime | None = None,
) -> SleapPackage:
    """A training job for a plain labels file, as a package: one model for each config
    and each model type (sleap-nn's defaults, :func:`sleap.default_config`), its config
    written into the folder ``into`` training on ``labels`` alone. The run name is the
    config's, else the time and the model type (as sleap-nn names runs). Raises
    :class:`PackageError` naming the file and what is wrong; nothing is written then."""
    if not labels.is_file():
        raise PackageError(f"{labels}: no such file")
    if not configs and not model_types:
        raise PackageError(
            f"{labels}: a labels file trains with --config CONFIG.yaml or --model-type TYPE "
            "(or export a training package from SLEAP)"
        )
    parsed = [(c.stem, _read_config(c), str(c)) for c in configs]
    parsed += [(t, sleap.default_config(t), f"--model-type {t}") for t in model_types]
    stamp = (now or datetime.now()).strftime("%y%m%d_%H%M%S")
    written: list[tuple[str, dict[str, Any]]] = []
    models: list[SleapModel] = []
    for stem, raw, where in parsed:
        cfg = sleap.on_labels(raw, labels.name, where)
        facts = sleap.config_facts(cfg, where)
        model_type = sleap.model_type_of(stem, facts)
        name = _unused({n for n, _ in written}, stem, ".yaml")
        ckpt_dir = sleap.inside_package(
            facts.ckpt_dir or DEFAULT_CKPT_DIR, f"{where}: {sleap.CKPT_DIR} {facts.ckpt_dir!r}"
        )
        run_name = _unused({m.run_name for m in models}, facts.run_name or f"{stamp}.{model_type}")
        _check_run_name(run_name, where)
        line = sleap.TrainLine(0, ("--config-name", name, "--config-dir", "."), name)
        added = tuple(
            f"++{key}={sleap.hydra_quoted(value)}"
            for key, value in ((sleap.CKPT_DIR, ckpt_dir), (sleap.RUN_NAME, run_name))
        )
        models.append(SleapModel(line, model_type, ckpt_dir, run_name, facts.max_epochs, added))
        written.append((name, cfg))
    yaml = _yaml()
    for name, cfg in written:  # all checked: now written
        (into / name).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return SleapPackage(into, "", tuple(models), (labels.name,))


def _read_config(path: Path) -> Any:
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise PackageError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise PackageError(f"--config {path}: cannot be read ({exc.strerror})") from None
    return _load_yaml(text, str(path))


def _unused(taken: set[str], stem: str, suffix: str = "") -> str:
    name, n = f"{stem}{suffix}", 0
    while name in taken:
        n += 1
        name = f"{stem}-{n}{suffix}"
    return name


def choose_trained(ref: str, named: Sequence[JobOut], pool: str | None) -> JobOut | None:
    """Of the jobs named ``ref`` (any order), the one ``--model job:NAME`` means: the
    newest that succeeded; else the one not yet ended (a track job waits for it). None
    when there is none. Raises :class:`GpufleetError` listing the candidates, with their
    ids and dates, when that is not one job: several pools hold the name (and ``pool``
    does not choose), several are still to end, or all of them failed."""
    found = [j for j in named if j.name == ref and (pool is None or j.pool == pool)]
    if not found:
        return None
    pools = sorted({j.pool for j in found})
    if len(pools) > 1:
        raise GpufleetError(
            f"--model job:{ref}: jobs of that name in pools {', '.join(pools)}; give --pool "
            f"or a job id:\n{_candidates(found)}"
        )
    newest = sorted(found, key=lambda j: j.created_at, reverse=True)
    done = [j for j in newest if j.status == "succeeded"]
    if done:
        return done[0]
    pending = [j for j in newest if j.status not in ("failed", "cancelled")]
    if len(pending) == 1:
        return pending[0]
    if pending:
        raise GpufleetError(
            f"--model job:{ref}: none has succeeded and {len(pending)} have not ended; give "
            f"a job id:\n{_candidates(pending)}"
        )
    raise GpufleetError(
        f"--model job:{ref}: every job of that name failed or was cancelled; requeue one "
        f"(gpufleet requeue ID) or give a trained model folder:\n{_candidates(newest)}"
    )


def _candidates(jobs: Sequence[JobOut]) -> str:
    rows = sorted(jobs, key=lambda j: j.created_at, reverse=True)
    return "\n".join(
        f"  {j.id}  {j.status:<9}  {j.created_at:%Y-%m-%d %H:%M:%S}  pool {j.pool}" for j in rows
    )


def run_path_of(spec: JobSpecModel) -> str | None:
    """Where a SLEAP training job's run folder lands (``models/RUN``), from its command."""
    if spec.adapter != Adapter.SLEAP_TRAIN.value:
        return None
    args = spec.command[2:]
    ckpt_dir = sleap.override_value(args, sleap.CKPT_DIR)
    run_name = sleap.override_value(args, sleap.RUN_NAME)
    if ckpt_dir is None or run_name is None:
        return None
    return posixpath.join(ckpt_dir, run_name)


def predictions_name(data: str) -> str:
    """The predictions file for ``data``, named as SLEAP names them."""
    return f"{posixpath.basename(data)}.predictions.slp"


def track_spec(
    data: InputModel,
    data_name: str,
    models: list[tuple[InputModel, str]],
    requirements: RequirementsModel,
    out: str | None = None,
    extra: Sequence[str] = (),
    **common: Any,
) -> JobSpecModel:
    """A job that runs ``sleap-nn track`` on ``data_name`` with the models (each an input
    and its path in the job directory) and ``extra`` options, and keeps the predictions
    file (``out``, by default named as SLEAP names them)."""
    needs = with_tool(requirements)
    out = out or predictions_name(data_name)
    command = [sleap.TOOL, "track", "--data_path", data_name]
    for _, path in models:
        command += ["--model_paths", path]
    inputs = [data, *(i for i, _ in models)]
    return JobSpecModel(
        name=f"track {data_name}",
        command=[*command, *extra, "-o", out, "--gui"],
        requirements=needs,
        inputs=list({(i.kind, i.ref, i.dest): i for i in inputs}.values()),
        outputs=[out],
        adapter=Adapter.SLEAP_TRACK.value,
        tags=["sleap", "track"],
        mode="track",
        **common,
    )


def run_folders(tree: Path) -> list[Path]:
    """The sleap-nn run folders under ``tree``: folders holding a training config or a
    checkpoint (found by looking: sleap-nn may have added ``-1`` to a name)."""
    found = {p.parent for marker in MARKERS for p in tree.rglob(marker) if p.is_file()}
    return sorted(f for f in found if not any(o != f and o in f.parents for o in found))


def place_models(tree: Path, models_dir: Path) -> list[Path]:
    """Move each run folder under ``tree`` to ``models_dir/<its name>``, where SLEAP's GUI
    and ``sleap-nn track`` look; a name already there gets ``-1``, ``-2`` (nothing is
    overwritten). Returns where each went."""
    placed = []
    models_dir.mkdir(parents=True, exist_ok=True)
    for folder in run_folders(tree):
        target = unused_path(models_dir, folder.name)
        shutil.move(str(folder), str(target))
        placed.append(target)
    return placed


def unused_path(folder: Path, stem: str, suffix: str = "") -> Path:
    """``folder/STEM SUFFIX``, or with ``-1``, ``-2``... after the stem when that is taken:
    what the user has is never overwritten."""
    target, n = folder / f"{stem}{suffix}", 0
    while target.exists():
        n += 1
        target = folder / f"{stem}-{n}{suffix}"
    return target


def repoint(predictions: Path, data: Path) -> int:
    """Point the videos a predictions file names at ``data`` (the user's own copy, by its
    absolute path), so it opens in SLEAP at once. Returns how many it changed."""
    try:
        import h5py
    except ImportError:
        raise PackageError(
            "pointing predictions at your data needs h5py: pip install 'gpufleet[sleap]'"
        ) from None
    target = str(data.expanduser().resolve())
    changed = 0
    with h5py.File(predictions, "r+") as f:
        if "videos_json" not in f:
            return 0
        old = f["videos_json"]
        entries = [json.loads(v) for v in old[()]]
        for video in entries:
            changed += _repoint_video(video, target)
        del f["videos_json"]
        # variable-length strings, as sleap-io writes them: a fixed width (older files)
        # would cut the longer path
        f.create_dataset(
            "videos_json",
            data=[json.dumps(v) for v in entries],
            dtype=h5py.string_dtype(),
            maxshape=(None,),
        )
    return changed


def _repoint_video(video: dict[str, Any], target: str) -> int:
    changed = 0
    backend = video.get("backend")
    if isinstance(backend, dict) and "filename" in backend:
        backend["filename"] = target
        changed = 1
    if "filename" in video:
        video["filename"] = target
        changed = 1
    return changed
