"""``gpufleet sleap train`` and ``gpufleet sleap track``: a SLEAP training package to the
best GPU of the fleet, and the trained models and predictions back where SLEAP wants them.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpufleet.cli._common import err, fields_signature, print_json, shown
from gpufleet.cli.data import package_input
from gpufleet.cli.environments import environment_model
from gpufleet.cli.sleap_watch import watch
from gpufleet.cli.submit import Placement
from gpufleet.client import Client
from gpufleet.domain import sleap
from gpufleet.domain.environments import EnvRequest
from gpufleet.errors import ConfigError, GpufleetError, NotFound
from gpufleet.terminal import visible
from gpufleet.wire import (
    EnvironmentModel,
    InputModel,
    JobDetail,
    JobOut,
    JobSpecModel,
    RequirementsModel,
)

if TYPE_CHECKING:
    from gpufleet.client.sleap import SleapPackage

sleap_app = typer.Typer(
    help="SLEAP pose estimation: train a package exported by SLEAP on the fleet, track "
    "with the trained models, get models and predictions back.",
    no_args_is_help=True,
)

_Opt = typer.Option
PackageArg = Annotated[
    Path,
    typer.Argument(
        help="The training package SLEAP exported (File > Export Training Job Package): "
        "LABELS.slp.training_job.zip; or a labels file (LABELS.slp) with --config or "
        "--model-type."
    ),
]
Config = Annotated[
    list[Path] | None,
    _Opt(
        "--config",
        help="With a labels file: train this sleap-nn config on it (its "
        "data_config.train_labels_path becomes the labels file; repeatable, a model each).",
    ),
]
ModelType = Annotated[
    list[str] | None,
    _Opt(
        "--model-type",
        help="With a labels file: train this model type with sleap-nn's defaults "
        "(single_instance, centroid, centered_instance, bottomup; repeatable, a model each).",
    ),
]
DownloadFailed = Annotated[
    bool,
    _Opt(
        "--download-failed",
        help="With --wait: download what a failed training left too (its run folder, "
        "best.ckpt of its best epoch so far) into models/RUN_NAME/.",
    ),
]
TrackPackage = Annotated[
    Path | None,
    typer.Argument(
        help="An inference package: a zip of trained model folders and the data to track "
        "(SLEAP's export, with inference-script.sh; sleap-rtc's, with track-script.sh). "
        "Instead of --data and --model. Another file is the data, as with --data."
    ),
]
Epochs = Annotated[
    int | None, _Opt(min=1, help="Train this many epochs (trainer_config.max_epochs).")
]
Wait = Annotated[
    bool,
    _Opt("--wait", help="Follow the jobs (epochs, loss, val loss) and download what they made."),
]
TrainOut = Annotated[
    Path | None,
    _Opt(
        "--output",
        "-o",
        help="With --wait: the folder that gets models/RUN_NAME/ (default: the package's "
        "folder, where SLEAP looks).",
    ),
]
ThenTrack = Annotated[
    Path | None,
    _Opt(
        help="Then run the trained models on this data (.slp or video): a track job that "
        "waits for the training jobs."
    ),
]
Data = Annotated[
    Path | None, _Opt("--data", help="Data to track: a labels file (.slp) or a video.")
]
Model = Annotated[
    list[str] | None,
    _Opt(
        "--model",
        help="A trained model: a run folder (models/RUN) or job:NAME_OR_ID of a `sleap "
        "train` job: by name, the newest that succeeded, else the one still to end "
        "(repeatable; top-down needs both of its models).",
    ),
]
TrackOut = Annotated[
    Path | None,
    _Opt(
        "--output",
        "-o",
        help="With --wait: the folder for the predictions file (default: the current folder).",
    ),
]


SleapNn = Annotated[
    str | None,
    _Opt(
        "--sleap-nn",
        metavar="VERSION",
        help="Run in an environment the worker builds with this sleap-nn version "
        "(sleap-nn[torch]==VERSION, with the torch build its GPU driver runs), not the "
        "sleap-nn on its PATH; built once per worker and kept.",
    ),
]


def register(app: typer.Typer) -> None:
    """Add ``gpufleet sleap train`` and ``gpufleet sleap track``."""
    sleap_app.command("train")(train)
    sleap_app.command("track")(track)
    app.add_typer(sleap_app, name="sleap")


@dataclass(kw_only=True)
class SleapChoice(Placement):
    """The options of both commands: where the jobs may run, and whether to wait."""

    wait: Wait = False
    sleap_nn: SleapNn = None
    # the environment its jobs run in, uploaded once (a tuple: not yet made)
    _env: Any = field(default=None, init=False, repr=False)

    def sleap_requirements(self) -> RequirementsModel:
        """A SLEAP job prefers a GPU (a CPU worker may take it after the grace window),
        unless ``--cpu``; and it runs only where sleap-nn is, unless its environment
        brings sleap-nn."""
        from gpufleet.client.sleap import with_tool

        req = self.requirements()
        req = req.model_copy(update={"prefer_cuda": req.prefer_cuda or not req.cpu_only})
        return req if self.brings_sleap() else with_tool(req)

    def brings_sleap(self) -> bool:
        """Whether the jobs' environment brings sleap-nn (--sleap-nn, or a --with or
        requirements file that names it), so no worker needs it on its PATH."""
        if self.sleap_nn is not None:
            return True
        named = list(self.with_ or ())
        if self.with_requirements is not None and self.with_requirements.is_file():
            named.append(self.with_requirements.read_text(encoding="utf-8", errors="replace"))
        return any(re.search(r"sleap[-_.]nn", text, re.IGNORECASE) for text in named)

    def env_request(self) -> EnvRequest | None:
        req = super().env_request()
        if self.sleap_nn is None:
            return req
        if not re.fullmatch(r"[0-9][0-9A-Za-z.+!-]{0,40}", self.sleap_nn):
            raise ConfigError(f"--sleap-nn {visible(self.sleap_nn)!r}: not a version (0.3.5)")
        wanted = f"sleap-nn[torch]=={self.sleap_nn}"
        base = req or EnvRequest()
        return replace(base, with_=(wanted, *base.with_))

    def jobs_environment(self, c: Client) -> EnvironmentModel | None:
        """The environment every job of this command runs in (None: the worker's own)."""
        if self._env is None:
            req = self.env_request()
            self._env = (environment_model(c, req) if req else None,)
        env: EnvironmentModel | None = self._env[0]
        return env

    def place(self, c: Client, name: str, command: list[str]) -> RequirementsModel:
        probe = JobSpecModel(
            name=name, command=command, requirements=self.sleap_requirements(), pool=self.pool
        )
        return self.placed(c, probe)

    def submit(self, c: Client, spec: JobSpecModel, queue: bool = False) -> JobOut:
        env = self.jobs_environment(c)
        if env is not None:
            requirements = spec.requirements
            if self.brings_sleap():  # no worker needs sleap-nn on its PATH
                tools = [t for t in requirements.tools if t != "sleap-nn"]
                requirements = requirements.model_copy(update={"tools": tools})
            spec = spec.model_copy(update={"environment": env, "requirements": requirements})
        result = c.submit(spec, queue=self.queue or queue)
        if result.warning:
            err.print(f"[yellow]warning:[/yellow] {shown(result.warning)}")
        if not self.as_json:
            err.print(f"job {shown(result.job.id)} queued: {shown(spec.name)}")
        return result.job


@dataclass(kw_only=True)
class TrainRequest(SleapChoice):
    package: PackageArg
    config: Config = None
    model_type: ModelType = None
    epochs: Epochs = None
    output: TrainOut = None
    then_track: ThenTrack = None
    download_failed: DownloadFailed = False
    # the folder a labels file's configs are written to, until the command ends
    _configs: Any = field(default=None, init=False, repr=False)

    def read(self) -> SleapPackage:
        """The package, or a plain labels file's job: checked before anything is sent."""
        from gpufleet.client.sleap import read_labels_job, read_package

        if self.package.suffix.lower() != ".slp":
            if self.config or self.model_type:
                raise GpufleetError(
                    f"{self.package}: --config and --model-type are for a labels file "
                    "(.slp); a training package has its own configs"
                )
            return read_package(self.package)
        self._configs = tempfile.TemporaryDirectory(prefix="gpufleet-sleap-")
        into = Path(self._configs.name)
        return read_labels_job(self.package, self.config or [], self.model_type or [], into)

    def inputs(self, c: Client, pkg: SleapPackage) -> list[InputModel]:
        """What the jobs run in: the package, unpacked (never a reference to the zip on a
        mount); for a labels file, its configs and the labels beside them."""
        package = package_input(
            c, pkg.path, ".", pool="", quiet=self.as_json, workers=[], root=pkg.root
        )
        if pkg.path == self.package:
            return [package]
        pool = self.mounts_pool(c, [str(self.package)])
        return [package, package_input(c, self.package.resolve(), None, pool, self.as_json)]

    def run(self) -> None:
        from gpufleet.client.sleap import train_specs

        pkg = self.read()
        if self.then_track is not None and not self.then_track.is_file():
            raise GpufleetError(f"--then-track {self.then_track}: no such file")
        with self.connect() as c:
            requirements = self.place(c, pkg.models[0].run_name, [sleap.TOOL, "train"])
            package = self.inputs(c, pkg)
            specs = train_specs(pkg, package, requirements, self.epochs, **self.queued())
            # the models after the first wait for a chosen worker the first keeps busy;
            # with --auto-select each is given a GPU of its own
            jobs = [
                self.submit(c, self.spread(c, spec, i), queue=i > 0) for i, spec in enumerate(specs)
            ]
            track = None
            if self.then_track is not None:
                trained = zip(jobs, pkg.models, strict=True)
                models = [(_job_input(j.id), m.run_path) for j, m in trained]
                # it waits for the training jobs, on the worker they keep busy
                track = _submit_track(self, c, self.then_track, models, requirements, True)
            if not self.wait:
                ids = [j.id for j in jobs] + ([track.id] if track else [])
                print_json({"jobs": ids}) if self.as_json else print("\n".join(ids))
                return
            statuses = watch(self.connect, [*jobs, *([track] if track else [])], self.as_json)
            where = self.output or self.package.resolve().parent
            kept = ("succeeded", "failed") if self.download_failed else ("succeeded",)
            done = [j for j in jobs if statuses[j.id] in kept]
            placed = [path for j in done for path in _models(c, j, where)]
            predictions: list[Path | None] = []
            if track is not None and self.then_track and statuses[track.id] == "succeeded":
                predictions = [_predictions(c, track, self.then_track, where)]
        _report(statuses, placed, predictions, self.as_json)

    def spread(self, c: Client, spec: JobSpecModel, i: int) -> JobSpecModel:
        """With --auto-select, each model after the first gets a GPU of its own: chosen
        once the earlier ones were submitted, which hold theirs; none free, it waits for
        the first that frees."""
        if not (self.auto_select and i):
            return spec
        probe = spec.model_copy(
            update={"requirements": spec.requirements.model_copy(update={"worker": None})}
        )
        return spec.model_copy(update={"requirements": self.placed(c, probe, wait=True)})


def _zip_named(path: Path) -> bool:
    return path.suffix.lower() == ".zip"


def _job_input(job_id: str) -> InputModel:
    return InputModel(kind="job", ref=job_id, dest=".", label=f"job:{job_id}")


@dataclass(kw_only=True)
class TrackRequest(SleapChoice):
    package: TrackPackage = None
    data: Data = None
    model: Model = None
    output: TrackOut = None

    def run(self) -> None:
        from gpufleet.client.sleap_inference import is_zip

        given = self.package
        if given is not None and self.data is None and not _zip_named(given) and not is_zip(given):
            self.data, self.package = given, None  # `sleap track video.mp4 --model M`
        if self.package is not None:
            return self.run_package(self.package)
        if self.data is None:
            raise GpufleetError("--data: give the data to track (or an inference package)")
        if not self.data.is_file():
            raise GpufleetError(f"--data {self.data}: no such file")
        if not self.model:
            raise GpufleetError("--model: give at least one trained model (a folder or job:NAME)")
        with self.connect() as c:
            models = [_model_input(self, c, item) for item in self.model]
            requirements = self.place(c, f"track {self.data.name}", [sleap.TOOL, "track"])
            job = _submit_track(self, c, self.data, models, requirements)
            if not self.wait:
                print_json({"jobs": [job.id]}) if self.as_json else print(job.id)
                return None
            statuses = watch(self.connect, [job], self.as_json)
            predictions = []
            if statuses[job.id] == "succeeded":
                predictions = [_predictions(c, job, self.data, self.output or Path.cwd())]
        _report(statuses, [], predictions, self.as_json)
        return None

    def run_package(self, path: Path) -> None:
        """An inference package: one track job per line of its script, in the unpacked
        package; with --wait, each predictions file beside the data taken out of it."""
        from gpufleet.client.sleap import track_spec
        from gpufleet.client.sleap_inference import extract_data, read_inference_package

        if self.data is not None or self.model:
            raise GpufleetError(
                f"{path}: an inference package names its data and models; leave out "
                "--data and --model"
            )
        pkg = read_inference_package(path)  # checked before anything is sent
        with self.connect() as c:
            requirements = self.place(c, f"track {pkg.runs[0].data}", [sleap.TOOL, "track"])
            package = package_input(
                c, path, ".", pool="", quiet=self.as_json, workers=[], root=pkg.root
            )
            jobs = []
            for run in pkg.runs:
                models = [(package, m) for m in run.models]
                spec = track_spec(
                    package, run.data, models, requirements, out=run.output, extra=run.args,
                    **self.queued(),
                )  # fmt: skip
                jobs.append(self.submit(c, spec))
            if not self.wait:
                ids = [j.id for j in jobs]
                print_json({"jobs": ids}) if self.as_json else print("\n".join(ids))
                return
            statuses = watch(self.connect, jobs, self.as_json)
            where = _made(self.output or Path.cwd())
            predictions = [
                _predictions(c, job, extract_data(pkg, run, where), where, run.output)
                for job, run in zip(jobs, pkg.runs, strict=True)
                if statuses[job.id] == "succeeded"
            ]
        _report(statuses, [], predictions, self.as_json)


def _model_input(req: SleapChoice, c: Client, item: str) -> tuple[InputModel, str]:
    """A ``--model``: a local run folder (uploaded as ``models/NAME``, or passed by
    reference when a worker mounts it) or a training job's run folder (its artifact)."""
    from gpufleet.client.sleap import MARKERS, run_path_of

    if item.startswith("job:"):
        job = _trained_job(c, item[4:], req.pool)
        path = run_path_of(job.spec)
        if path is None:
            raise GpufleetError(f"--model {item}: not a `gpufleet sleap train` job")
        if job.status in ("failed", "cancelled"):
            raise GpufleetError(f"--model {item}: that job {job.status}; requeue it first")
        return _job_input(job.id), path
    folder = Path(item)
    if not folder.is_dir():
        raise GpufleetError(f"--model {item}: no such folder (or give job:NAME)")
    if not any((folder / marker).is_file() for marker in MARKERS):
        raise GpufleetError(f"--model {item}: no {', '.join(MARKERS)} in it")
    dest = f"models/{folder.resolve().name}"
    pool = req.mounts_pool(c, [item])
    return package_input(c, folder.resolve(), dest, pool, req.as_json), dest


def _trained_job(c: Client, ref: str, pool: str | None) -> JobDetail:
    """``--model job:REF``'s job: REF a job id, or a name (the newest that succeeded)."""
    from gpufleet.client.sleap import choose_trained

    chosen = choose_trained(ref, c.jobs(limit=1000, name=ref), pool)
    try:
        return c.job(chosen.id if chosen else ref)
    except NotFound:
        raise GpufleetError(f"--model job:{ref}: no such job") from None


def _submit_track(
    req: SleapChoice,
    c: Client,
    data: Path,
    models: list[tuple[InputModel, str]],
    requirements: RequirementsModel,
    queue: bool = False,
) -> JobOut:
    from gpufleet.client.sleap import track_spec

    pool = req.mounts_pool(c, [str(data)])
    data_input = package_input(c, data.resolve(), None, pool, req.as_json)
    name = data.name if data_input.kind != "path" else data_input.dest
    spec = track_spec(data_input, name, models, requirements, **req.queued())
    return req.submit(c, spec, queue=queue)


def _download(c: Client, job: JobOut, into: Path) -> Path | None:
    from gpufleet.cli.data import fetch_results

    try:
        return fetch_results(c, job.id, into, quiet=True)
    except NotFound:
        err.print(f"{shown(job.name)}: left no artifact")
        return None


def _models(c: Client, job: JobOut, where: Path) -> list[Path]:
    from gpufleet.client.sleap import place_models

    with tempfile.TemporaryDirectory(prefix=".gpufleet-sleap-", dir=_made(where)) as tmp:
        unpacked = _download(c, job, Path(tmp) / "artifact")
        return place_models(unpacked, where / "models") if unpacked else []


def _predictions(
    c: Client, job: JobOut, data: Path, where: Path, name: str | None = None
) -> Path | None:
    """The predictions file (``name``, else named after ``data``), into ``where``,
    pointing at the user's ``data``."""
    from gpufleet.client.sleap import predictions_name, repoint, unused_path

    name = name or predictions_name(data.name)
    with tempfile.TemporaryDirectory(prefix=".gpufleet-sleap-", dir=_made(where)) as tmp:
        unpacked = _download(c, job, Path(tmp) / "artifact")
        # by name, not as a pattern: a track script's output name may hold [ or *
        files = unpacked.rglob("*") if unpacked else iter(())
        found = next((f for f in files if f.name == Path(name).name and f.is_file()), None)
        if found is None:
            err.print(f"{shown(job.name)}: no {shown(name)} in its artifact")
            return None
        repoint(found, data)
        target = unused_path(where, name.removesuffix(".slp"), ".slp")
        found.rename(target)
    return target


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _report(
    statuses: dict[str, str],
    placed: list[Path],
    predictions: list[Path | None],
    as_json: bool,
) -> None:
    got = [p for p in predictions if p is not None]
    if as_json:
        print_json(
            {
                "jobs": statuses,
                "models": [str(p) for p in placed],
                "predictions": str(got[0]) if len(got) == 1 else [str(p) for p in got] or None,
            }
        )
    else:
        for path in placed:
            err.print(f"model: {shown(str(path))}")
        for path in got:
            err.print(f"predictions: {shown(str(path))}")
    if any(s != "succeeded" for s in statuses.values()):
        raise typer.Exit(1)


def train(**asked: Any) -> None:
    """Train the models of a SLEAP training package, or of a labels file with a config,
    on the fleet.

    One job per model (top-down's two models may run at once on two GPUs). The package is
    checked here first and uploaded once (a re-run sends nothing). With --wait, follows
    the epochs and puts each trained model in OUTPUT/models/RUN_NAME/; a failed one says
    why, in sleap-nn's words."""
    TrainRequest(**asked).run()


def track(**asked: Any) -> None:
    """Run trained SLEAP models on data (sleap-nn track) on the fleet: --data and
    --model, or an inference package.

    With --wait, downloads the predictions file, pointed at your own copy of the data so
    it opens in SLEAP at once (of a package: the data taken out of it, beside them)."""
    TrackRequest(**asked).run()


train.__signature__ = fields_signature(TrainRequest)  # type: ignore[attr-defined]
track.__signature__ = fields_signature(TrackRequest)  # type: ignore[attr-defined]
