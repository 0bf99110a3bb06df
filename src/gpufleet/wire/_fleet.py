"""Workers and the worker protocol: register, claim, heartbeat, output, finish."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, AwareDatetime, Field, model_validator

from gpufleet.domain import progress
from gpufleet.domain.models import (
    Capability,
    GpuInfo,
)
from gpufleet.wire._base import (
    INT32,
    Attempt,
    ErrorInfo,
    JobState,
    LeaseSecret,
    Name,
    PoolName,
    Strict,
    Wire,
    _no_nul,
)
from gpufleet.wire._environments import MOST_BUILT, EnvBuiltModel, EnvUsed
from gpufleet.wire._jobs import TOOL_PATTERN, HostOut, JobOut, JobSpecModel, StderrTail
from gpufleet.wire._kept import CheckpointOut, Restored
from gpufleet.wire._owner import OwnerStateModel

# ---- workers ----------------------------------------------------------------------------


class GpuModel(Strict):
    index: int = Field(ge=0, le=1024)
    name: str = Field(max_length=200)
    total_mib: int = Field(ge=0, le=2**40)
    free_mib: int = Field(ge=0, le=2**40)
    uuid: str = ""
    compute_capability: str = ""
    simulated: bool = False
    util_percent: int | None = Field(None, ge=0, le=100, description="GPU busy, percent")

    def to_domain(self) -> GpuInfo:
        return GpuInfo(**self.model_dump())

    @classmethod
    def from_domain(cls, g: GpuInfo) -> GpuModel:
        return cls(**g.__dict__)


#: A Python version as a worker reports it: 3.12.4, 3.13.0rc1.
PYTHON_VERSION = r"^[0-9][0-9a-z.+-]*$"


class CapabilityModel(Strict):
    hostname: str = Field(max_length=255)
    cores: int = Field(ge=0, le=1_000_000)
    ram_mib: int = Field(ge=0, le=2**40)
    disk_free_mib: int = Field(0, ge=0, le=2**50)
    os: str = ""
    python: str = ""
    gpus: list[GpuModel] = Field(default_factory=list)
    driver_version: str | None = None
    cuda_version: str | None = None
    torch_version: str | None = None
    git_commit: str | None = None
    gpus_simulated: bool = False
    mounts: list[Annotated[str, Field(max_length=4096), AfterValidator(_no_nul)]] = Field(
        default_factory=list, max_length=100, description="shared paths this worker can read"
    )
    tools: dict[
        Annotated[str, Field(pattern=TOOL_PATTERN)],
        Annotated[str, Field(max_length=100), AfterValidator(_no_nul)],
    ] = Field(
        default_factory=dict,
        max_length=20,
        description="commands on the worker's PATH that jobs may ask for, with their versions",
    )
    pythons: list[Annotated[str, Field(max_length=32, pattern=PYTHON_VERSION)]] = Field(
        default_factory=list,
        max_length=50,
        description="Python versions jobs' environments may ask for (uv finds them here)",
    )
    python_downloads: bool = Field(
        False, description="uv may download a Python the worker lacks (any version will do)"
    )

    def to_domain(self) -> Capability:
        data = self.model_dump(exclude={"gpus", "mounts", "pythons"})
        return Capability(
            **data,
            gpus=tuple(g.to_domain() for g in self.gpus),
            mounts=tuple(self.mounts),
            pythons=tuple(self.pythons),
        )

    @classmethod
    def from_domain(cls, c: Capability) -> CapabilityModel:
        data = {k: v for k, v in c.__dict__.items() if k != "gpus"}
        return cls(**data, gpus=[GpuModel.from_domain(g) for g in c.gpus])

    @classmethod
    def shown(cls, c: Capability, gpus: list[GpuModel] | None = None) -> CapabilityModel:
        """``c`` as the server sends it, not checked again (see :meth:`JobSpecModel.shown`)."""
        data = {k: v for k, v in c.__dict__.items() if k not in ("gpus", "mounts", "pythons")}
        listed = [GpuModel.model_construct(**g.__dict__) for g in c.gpus]
        return cls.model_construct(
            **data,
            gpus=listed if gpus is None else gpus,
            mounts=list(c.mounts),
            pythons=list(c.pythons),
        )


class WorkerRegister(Strict):
    name: Name
    labels: dict[str, str] = Field(default_factory=dict)
    capability: CapabilityModel
    cpu_slots: int = Field(1, ge=0, le=1024)
    pool: PoolName | None = Field(None, description="None: the token's pool ('default')")
    ephemeral: bool = False
    running: list[LeaseRef] = Field(default_factory=list)


WorkerState = Literal["connecting", "available", "reserved", "busy", "draining", "offline"]
WORKER_STATES = (
    "connecting: registered, not polling yet; available: a job could start on it now (a "
    "free GPU; on a machine without GPUs, a free CPU slot); reserved: nothing free, and a "
    "job is claimed but not started, or waits for it; busy: every slot runs a job; "
    "draining: finishes what it runs, takes nothing new; offline: no heartbeat for a "
    "lease, or it stopped"
)


class WorkerOut(Wire):
    id: str
    name: str
    status: WorkerState = Field(description=WORKER_STATES)
    pool: str
    labels: dict[str, str]
    fixed_labels: list[str] = Field(
        default_factory=list,
        description="labels its token fixes (tokens create --label): trustworthy, the "
        "worker cannot change them",
    )
    offline_since: datetime | None = Field(
        None, description="when it went offline (its last sign of life); None while online"
    )
    gpus: list[GpuModel]
    gpus_simulated: bool
    slots: dict[str, int]
    running: list[str]
    ephemeral: bool
    registered_at: datetime
    last_heartbeat: datetime | None
    capability: CapabilityModel
    lease_timeout: float | None = Field(
        None, description="The server's lease timeout; a worker heartbeats well within it."
    )
    host: HostOut | None = Field(
        None, description="the manifest's [hosts.NAME] declaration that applies to it, if any"
    )
    gpus_offered: list[GpuModel] | None = Field(
        None,
        description="the GPUs jobs may get, as its host declaration narrows them (cuda, "
        "gpus, vram_gib); None: every GPU in `gpus`",
    )
    environments: list[EnvBuiltModel] = Field(
        default_factory=list,
        description="the job environments in its cache, as its heartbeats last listed them",
    )
    owner: OwnerStateModel | None = Field(
        None, description="its owner policy as its last heartbeat said it; None: none"
    )


class SelectRequest(Strict):
    """The job a user is about to submit; the server lists the workers that could take it."""

    spec: JobSpecModel


class Candidate(Wire):
    worker: WorkerOut
    fits: bool = Field(description="could take the job now")
    reason: str | None = Field(description="why it cannot, when it cannot")
    free_gpu_mib: int = Field(description="GPU memory free now on GPUs no job holds")
    on_gpu: bool = Field(
        False, description="the job would run on the worker's GPUs there, not in a CPU slot"
    )
    gpus: list[int] = Field(
        default_factory=list, description="the GPUs the job would get now (none: a CPU slot)"
    )
    assigned_free_mib: int | None = Field(
        None,
        description="free memory of the GPU the job would get now (of several, the least); "
        "None when it would not get a GPU now",
    )
    ever: bool = Field(
        True,
        description="could take the job once free: what stops it now, if anything, is its "
        "load, not a constraint it fails",
    )


_JobRef = Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_no_nul)]


class LeaseRef(Strict):
    job_id: _JobRef
    attempt: Attempt
    gpu_mib: int | None = Field(
        None, ge=0, le=2**40, description="GPU memory the job's processes use now (NVML)"
    )


class FreeGpuModel(Strict):
    index: int = Field(ge=0, le=1024)
    free_mib: int = Field(ge=0, le=2**40)


class ClaimRequest(Strict):
    cpu_slots: int = Field(0, ge=0, le=1024)
    gpus: list[FreeGpuModel] = Field(default_factory=list)
    wait: float = Field(25.0, ge=0, le=60)
    supersede: bool = Field(
        False,
        description="this poll replaces one the worker has open (a slot freed): end that "
        "one, on whichever server replica holds it",
    )
    most: int = Field(
        1,
        ge=1,
        le=64,
        description="claim up to this many jobs in one answer (the first is the lease, "
        "the rest in its `more`), as the free slots allow: a worker with several free "
        "slots fills them in one round trip",
        # left out when 1, so a server from before `most` takes the poll
        exclude_if=lambda most: most == 1,
    )


class StagedInput(Wire):
    """An input as the worker fetches it: a blob to unpack (a package, or a dependency's
    artifact) or a shared path to check and link. ``sha256`` None: a dependency that
    produced no artifact."""

    kind: Literal["blob", "job", "path"]
    dest: str
    sha256: str | None
    size: int | None = None
    path: str | None = None
    label: str = ""


class Lease(Wire):
    """A claim's answer: run ``spec`` on ``gpus``; every later write carries (job_id,
    attempt) and the attempt's ``secret``."""

    job_id: str
    attempt: int
    secret: str = Field(
        "",
        description="this attempt's own secret: every write for it (start, output, finish, "
        "release, artifact) must carry it; never given to the job",
    )
    spec: JobSpecModel
    gpus: list[int]
    lease_timeout: float
    inputs: list[StagedInput] = Field(default_factory=list)
    more: list[Lease] = Field(
        default_factory=list,
        description="further leases of the same poll, when the claim asked for `most` > 1",
    )
    checkpoint: CheckpointOut | None = Field(
        None,
        description="the job's latest checkpoint snapshot, to restore into its checkpoint "
        "folder before its command starts (None: it has none)",
        exclude_if=lambda c: c is None,
    )
    max_run_of: str | None = Field(
        None,
        description="the pool whose longest run (its max_run) is this attempt's timeout: "
        "`spec.timeout` is that limit, shorter than the job's own (None: the job's own)",
        exclude_if=lambda p: p is None,
    )


