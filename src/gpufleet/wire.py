"""The wire: pydantic models for every /v1 request and response, and the one error shape.

Both the server and the client import this module; nothing else is pydantic.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from gpufleet.domain.models import (
    Capability,
    DeclaredCapability,
    GpuInfo,
    HostPolicy,
    HyperStyle,
    InputKind,
    JobInput,
    JobSpec,
    JobStatus,
    Requirements,
    Role,
    WorkerStatus,
)


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    return value


def _relative(value: str) -> str:
    """A path inside the job directory: relative, no "..", no backslashes."""
    parts = value.replace("\\", "/").split("/")
    if value.startswith(("/", "\\")) or (len(value) > 1 and value[1] == ":"):
        raise ValueError("must be a path relative to the job directory")
    if ".." in parts or "\\" in value:
        raise ValueError('must stay inside the job directory (no ".." or backslashes)')
    return value


Name = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_no_nul)]
#: A pool: a named group of workers and the clients allowed to use them.
PoolName = Annotated[
    str,
    Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
        description="letters, digits, '.', '_' and '-', at most 63",
    ),
]
#: A blob id: the SHA-256 of its bytes, 64 lowercase hex digits.
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256, 64 hex digits")]
RelPath = Annotated[
    str, Field(min_length=1, max_length=1000), AfterValidator(_no_nul), AfterValidator(_relative)
]
#: Sizes: up to 1 PiB.
Size = Annotated[int, Field(ge=0, le=2**50)]
Label = Annotated[str, Field(max_length=200), AfterValidator(_no_nul)]
LabelKey = Annotated[str, Field(min_length=1, max_length=100), AfterValidator(_no_nul)]
# Integers that reach the database fit a 32-bit column on every backend.
INT32 = 2**31 - 1
Attempt = Annotated[int, Field(ge=1, le=INT32)]
JobState = Literal["pending", "claimed", "running", "succeeded", "failed", "cancelled"]


class Strict(BaseModel):
    """Unknown fields are errors: a misspelt ``require_cuda`` must never pass silently."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ErrorInfo(BaseModel):
    code: str
    message: str
    detail: Any = None


class ErrorBody(BaseModel):
    """Every error the server answers has this shape."""

    error: ErrorInfo


#: The error answers every route may give, for the OpenAPI description.
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in (
        (401, "missing, malformed, unknown or revoked token"),
        (403, "the token's role may not make this call"),
        (404, "unknown job, worker or token"),
        (409, "a stale lease, or a state that forbids the call"),
        (422, "a request the server cannot accept; detail lists each field"),
    )
}


