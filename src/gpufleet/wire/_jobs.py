"""Jobs and manifests: what is submitted, applied and shown."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator

from gpufleet.domain.checkpoints import GRACE_SECONDS, GRACE_SIGNAL, MOST_GRACE
from gpufleet.domain.environments import (
    MOST_WITH,
    PYTHON_PATTERN,
    EnvFile,
    EnvSpec,
    requirement_problem,
)
from gpufleet.domain.models import (
    DeclaredCapability,
    HostPolicy,
    HyperStyle,
    InputKind,
    JobInput,
    JobSpec,
    Requirements,
)
from gpufleet.domain.retries import MOST_EXIT_CODES, exit_codes_problem
from gpufleet.wire._base import (
    JobState,
    Label,
    Name,
    PoolName,
    RelPath,
    Sha256,
    Size,
    Strict,
    Wire,
    _no_nul,
)
from gpufleet.wire._environments import EnvUsed
from gpufleet.wire._kept import (
    ArtifactOut,
    CheckpointOut,
    Restored,
)
from gpufleet.wire._preemption import PreemptionOut

# ---- jobs -------------------------------------------------------------------------------

#: A command a job needs on the worker's PATH, and a job's tag: one plain word each.
TOOL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"
TAG_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:=+-]{0,63}$"


class RequirementsModel(Strict):
    require_cuda: bool = False
    prefer_cuda: bool = False
    gpu_count: int = Field(0, ge=0, le=64)
    min_vram_gib: float = Field(0.0, ge=0, le=1_000_000)
    min_ram_gib: float = Field(0.0, ge=0, le=1_000_000)
    gpu_name: str | None = Field(None, max_length=200)
    labels: dict[str, str] = Field(default_factory=dict)
    allowed_hosts: list[str] = Field(default_factory=list)
    worker: str | None = Field(None, max_length=200)
    cpu_only: bool = Field(
        False,
        description="run in a CPU slot even on a worker with GPUs (a job aimed at a GPU "
        "worker otherwise takes one of its GPUs)",
    )
    tools: list[Annotated[str, Field(pattern=TOOL_PATTERN)]] = Field(
        default_factory=list,
        max_length=20,
        description="commands the worker must have on its PATH (it reports them, with "
        "their versions, in its capability's tools)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> RequirementsModel:
        # Only cpu_only can contradict the rest; every stored job is parsed with this model,
        # so the common case costs one attribute read.
        problem = self.to_domain().contradiction() if self.cpu_only else None
        if problem:
            raise ValueError(problem)
        return self

    def to_domain(self) -> Requirements:
        data = self.model_dump()
        return Requirements(
            **{**data, "allowed_hosts": tuple(self.allowed_hosts), "tools": tuple(self.tools)}
        )

    @classmethod
    def from_domain(cls, r: Requirements) -> RequirementsModel:
        return cls.model_validate(asdict(r))


class InputModel(Strict):
    """A job input: a package blob, another job's artifact, or a path on a shared mount."""

    kind: Literal["blob", "job", "path"]
    ref: Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(_no_nul)]
    dest: RelPath = "."
    sha256: Sha256 | None = None
    size: Size | None = None
    label: Label = ""

    @model_validator(mode="after")
    def _check_ref(self) -> InputModel:
        if self.kind == "blob" and not _is_sha256(self.ref):
            raise ValueError("a blob input's ref must be its SHA-256 (64 hex digits)")
        if self.kind == "path" and not (self.ref.startswith("/") and self.sha256):
            raise ValueError("a path input needs an absolute path and its sha256")
        if self.kind == "job" and len(self.ref) > 200:
            raise ValueError("a job input's ref is a job name or id (at most 200 characters)")
        return self

    def to_domain(self) -> JobInput:
        kind = InputKind(self.kind)
        return JobInput(kind, self.ref, self.dest, self.sha256, self.size, self.label)


#: The files of an environment's spec, by the role each plays.
ENV_FILE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
#: The largest file of an environment's spec (a uv.lock of a big project is a few MB).
MOST_ENV_FILE = 16 << 20