class HeartbeatRequest(Strict):
    leases: list[LeaseRef] = Field(default_factory=list)
    gpus: list[GpuModel] = Field(default_factory=list)
    draining: bool = False
    environments: list[EnvBuiltModel] | None = Field(
        None,
        max_length=MOST_BUILT,
        description="the job environments in the worker's cache now, all of them; None: "
        "unchanged since its last heartbeat",
        # left out when None, so a server from before environments takes the heartbeat
        exclude_if=lambda envs: envs is None,
    )
    pythons: list[Annotated[str, Field(max_length=32, pattern=PYTHON_VERSION)]] | None = Field(
        None,
        max_length=50,
        description="the Python versions jobs' environments may ask for, found after the "
        "worker registered (a search that can take seconds); None: unchanged",
        exclude_if=lambda pythons: pythons is None,
    )
    owner: OwnerStateModel | None = Field(
        None,
        description="its owner policy as it stands (why it takes no new jobs, the owner's "
        "GPUs); None: it runs under none",
        exclude_if=lambda owner: owner is None,  # a server from before owner policies
    )


class LeaseOrder(Wire):
    job_id: str
    attempt: int
    # "pause" and "preempt" both vacate the job (grace signal, checkpoint, handed back);
    # the server decides where it goes then (held, or back in the queue).
    order: Literal["continue", "cancel", "stop", "pause", "preempt"]
    grace: float | None = Field(
        None, description="stop: seconds after SIGINT before SIGTERM, then SIGKILL"
    )