# ---- jobs -------------------------------------------------------------------------------


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
        return Requirements(**{**data, "allowed_hosts": tuple(self.allowed_hosts)})

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

    def to_domain(self) -> JobSpec:
        data = self.model_dump(exclude={"requirements", "inputs", "outputs", "hyper_style"})
        return JobSpec(
            **{**data, "command": tuple(self.command), "pool": self.pool or "default"},
            requirements=self.requirements.to_domain(),
            inputs=tuple(i.to_domain() for i in self.inputs),
            outputs=tuple(self.outputs),
            hyper_style=HyperStyle(self.hyper_style),
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
        return cls.model_construct(
            **{
                **data,
                "command": list(s.command),
                "outputs": list(s.outputs),
                "hyper_style": s.hyper_style.value,
                "requirements": RequirementsModel.model_construct(
                    **{**r, "allowed_hosts": list(s.requirements.allowed_hosts)}
                ),
                "inputs": [
                    InputModel.model_construct(**{**asdict(i), "kind": i.kind.value})
                    for i in s.inputs
                ],
            }
        )


class ArtifactFile(BaseModel):
    path: str
    size: int


class ArtifactOut(BaseModel):
    """A job attempt's outputs, archived: a blob and what it holds."""

    job_id: str
    attempt: int
    sha256: str
    size: int = Field(description="archive bytes")
    files: list[ArtifactFile] = Field(description="the first files in the archive (at most 1000)")
    file_count: int
    bytes: int = Field(description="unpacked bytes")
    created_at: datetime


class ArtifactAttach(Strict):
    attempt: Attempt
    sha256: Sha256


class DependencyOut(BaseModel):
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


class AttemptOut(BaseModel):
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


class JobOut(BaseModel):
    id: str
    name: str
    status: JobState
    attempts: int
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


class JobDetail(JobOut):
    spec: JobSpecModel
    history: list[AttemptOut]
    unrunnable: str | None = None
    artifact: ArtifactOut | None = None
    depends_on: list[DependencyOut] = Field(default_factory=list)


class SubmitResult(BaseModel):
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


class ApplyResult(BaseModel):
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


# ---- workers ----------------------------------------------------------------------------


class GpuModel(Strict):
    index: int = Field(ge=0, le=1024)
    name: str = Field(max_length=200)
    total_mib: int = Field(ge=0, le=2**40)
    free_mib: int = Field(ge=0, le=2**40)
    uuid: str = ""
    compute_capability: str = ""
    simulated: bool = False

    def to_domain(self) -> GpuInfo:
        return GpuInfo(**self.model_dump())

    @classmethod
    def from_domain(cls, g: GpuInfo) -> GpuModel:
        return cls(**g.__dict__)


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

    def to_domain(self) -> Capability:
        data = self.model_dump(exclude={"gpus", "mounts"})
        return Capability(
            **data, gpus=tuple(g.to_domain() for g in self.gpus), mounts=tuple(self.mounts)
        )

    @classmethod
    def from_domain(cls, c: Capability) -> CapabilityModel:
        data = {k: v for k, v in c.__dict__.items() if k != "gpus"}
        return cls(**data, gpus=[GpuModel.from_domain(g) for g in c.gpus])

    @classmethod
    def shown(cls, c: Capability, gpus: list[GpuModel] | None = None) -> CapabilityModel:
        """``c`` as the server sends it, not checked again (see :meth:`JobSpecModel.shown`)."""
        data = {k: v for k, v in c.__dict__.items() if k not in ("gpus", "mounts")}
        listed = [GpuModel.model_construct(**g.__dict__) for g in c.gpus]
        return cls.model_construct(
            **data, gpus=listed if gpus is None else gpus, mounts=list(c.mounts)
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


class WorkerOut(BaseModel):
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


class SelectRequest(Strict):
    """The job a user is about to submit; the server lists the workers that could take it."""

    spec: JobSpecModel


class Candidate(BaseModel):
    worker: WorkerOut
    fits: bool = Field(description="could take the job now")
    reason: str | None = Field(description="why it cannot, when it cannot")
    free_gpu_mib: int = Field(description="GPU memory free now on GPUs no job holds")


class LeaseRef(Strict):
    job_id: Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_no_nul)]
    attempt: Attempt


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


class StagedInput(BaseModel):
    """An input as the worker fetches it: a blob to unpack (a package, or a dependency's
    artifact) or a shared path to check and link. ``sha256`` None: a dependency that
    produced no artifact."""

    kind: Literal["blob", "job", "path"]
    dest: str
    sha256: str | None
    size: int | None = None
    path: str | None = None
    label: str = ""


class Lease(BaseModel):
    """A claim's answer: run ``spec`` on ``gpus``; every later write carries (job_id, attempt)."""

    job_id: str
    attempt: int
    spec: JobSpecModel
    gpus: list[int]
    lease_timeout: float
    inputs: list[StagedInput] = Field(default_factory=list)


class HeartbeatRequest(Strict):
    leases: list[LeaseRef] = Field(default_factory=list)
    gpus: list[GpuModel] = Field(default_factory=list)
    draining: bool = False


class LeaseOrder(BaseModel):
    job_id: str
    attempt: int
    order: Literal["continue", "cancel", "stop"]
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


class HeartbeatResponse(BaseModel):
    """Per reported lease: keep running it, kill it (cancelled, or the lease is stale), or
    ask it to finish early (stop: SIGINT, then after ``grace`` SIGTERM and SIGKILL)."""

    orders: list[LeaseOrder]
    drain: bool = False


class StartRequest(Strict):
    attempt: Attempt
    pid: int | None = Field(None, ge=0, le=INT32)


class LogLine(Strict):
    stream: Literal["stdout", "stderr"] = "stdout"
    line: str = Field(max_length=1_000_000)


class LogAppend(Strict):
    attempt: Attempt
    lines: list[LogLine] = Field(max_length=100_000)