class EnvFileModel(Strict):
    """A file of an environment's spec, uploaded as a blob."""

    name: Annotated[str, Field(pattern=ENV_FILE_NAME)]
    sha256: Sha256
    size: int = Field(ge=0, le=MOST_ENV_FILE)


def _requirement(value: str) -> str:
    problem = requirement_problem(value)
    if problem:
        raise ValueError(problem)
    return value.strip()


class EnvironmentModel(Strict):
    """The Python environment a job runs in, built by its worker with uv
    (docs/environments.md). Without one, a job runs in the worker's own environment."""

    model_config = ConfigDict(
        validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    requirements: EnvFileModel | None = Field(
        None, description="a requirements.txt (--with-requirements), its -r includes inlined"
    )
    project: EnvFileModel | None = Field(
        None, description="a pyproject.toml (--with-requirements pyproject.toml)"
    )
    lock: EnvFileModel | None = Field(
        None, description="the uv.lock beside the pyproject.toml, installed as it is"
    )
    with_: list[Annotated[str, AfterValidator(_requirement)]] = Field(
        default_factory=list,
        max_length=MOST_WITH,
        alias="with",
        description="requirement strings (--with), each one requirement",
    )
    python: Annotated[str, Field(pattern=PYTHON_PATTERN)] | None = Field(
        None, description="the Python version (3.12, 3.12.4); None: the worker's own"
    )
    upgrade: bool = Field(
        False, description="resolve afresh, not from the fleet's recorded lock (uv's --upgrade)"
    )

    @model_validator(mode="after")
    def _whole(self) -> EnvironmentModel:
        self._check_names()
        if self.lock is not None and self.project is None:
            raise ValueError("a uv.lock comes with its pyproject.toml (project)")
        if self.project is not None and self.requirements is not None:
            raise ValueError("name a pyproject.toml or a requirements.txt, not both")
        if self.project is not None and self.with_:
            raise ValueError(
                "--with adds to a requirements.txt, not to a project: add it to the "
                "pyproject.toml's dependencies (and uv lock)"
            )
        if self.requirements is None and self.project is None and not self.with_:
            raise ValueError(
                "an environment names a requirements.txt, a pyproject.toml or --with requirements"
            )
        return self

    def _check_names(self) -> None:
        """The worker writes the files side by side under their names, and uv finds a
        project's by theirs: a project is ``pyproject.toml``, its lock ``uv.lock``."""
        if self.project is not None and self.project.name != "pyproject.toml":
            raise ValueError(f"project: named {self.project.name!r}; it must be pyproject.toml")
        if self.lock is not None and self.lock.name != "uv.lock":
            raise ValueError(f"lock: named {self.lock.name!r}; it must be uv.lock")
        names = [f.name for f in (self.requirements, self.project, self.lock) if f is not None]
        if len(set(names)) != len(names):
            raise ValueError(f"the environment's files must have distinct names: {names}")

    def to_domain(self) -> EnvSpec:
        def f(m: EnvFileModel | None) -> EnvFile | None:
            return None if m is None else EnvFile(m.name, m.sha256, m.size)

        return EnvSpec(
            requirements=f(self.requirements),
            project=f(self.project),
            lock=f(self.lock),
            with_=tuple(self.with_),
            python=self.python,
            upgrade=self.upgrade,
        )

    @classmethod
    def from_domain(cls, e: EnvSpec) -> EnvironmentModel:
        return cls.model_validate(asdict(e))


def _is_sha256(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


class JobSpecModel(Strict):
    name: Name
    command: list[Annotated[str, Field(max_length=100_000), AfterValidator(_no_nul)]] = Field(
        min_length=1
    )
    hyper: dict[str, Any] = Field(default_factory=dict)
    env: dict[Label, Annotated[str, AfterValidator(_no_nul)]] = Field(default_factory=dict)
    requirements: RequirementsModel = Field(default_factory=RequirementsModel)
    priority: int = Field(0, ge=-1_000_000, le=1_000_000)
    max_attempts: int = Field(3, ge=1, le=100)
    timeout: float | None = Field(None, gt=0, le=10_000_000)
    pool: PoolName | None = Field(
        None, description="None: 'default', or the token's only pool when it has one"
    )
    shell: bool = False
    manifest: Name | None = None
    model: Label | None = None
    mode: Label | None = None
    vars: dict[str, Any] = Field(default_factory=dict)
    inputs: list[InputModel] = Field(default_factory=list, max_length=100)
    outputs: list[RelPath] = Field(
        default_factory=lambda: ["outputs"],
        max_length=100,
        description="globs relative to the job directory, archived as the job's artifact",
    )
    hyper_style: Literal["dash", "verbatim"] = Field(
        "dash",
        description="dash: batch_size=64 is --batch-size 64, true is a bare flag, false "
        "is left out; verbatim: --batch_size 64 --use_amp true",
    )
    adapter: Literal["sleap-train", "sleap-track"] | None = Field(
        None,
        description="how the worker reads the job's own progress and asks it to stop: "
        "sleap-train (sleap-nn's ZMQ channels), sleap-track (sleap-nn's --gui lines); "
        "None: a plain process",
    )
    tags: list[Annotated[str, Field(pattern=TAG_PATTERN)]] = Field(
        default_factory=list, max_length=20, description="words to find and group jobs by"
    )
    no_retry_on: list[int] = Field(
        default_factory=list,
        max_length=MOST_EXIT_CODES,
        description="exit codes after which a failed attempt is not tried again",
    )
    retry_on: list[int] = Field(
        default_factory=list,
        max_length=MOST_EXIT_CODES,
        description="exit codes after which a failed attempt is tried again (while attempts "
        "are left) where the default would not: 2, 126 and 127",
    )
    environment: EnvironmentModel | None = Field(
        None, description="the Python environment the worker builds for it with uv"
    )
    checkpoint_dir: RelPath | None = Field(
        None, description="a folder kept on the server as checkpoints, restored on a retry"
    )
    grace_signal: Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT"] = Field(
        GRACE_SIGNAL, description="sent when gpufleet ends the job to free its slot"
    )
    grace_period: float = Field(
        GRACE_SECONDS, ge=0, le=MOST_GRACE, description="seconds from it to SIGKILL"
    )
    preemptible: bool = Field(False, description="a higher-priority job may preempt it")

    @model_validator(mode="after")
    def _exit_codes(self) -> JobSpecModel:
        if self.retry_on or self.no_retry_on:
            problem = exit_codes_problem(self.retry_on, self.no_retry_on)
            if problem:
                raise ValueError(problem)
        return self

    def to_domain(self) -> JobSpec:
        lists = {"requirements", "inputs", "outputs", "hyper_style", "tags", "environment"}
        data = self.model_dump(exclude=lists | {"retry_on", "no_retry_on"})
        return JobSpec(
            **{**data, "command": tuple(self.command), "pool": self.pool or "default"},
            requirements=self.requirements.to_domain(),
            inputs=tuple(i.to_domain() for i in self.inputs),
            outputs=tuple(self.outputs),
            hyper_style=HyperStyle(self.hyper_style),
            tags=tuple(self.tags),
            retry_on=tuple(self.retry_on),
            no_retry_on=tuple(self.no_retry_on),
            environment=self.environment.to_domain() if self.environment else None,
        )

    @classmethod
    def from_domain(cls, s: JobSpec) -> JobSpecModel:
        return cls.model_validate(asdict(s))

    @classmethod
    def shown(cls, s: JobSpec) -> JobSpecModel:
        """``s`` as the server sends it, not checked again: what it kept is shown as it is,
        even past a limit the API has tightened since (the limits are for what comes in)."""
        data = asdict(s)
        r = data.pop("requirements")
        e = data.pop("environment")
        return cls.model_construct(
            **{
                **data,
                "command": list(s.command),
                "outputs": list(s.outputs),
                "hyper_style": s.hyper_style.value,
                "tags": list(s.tags),
                "retry_on": list(s.retry_on),
                "no_retry_on": list(s.no_retry_on),
                "requirements": RequirementsModel.model_construct(
                    **{
                        **r,
                        "allowed_hosts": list(s.requirements.allowed_hosts),
                        "tools": list(s.requirements.tools),
                    }
                ),
                "inputs": [
                    InputModel.model_construct(**{**asdict(i), "kind": i.kind.value})
                    for i in s.inputs
                ],
                "environment": _env_shown(e),
            }
        )


def _env_shown(e: dict[str, Any] | None) -> EnvironmentModel | None:
    if e is None:
        return None
    files = {
        k: EnvFileModel.model_construct(**e[k]) if e[k] else None
        for k in ("requirements", "project", "lock")
    }
    return EnvironmentModel.model_construct(**{**e, **files, "with_": list(e["with_"])})


class DependencyOut(Wire):
    job_id: str
    name: str
    status: JobState


#: How many of its last stderr lines a failed attempt keeps, and how long each may be.
STDERR_TAIL_LINES = 20
STDERR_TAIL_CHARS = 2000
StderrTail = Annotated[
    list[Annotated[str, Field(max_length=STDERR_TAIL_CHARS)]],
    Field(max_length=STDERR_TAIL_LINES),
]


class AttemptOut(Wire):
    attempt: int
    worker: str | None
    worker_id: str | None
    gpus: list[int]
    claimed_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    exit_code: int | None
    outcome: str | None
    error: str | None
    stderr_tail: list[str] = Field(
        default_factory=list, description="the attempt's last stderr lines, when it failed"
    )
    late_result: str | None = Field(
        None,
        description="a result its worker sent after the attempt had ended (its lease lost, "
        "or the job cancelled), which the server refused: what it said, and when",
    )
    output_dropped: int = Field(
        0,
        description="bytes of the attempt's output the server dropped: it passed its "
        "output quota (its log has a marker where each cut began)",
    )
    failure: str | None = Field(
        None,
        description="the class of its failure, when its worker named one ('environment': "
        "its environment could not be built)",
    )
    cause: str | None = Field(
        None,
        description="why it ended: the job's own (exit, timeout, gpu_oom, host_oom, "
        "environment) or its machine's (lost, drained, paused); machines' are not counted",
    )
    restored: Restored | None = Field(None, description="the snapshot restored before it")
    environment: EnvUsed | None = Field(
        None, description="the Python environment it ran in, as its worker reported it"
    )


class JobOut(Wire):
    id: str
    name: str
    status: JobState
    pool: str = Field("default", description="the pool it was submitted to")
    attempt: int = Field(
        0,
        description="the number of its latest attempt (0: never claimed), as in its history "
        "and the workers' logs; it counts on across requeues",
    )
    attempts: int = Field(
        description="attempts counted against max_attempts: a requeue gives a fresh budget "
        "(and the attempt number counts on)"
    )
    max_attempts: int
    priority: int
    worker: str | None
    worker_id: str | None
    gpus: list[int]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    exit_code: int | None
    error: str | None
    model: str | None = None
    manifest: str | None = None
    not_before: datetime | None = None
    waiting: int = Field(0, description="dependencies (job:NAME inputs) not yet succeeded")
    submitted_by: str | None = Field(
        None, description="id of the token that submitted it (None: from before owners)"
    )
    stderr_tail: list[str] = Field(
        default_factory=list,
        description=f"the last stderr lines (at most {STDERR_TAIL_LINES}) of the latest "
        "attempt, when it failed: what went wrong, in the job's own words",
    )
    stop_requested_at: datetime | None = Field(
        None, description="when `gpufleet stop` asked it to finish early"
    )
    stopped_early: bool = Field(
        False, description="it was asked to stop and exited 0: succeeded, with its outputs"
    )
    progress: dict[str, Any] | None = Field(
        None,
        description="the latest progress record the job reported (epoch, epochs, step, "
        "steps, progress, eta_s, message, metrics)",
    )
    metrics: dict[str, float | None] = Field(
        default_factory=dict, description="the last value the job reported of each metric"
    )
    gpu_mib: int | None = Field(
        None, description="GPU memory its processes used at its worker's last heartbeat (MiB)"
    )
    failure: str | None = Field(
        None,
        description="the class of its latest attempt's failure, when its worker named one "
        "('environment': its environment could not be built)",
    )
    losses: int = Field(0, description="attempts its machines lost (not counted as failures)")
    pause_requested_at: datetime | None = Field(None, description="when it was paused")
    raised: str | None = Field(None, description="why its memory requirement was raised")


class JobDetail(JobOut):
    spec: JobSpecModel
    history: list[AttemptOut]
    unrunnable: str | None = None
    artifact: ArtifactOut | None = None
    depends_on: list[DependencyOut] = Field(default_factory=list)
    checkpoints: list[CheckpointOut] = Field(
        default_factory=list, description="the snapshots of its checkpoint folder, newest first"
    )
    submitted_by_name: str | None = Field(
        None, description="the name of the token that submitted it (who submitted it)"
    )
    host: HostOut | None = Field(
        None,
        description="the [hosts.NAME] declaration of the worker it runs on (or, pending, "
        "is aimed at), when a manifest declared one",
    )
    preemption: PreemptionOut | None = Field(None, description="who preempted whom")


class SubmitResult(Wire):
    job: JobOut
    warning: str | None = None


# ---- manifests --------------------------------------------------------------------------


class DeclaredModel(Strict):
    cuda: bool | None = None
    gpus: int | None = Field(None, ge=0, le=64)
    vram_gib: float | None = Field(None, ge=0, le=1_000_000)
    ram_gib: float | None = Field(None, ge=0, le=1_000_000)


class HostModel(Strict):
    name: Name
    priority: int = Field(0, ge=-1_000_000, le=1_000_000)
    allow_jobs: list[str] | None = None
    deny_jobs: list[str] = Field(default_factory=list)
    description: str = ""
    declared: DeclaredModel = Field(default_factory=DeclaredModel)

    def to_domain(self) -> HostPolicy:
        d = self.declared
        return HostPolicy(
            name=self.name,
            priority=self.priority,
            allow_jobs=None if self.allow_jobs is None else tuple(self.allow_jobs),
            deny_jobs=tuple(self.deny_jobs),
            description=self.description,
            declared=DeclaredCapability(d.cuda, d.gpus, d.vram_gib, d.ram_gib),
        )

    @classmethod
    def from_domain(cls, h: HostPolicy) -> HostModel:
        d = h.declared
        return cls(
            name=h.name,
            priority=h.priority,
            allow_jobs=None if h.allow_jobs is None else list(h.allow_jobs),
            deny_jobs=list(h.deny_jobs),
            description=h.description,
            declared=DeclaredModel(
                cuda=d.cuda, gpus=d.gpus, vram_gib=d.vram_gib, ram_gib=d.ram_gib
            ),
        )


class ManifestApply(Strict):
    name: Name
    hosts: list[HostModel] = Field(default_factory=list)
    jobs: list[JobSpecModel] = Field(default_factory=list)
    file: Annotated[str, Field(max_length=4096), AfterValidator(_no_nul)] | None = Field(
        None,
        description="the manifest's file as the applying client named it; shown beside "
        "its hosts entries (gpufleet hosts)",
    )


class HostOut(Wire):
    """A ``[hosts.NAME]`` declaration as the server applies it, and where it came from."""

    name: str = Field(description="the host: the worker of that --name it applies to")
    manifest: str = Field(description="the manifest (its name) that declared it")
    file: str | None = Field(
        None, description="that manifest's file, as the client that applied it named it"
    )
    applied_at: datetime
    applied_by: str | None = Field(None, description="the name of the token that applied it")
    narrows: list[str] = Field(
        default_factory=list,
        description="what it takes from what the worker would offer, as manifest keys "
        "(cuda=false, gpus=1, vram_gib=12, ram_gib=8, allow_jobs=..., deny_jobs=...)",
    )
    policy: HostModel


class ApplyResult(Wire):
    manifest: str
    created: list[str]
    updated: list[str] = Field(
        default_factory=list,
        description="pending jobs whose priority, requirements or limits the manifest changed",
    )
    unchanged: list[str]
    absent: list[str] = Field(
        default_factory=list,
        description="jobs of this manifest the plan no longer has; they stay (finished, or "
        "queued until cancelled)",
    )
    hosts: list[str]
    unknown_hosts: list[str] = Field(
        default_factory=list, description="[hosts.NAME] entries no registered worker is named"
    )
    unrunnable: dict[str, str] = Field(default_factory=dict)


JobDetail.model_rebuild()  # its ``host`` is declared below it