class StopRequest(Strict):
    grace: float = Field(
        60.0,
        ge=0,
        le=7 * 86400,
        description="seconds the job has after SIGINT to finish and exit; then SIGTERM, "
        "and SIGKILL 3 s later",
    )


class HeartbeatResponse(Wire):
    """Per reported lease: keep running it, kill it (cancelled, or the lease is stale), or
    ask it to finish early (stop: SIGINT, then after ``grace`` SIGTERM and SIGKILL)."""

    orders: list[LeaseOrder]
    drain: bool = False
    drain_in: float | None = Field(
        None,
        description="with drain: seconds until the worker vacates its running jobs (grace "
        "signal, last checkpoint, back to the queue); None: they may finish",
        exclude_if=lambda left: left is None,
    )


class StartRequest(Strict):
    attempt: Attempt
    secret: LeaseSecret = None
    pid: int | None = Field(None, ge=0, le=INT32)
    started_at: AwareDatetime | None = Field(
        None,
        description="when the worker started the process, by its clock: the job's start "
        "time when it lies between the claim and this report's arrival, else the nearer "
        "of the two",
        # left out when None, so a server from before `started_at` takes the report
        exclude_if=lambda when: when is None,
    )
    environment: EnvUsed | None = Field(
        None,
        description="the Python environment the job runs in, when its spec names one",
        # left out when None, so a server from before environments takes the report
        exclude_if=lambda env: env is None,
    )
    restored: Restored | None = Field(
        None,
        description="the checkpoint snapshot restored before the job's command started",
        exclude_if=lambda r: r is None,
    )