class FinishRequest(Strict):
    attempt: Attempt
    exit_code: int | None = Field(None, ge=-INT32 - 1, le=INT32)
    error: str | None = Field(None, max_length=100_000)
    stderr_tail: StderrTail = Field(
        default_factory=list, description="the last lines the job wrote to stderr"
    )


class LeaveRequest(Strict):
    reason: str = Field("stopped", max_length=1000, description="why the worker stops")


class ReleaseRequest(Strict):
    attempt: Attempt
    reason: str = Field("worker drained", max_length=10_000)


class LogEntry(BaseModel):
    seq: int
    attempt: int
    stream: str
    line: str
    ts: datetime


class LogsOut(BaseModel):
    job_id: str
    status: JobState
    lines: list[LogEntry]
    next: int


class WhyWorker(BaseModel):
    worker_id: str
    name: str
    status: WorkerState
    reason: str | None


class WhyOut(BaseModel):
    job_id: str
    status: JobState
    summary: str
    workers: list[WhyWorker]


class StatusOut(BaseModel):
    jobs: dict[str, int]
    workers: dict[str, int] = Field(description="workers by status: " + WORKER_STATES)
    gpus: int = Field(description="GPUs of the workers not offline")
    gpus_free: int = Field(description="of those, GPUs no job holds or waits for")
    cpu_slots: int = Field(description="CPU slots of the workers not offline")
    cpu_slots_free: int = Field(0, description="of those, CPU slots no job holds or waits for")


# ---- blobs ------------------------------------------------------------------------------


class BlobOut(BaseModel):
    sha256: str
    size: int
    created_at: datetime


class UploadCreate(Strict):
    sha256: Sha256
    size: Size


class UploadOut(BaseModel):
    """A resumable upload: send the bytes from ``offset`` on with PATCH."""

    id: str | None = Field(description="None when the server already had the blob")
    sha256: str
    size: int
    offset: int
    complete: bool
    receiving: bool = Field(
        default=False,
        description="a request is sending bytes to it now (perhaps one whose client is "
        "gone, until the server notices); wait before sending from offset",
    )


# ---- tokens -----------------------------------------------------------------------------


class TokenCreate(Strict):
    name: Name
    role: Literal["admin", "operator", "submitter", "worker"]
    pools: list[PoolName] = Field(
        default_factory=list,
        max_length=100,
        description="submitter: the pools it may use (default: ['default']); worker: its "
        "one pool; admin and operator tokens see every pool and take none",
    )
    expires_days: float | None = Field(None, gt=0, le=3650)
    labels: dict[LabelKey, Label] = Field(
        default_factory=dict,
        max_length=50,
        description="worker tokens: labels every worker enrolled with it carries, whatever "
        "the worker declares (a job asking for team=nlp can then trust it)",
    )

    @model_validator(mode="after")
    def _pools_fit(self) -> TokenCreate:
        if len(",".join(self.pools)) > 200:
            raise ValueError("pools: at most 200 characters in all, commas included")
        if self.labels and self.role != "worker":
            raise ValueError("labels: only a worker token fixes labels (its workers carry them)")
        if len(json.dumps(self.labels)) > 4000:
            raise ValueError("labels: at most 4000 characters in all")
        return self


class TokenOut(BaseModel):
    id: str
    name: str
    role: str
    pools: list[str] = Field(description="empty: every pool")
    hint: str = Field(description="the secret's first characters, to tell tokens apart")
    labels: dict[str, str] = Field(
        default_factory=dict, description="labels its workers carry (worker tokens)"
    )
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class WhoAmI(BaseModel):
    id: str
    name: str
    role: str
    pools: list[str] = Field(description="empty: every pool")


class AuditOut(BaseModel):
    """A call (method, path, status), or a lifecycle event the server decided itself
    (``event``: worker.registered, worker.offline, worker.removed, lease.lost)."""

    seq: int
    at: datetime
    token_id: str | None
    token_name: str | None
    role: str | None
    address: str
    method: str | None
    path: str | None
    status: int | None
    target: str | None
    event: str | None = None
    detail: str | None = None


class TokenCreated(TokenOut):
    token: str = Field(description="The secret. Shown once; only its hash is stored.")


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    database: str


WorkerRegister.model_rebuild()

__all__ = [
    "JobStatus",
    "Role",
    "WorkerStatus",
]
