"""An inference package: trained models and the data to run them on, in one zip, as
SLEAP's GUI exports it (``inference-script.sh``) or sleap-rtc's ``client-track`` makes it
(``track-script.sh``). Read and checked here; each track line becomes one track job.

    pkg = read_inference_package(Path("labels.v001.slp.inference_job.zip"))
    for run in pkg.runs:
        spec = track_spec(package, run.data, [(package, m) for m in run.models], req,
                          out=run.output, extra=run.args)

A script names the data by the path it had on the machine that exported it (SLEAP writes
absolute paths), and trained models it did not retrain by theirs: each is found in the
zip by its path, else by its name (``labels.v001.slp`` also as ``labels.v001.pkg.slp``,
the copy a package embeds its frames in). A zip with no track line is read by looking:
its run folders are the models, its one labels file or video the data.
"""

from __future__ import annotations

import posixpath
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from gpufleet.client.sleap import MARKERS, predictions_name, unused_path
from gpufleet.domain import sleap
from gpufleet.errors import PackageError

#: What a data file to track may be: a labels file or a video SLEAP reads.
DATA_SUFFIXES = (".slp", ".mp4", ".avi", ".mov", ".mkv", ".h5", ".hdf5", ".tif", ".tiff")


@dataclass(frozen=True)
class TrackRun:
    """One track job of a package: paths relative to the unpacked package."""

    data: str
    models: tuple[str, ...]
    output: str  # the predictions file's name
    args: tuple[str, ...]  # the line's other options (--batch_size 4, --tracking, ...)


@dataclass(frozen=True)
class InferencePackage:
    path: Path
    root: str  # the zip's folder that holds it ("" when at the root)
    runs: tuple[TrackRun, ...]


def is_zip(path: Path) -> bool:
    """Whether ``path`` is a zip file (what ``sleap track PACKAGE`` takes)."""
    return path.is_file() and zipfile.is_zipfile(path)


def read_inference_package(path: Path) -> InferencePackage:
    """Read and check an inference package. Raises :class:`PackageError` naming the file
    (and the script's line) when it is not one gpufleet can run."""
    try:
        with zipfile.ZipFile(path) as zf:
            files = {n for n in zf.namelist() if not n.endswith("/")}
            root = _root_of(files)
            inside = {n[len(root) + 1 :] if root else n for n in files}
            script = next((s for s in sleap.TRACK_SCRIPTS if s in inside), None)
            where = f"{path.name}:{root + '/' if root else ''}"
            lines = []
            if script is not None:
                text = zf.read(f"{root}/{script}" if root else script)
                lines = sleap.parse_track_script(text.decode("utf-8", "replace"), where + script)
    except FileNotFoundError:
        raise PackageError(f"{path}: no such file") from None
    except (zipfile.BadZipFile, RuntimeError, NotImplementedError, OSError) as exc:
        raise PackageError(f"{path}: not a zip file, or damaged ({exc})") from None
    folders = _run_folders(inside)
    runs = [_run(line, inside, folders, f"{where}{script}") for line in lines]
    if not runs:
        runs = [_found_run(inside, folders, path)]
    return InferencePackage(path, root, tuple(runs))


def _root_of(files: set[str]) -> str:
    """The zip's folder that holds the package: "" when a script or ``models/`` is at its
    root, else its one top folder."""
    tops = {n.split("/", 1)[0] for n in files}
    at_root = any(n in sleap.TRACK_SCRIPTS or n.startswith("models/") for n in files)
    if not at_root and len(tops) == 1 and all("/" in n for n in files):
        return next(iter(tops))
    return ""


def _run_folders(inside: set[str]) -> set[str]:
    """The folders that hold a trained model (a training config or a checkpoint)."""
    found = {posixpath.dirname(n) for n in inside if posixpath.basename(n) in MARKERS}
    return {f for f in found if f}


def _run(line: sleap.TrackLine, inside: set[str], folders: set[str], where: str) -> TrackRun:
    said = f"{where}, line {line.number}"
    if line.data is None:
        raise PackageError(f"{said}: names no data (--data_path)")
    if not line.models:
        raise PackageError(f"{said}: names no model (--model_paths)")
    data = _data_in(line.data, inside, said)
    models = tuple(_model_in(m, folders, said) for m in line.models)
    output = posixpath.basename(line.output or "") or predictions_name(data)
    if not output.endswith(".slp"):
        output = predictions_name(data)
    return TrackRun(data, models, output, line.args)


def _data_in(named: str, inside: set[str], said: str) -> str:
    normal = posixpath.normpath(named.replace("\\", "/"))
    if normal in inside:
        return normal
    base = posixpath.basename(normal)
    stem = base.removesuffix(".slp")
    for name in (base, f"{stem}.pkg.slp"):
        found = sorted(n for n in inside if posixpath.basename(n) == name)
        if found:
            return found[0]
    raise PackageError(f"{said}: names data {named}, which the package lacks")


def _model_in(named: str, folders: set[str], said: str) -> str:
    normal = posixpath.normpath(named.replace("\\", "/")).rstrip("/")
    if normal.endswith(sleap.CONFIG_SUFFIXES):  # a config names its run folder
        normal = posixpath.dirname(normal)
    if normal in folders:
        return normal
    base = posixpath.basename(normal)
    found = sorted(f for f in folders if posixpath.basename(f) == base)
    if found:
        return found[0]
    raise PackageError(
        f"{said}: names model {named}, which the package lacks (no training_config.yaml or "
        "best.ckpt in it); a training package trains first: gpufleet sleap train"
    )


def _found_run(inside: set[str], folders: set[str], path: Path) -> TrackRun:
    """A zip with no track line: its run folders and its one data file."""
    if not folders:
        raise PackageError(
            f"{path}: not an inference package (no {' or '.join(sleap.TRACK_SCRIPTS)} and no "
            "trained model folder); a training package trains with gpufleet sleap train"
        )
    data = sorted(
        n
        for n in inside
        if n.lower().endswith(DATA_SUFFIXES)
        and not any(n.startswith(f + "/") for f in folders)
        and not n.endswith(".predictions.slp")
    )
    if len(data) != 1:
        said = f"{len(data)} data files ({', '.join(data)})" if data else "no data file"
        raise PackageError(
            f"{path}: {said} and no track script to say which to track; add "
            "track-script.sh (sleap-nn track --data_path DATA --model_paths models/RUN)"
        )
    models = tuple(sorted(folders))
    return TrackRun(data[0], models, predictions_name(data[0]), ())


def extract_data(pkg: InferencePackage, run: TrackRun, where: Path) -> Path:
    """The run's data file, copied out of the package into ``where`` (beside its
    predictions, which point at it); a file already there of the same size is taken as
    it, another name is used when a different one is."""
    member = f"{pkg.root}/{run.data}" if pkg.root else run.data
    with zipfile.ZipFile(pkg.path) as zf:
        size = zf.getinfo(member).file_size
        name = posixpath.basename(run.data)
        target = where / name
        if target.is_file() and target.stat().st_size == size:
            return target
        stem, dot, suffix = name.rpartition(".")
        target = unused_path(where, stem, dot + suffix) if dot else unused_path(where, name)
        with zf.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target