#: How an output line that is not finished ends: a progress bar redrawn in place (with
#: carriage returns) is sent as its latest states while it runs, each ending with this,
#: then as its finished line (which never does).
BAR_END = "\r"


class LogLine(Strict):
    """One line of a job's output, or (stream ``progress``) one progress record: a JSON
    object with the known keys of :mod:`gpufleet.domain.progress` and numeric metrics.
    An output line ending with a carriage return (``BAR_END``) is a state of a progress
    bar the job still redraws: the line after it on its stream continues it."""

    stream: Literal["stdout", "stderr", "progress"] = "stdout"
    line: str = Field(max_length=1_000_000)

    @model_validator(mode="after")
    def _record(self) -> LogLine:
        if self.stream == "progress":
            try:
                self.line = progress.encode(progress.parse(self.line))
            except progress.BadProgress as exc:
                raise ValueError(f"a progress record: {exc}") from None
        return self


class LogAppend(Strict):
    attempt: Attempt
    secret: LeaseSecret = None
    lines: list[LogLine] = Field(max_length=100_000)
    first: int | None = Field(
        None,
        ge=0,
        le=2**62,
        description="how many of this attempt's lines the worker sent before this batch: "
        "a batch sent again (its answer lost) is not stored twice. None: after what is there",
    )


class FinishRequest(Strict):
    attempt: Attempt
    secret: LeaseSecret = None
    exit_code: int | None = Field(None, ge=-INT32 - 1, le=INT32)
    error: str | None = Field(None, max_length=100_000)
    stderr_tail: StderrTail = Field(
        default_factory=list, description="the last lines the job wrote to stderr"
    )
    failure: Literal["environment", "gpu_oom", "host_oom", "timeout"] | None = Field(
        None,
        description="the class of the failure, when it is not the job's exit: "
        "'environment', its environment could not be built (error: uv's words); "
        "'gpu_oom', out of GPU memory (the retry needs a bigger GPU); 'host_oom', killed by "
        "the kernel's OOM killer (the retry needs more RAM); 'timeout', it ran too long",
        # left out when None, so a server from before failure classes takes the report
        exclude_if=lambda failure: failure is None,
    )
    final: bool = Field(
        False,
        description="the failure would happen the same way on every worker (a requirement "
        "that does not exist): the job fails now, not retried",
        exclude_if=lambda final: not final,
    )

    @model_validator(mode="after")
    def _final_names_its_class(self) -> FinishRequest:
        if self.final and self.failure is None:
            raise ValueError("final: a final failure names its class (failure)")
        return self


#: The most reports one ``POST /v1/reports`` carries.
MOST_REPORTS = 64


class StartReport(StartRequest):
    """``POST /v1/jobs/{job_id}/start``'s body, with its job, in a batch of reports."""

    kind: Literal["start"]
    job_id: _JobRef


class FinishReport(FinishRequest):
    """``POST /v1/jobs/{job_id}/finish``'s body, with its job, in a batch of reports."""

    kind: Literal["finish"]
    job_id: _JobRef


class ReportBatch(Strict):
    """A worker's start and finish reports, applied in order, each as its own call would
    be: one call for what would have been several while one was on its way."""

    reports: list[Annotated[StartReport | FinishReport, Field(discriminator="kind")]] = Field(
        min_length=1, max_length=MOST_REPORTS
    )


class ReportResult(Wire):
    """How one report went: the status its own call would have answered, a finish's job,
    or the error."""

    job_id: str
    status: int
    job: JobOut | None = None
    error: ErrorInfo | None = None


class ReportResults(Wire):
    results: list[ReportResult]


class LeaveRequest(Strict):
    reason: str = Field("stopped", max_length=1000, description="why the worker stops")


class ReleaseRequest(Strict):
    attempt: Attempt
    secret: LeaseSecret = None
    reason: str = Field("worker drained", max_length=10_000)
    cause: Literal["owner"] | None = Field(
        None,
        description='"owner": vacated for the workstation\'s owner (not counted as a loss); '
        "None: drained",
        exclude_if=lambda cause: cause is None,
    )


class LogEntry(Wire):
    seq: int
    attempt: int
    stream: str
    line: str
    ts: datetime


class LogsOut(Wire):
    job_id: str
    status: JobState
    lines: list[LogEntry]
    next: int
    more: bool = Field(
        False,
        description="the page stopped at its limit or its byte budget (a few MiB of lines): "
        "more records may follow; read on from next",
    )


class EventOut(Wire):
    """One record of a job's event log: ``state`` (a status change: ``status``,
    ``event``, ``by``, ``why``), ``progress`` (``record``) or ``log`` (``stream``,
    ``line``); each with ``seq``, ``attempt`` and ``ts`` (seconds since the epoch)."""

    seq: int
    type: Literal["state", "progress", "log"]
    data: dict[str, object]


class EventsOut(Wire):
    job_id: str
    status: JobState
    events: list[EventOut]
    next: int = Field(description="pass as ?after= to read on")
    more: bool = Field(
        False,
        description="the page stopped at its limit or its byte budget (a few MiB of lines): "
        "more records may follow; read on from next",
    )


class WhyWorker(Wire):
    worker_id: str
    name: str
    status: WorkerState
    reason: str | None = Field(description="every reason, joined with '; ' (None: it may)")
    reasons: list[str] = Field(
        default_factory=list, description="each constraint that keeps it from the job"
    )
    host: HostOut | None = Field(
        None, description="the manifest's [hosts.NAME] declaration that applies to it, if any"
    )
    environment_built: bool | None = Field(
        None,
        description="whether the worker has the job's environment built (None: the job "
        "names none); between workers that fit equally well, one that has it runs the job",
    )


class WhyOut(Wire):
    job_id: str
    status: JobState
    summary: str
    workers: list[WhyWorker]
    position: int | None = Field(
        None,
        description="a pending job's place in its queue (1: next) among the jobs the "
        "workers that could run it could run too; None when over 1,000 jobs are ahead of "
        "it (only the first 1,000 are looked at: the summary says how many of those count)",
    )


class StatusOut(Wire):
    jobs: dict[str, int]
    workers: dict[str, int] = Field(description="workers by status: " + WORKER_STATES)
    gpus: int = Field(description="GPUs of the workers not offline")
    gpus_free: int = Field(description="of those, GPUs no job holds or waits for")
    cpu_slots: int = Field(description="CPU slots of the workers not offline")
    cpu_slots_free: int = Field(0, description="of those, CPU slots no job holds or waits for")
