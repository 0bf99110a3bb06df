"""Plain domain types: jobs, requirements, workers, capability, host policy.

These are frozen dataclasses with no I/O; the wire (pydantic) types in
:mod:`gpufleet.wire` convert to and from them at the edge.
"""

from __future__ import annotations

import json
import os.path
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import PurePath
from typing import Any

from gpufleet.domain.checkpoints import GRACE_SECONDS, GRACE_SIGNAL
from gpufleet.domain.environments import EnvRequest, EnvSpec

MIB_PER_GIB = 1024


class JobStatus(StrEnum):
    PENDING = "pending"
    CLAIMED = "claimed"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PAUSED = "paused"  # held by `gpufleet pause` with its checkpoint, until resumed

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def active(self) -> bool:
        return self in ACTIVE


TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
ACTIVE = frozenset({JobStatus.CLAIMED, JobStatus.RUNNING})


class WorkerStatus(StrEnum):
    """One vocabulary for a worker's state, everywhere (API, CLI, docs, database).

    ``connecting`` (registered, no claim yet), ``available`` (a slot a job could take),
    ``reserved`` (no slot free, and a job is claimed or waits for it but has not started),
    ``busy`` (every slot runs a job), ``draining`` (finishing what it runs, taking nothing
    new), ``offline`` (no heartbeat for a lease, or it left). The database stores the
    lifecycle (connecting, available, busy, draining, offline); ``reserved`` is worked out
    from the jobs a worker holds."""

    CONNECTING = "connecting"
    AVAILABLE = "available"
    RESERVED = "reserved"
    BUSY = "busy"
    DRAINING = "draining"
    OFFLINE = "offline"


class Role(StrEnum):
    """Token roles. Issue 2 uses admin and worker; operator and submitter come with pools."""

    ADMIN = "admin"
    OPERATOR = "operator"
    SUBMITTER = "submitter"
    WORKER = "worker"


#: Words that make a worker label a GPU's (``gpu_type``, ``cuda_arch``, ``vram``): a job
#: asking for such a label asks for a GPU.
GPU_WORDS = ("gpu", "cuda", "vram")


def is_gpu_label(key: str) -> bool:
    """Whether a label key names a GPU property (only GPU machines would carry it)."""
    lowered = key.lower()
    return any(word in lowered for word in GPU_WORDS)


@dataclass(frozen=True)
class Requirements:
    """Hard constraints (who *may* run a job) and the CUDA preference.

    What implies a GPU (the job then runs only on one): ``require_cuda``, ``gpu_count`` >
    0, ``gpu_name``, a label whose key names a GPU (``gpu_type = "a100*"``), and aiming
    the job at a worker that has GPUs (``worker``), unless ``cpu_only``. ``min_vram_gib``
    alone does not: it applies when the job lands on a GPU. ``prefer_cuda`` takes a GPU
    that is free, else a CPU slot after the grace window."""

    require_cuda: bool = False
    prefer_cuda: bool = False
    gpu_count: int = 0
    min_vram_gib: float = 0.0
    min_ram_gib: float = 0.0
    gpu_name: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    allowed_hosts: tuple[str, ...] = ()
    worker: str | None = None
    cpu_only: bool = False
    tools: tuple[str, ...] = ()  # commands the worker must have on its PATH (sleap-nn)

    @property
    def gpus_wanted(self) -> int:
        """GPUs the job takes when it runs on GPUs."""
        return max(1, self.gpu_count)

    @property
    def gpu_constraints(self) -> tuple[str, ...]:
        """The fields that name a GPU; any one of them makes the job need a GPU."""
        named = [
            f
            for f, on in (
                ("require_cuda", self.require_cuda),
                ("gpu_count", self.gpu_count > 0),
                ("gpu_name", bool(self.gpu_name)),
            )
            if on
        ]
        return (*named, *(f"labels.{k}" for k in self.labels if is_gpu_label(k)))

    @property
    def needs_gpu(self) -> bool:
        return bool(self.gpu_constraints)

    def contradiction(self) -> str | None:
        """Why these requirements cannot hold together, or None."""
        if not self.cpu_only:
            return None
        gpu = [*self.gpu_constraints, *(["prefer_cuda"] if self.prefer_cuda else [])]
        if gpu:
            return (
                f"cpu_only (--cpu) keeps the job in a CPU slot, but {', '.join(gpu)} "
                "asks for a GPU; drop one of them"
            )
        return None


class InputKind(StrEnum):
    BLOB = "blob"  # a package uploaded to the server: unpacked into the job directory
    JOB = "job"  # another job's artifact: the job waits until that job has succeeded
    PATH = "path"  # a path on a shared mount the worker declared: linked, checked by hash
    LOCAL = "local"  # client side only: a local folder or zip still to be packaged


@dataclass(frozen=True)
class JobInput:
    """Something a job needs in its working directory before its command starts.

    ``ref`` is a blob's SHA-256, a job name or id, or an absolute path; ``dest`` is where it
    lands, relative to the job directory ("." is the directory itself). ``sha256`` is the
    content hash a path input is checked against."""

    kind: InputKind
    ref: str
    dest: str = "."
    sha256: str | None = None
    size: int | None = None
    label: str = ""


DEFAULT_OUTPUTS = ("outputs",)


class Adapter(StrEnum):
    """How a worker reads a job's own progress channel and asks it to stop early."""

    SLEAP_TRAIN = "sleap-train"  # sleap-nn train: its ZMQ progress and control sockets
    SLEAP_TRACK = "sleap-track"  # sleap-nn track --gui: JSON progress lines on stdout


class HyperStyle(StrEnum):
    """How ``hyper`` becomes flags. ``dash``: ``batch_size`` is ``--batch-size``, a true
    boolean is a bare flag and a false one is left out (what argparse scripts expect).
    ``verbatim``: ``--batch_size 1024 --use_amp true``, keys and values as written."""

    DASH = "dash"
    VERBATIM = "verbatim"


def hyper_flags(hyper: dict[str, Any], style: HyperStyle = HyperStyle.DASH) -> list[str]:
    """Hyperparameters as command-line flags, in the order given (see :class:`HyperStyle`).
    Lists and tables are passed as JSON."""
    out: list[str] = []
    for key, value in hyper.items():
        flag = "--" + (key.replace("_", "-") if style == HyperStyle.DASH else key)
        if isinstance(value, bool):
            if style == HyperStyle.DASH:
                out += [flag] if value else []
                continue
            text = "true" if value else "false"
        elif isinstance(value, str | int | float):
            text = str(value)
        else:
            text = json.dumps(value)
        out += [flag, text]
    return out


@dataclass(frozen=True)
class JobSpec:
    """What to run and where it may run. ``command`` is an argv list unless ``shell``."""

    name: str
    command: tuple[str, ...]
    hyper: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    requirements: Requirements = field(default_factory=Requirements)
    priority: int = 0
    max_attempts: int = 3
    timeout: float | None = None
    pool: str = "default"
    shell: bool = False
    manifest: str | None = None
    model: str | None = None
    mode: str | None = None
    vars: dict[str, Any] = field(default_factory=dict)
    inputs: tuple[JobInput, ...] = ()
    outputs: tuple[str, ...] = DEFAULT_OUTPUTS
    hyper_style: HyperStyle = HyperStyle.DASH
    # How the worker reads the job's own progress channel and asks it to stop early
    # (None: a plain process; see gpufleet.worker.adapters).
    adapter: str | None = None
    tags: tuple[str, ...] = ()  # words to find and group jobs by ("sleap", "centroid")
    # Exit codes after which a failed attempt is never tried again, and ones after which
    # it is, where the default would not (gpufleet.domain.retries.not_retried).
    no_retry_on: tuple[int, ...] = ()
    retry_on: tuple[int, ...] = ()
    # The Python environment its worker builds for it with uv; None: the worker's own.
    # An EnvRequest (local paths, as a manifest wrote it) only on the client's side.
    environment: EnvSpec | EnvRequest | None = None
    # The folder (relative to the job directory) its worker keeps on the server as
    # checkpoints, restored into every later attempt (gpufleet.domain.checkpoints).
    checkpoint_dir: str | None = None
    # What gpufleet sends it when it ends the job to free its slot (drain, pause, a
    # worker's SIGTERM), and the seconds it has to save before SIGKILL.
    grace_signal: str = GRACE_SIGNAL
    grace_period: float = GRACE_SECONDS
    # A waiting job of a higher priority may preempt it (grace signal, checkpoint, back
    # to the queue; gpufleet.domain.preemption), as it may any job of a preemptible pool.
    preemptible: bool = False

    @property
    def dependencies(self) -> tuple[str, ...]:
        """The jobs (names or ids) whose artifacts this job needs."""
        return tuple(i.ref for i in self.inputs if i.kind == InputKind.JOB)

    @property
    def shared_paths(self) -> tuple[str, ...]:
        """Paths on shared mounts the job reads in place: only a worker that declared a
        mount holding each of them may run it."""
        return tuple(i.ref for i in self.inputs if i.kind == InputKind.PATH)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_mib: int
    free_mib: int
    uuid: str = ""
    compute_capability: str = ""
    simulated: bool = False
    util_percent: int | None = None  # how busy it was lately (NVML), when known

    @property
    def total_gib(self) -> float:
        return self.total_mib / MIB_PER_GIB

    @property
    def free_gib(self) -> float:
        return self.free_mib / MIB_PER_GIB


@dataclass(frozen=True)
class Capability:
    """What a worker detected about its host (or was told to simulate)."""

    hostname: str
    cores: int
    ram_mib: int
    disk_free_mib: int = 0
    os: str = ""
    python: str = ""
    gpus: tuple[GpuInfo, ...] = ()
    driver_version: str | None = None
    cuda_version: str | None = None
    torch_version: str | None = None
    git_commit: str | None = None
    gpus_simulated: bool = False
    mounts: tuple[str, ...] = ()  # shared paths this worker can read (--mount)
    tools: dict[str, str] = field(default_factory=dict)  # command on PATH -> its version
    # Python versions its jobs' environments may ask for (uv finds them on the machine),
    # and whether uv may download one it lacks (then any version will do).
    pythons: tuple[str, ...] = ()
    python_downloads: bool = False


@dataclass(frozen=True)
class DeclaredCapability:
    """What a manifest's ``[hosts.NAME]`` says a host has; intersected with detection."""

    cuda: bool | None = None
    gpus: int | None = None
    vram_gib: float | None = None
    ram_gib: float | None = None


@dataclass(frozen=True)
class HostPolicy:
    """A manifest's ``[hosts.NAME]``: which models a host runs and how much it is preferred."""

    name: str
    priority: int = 0
    allow_jobs: tuple[str, ...] | None = None
    deny_jobs: tuple[str, ...] = ()
    description: str = ""
    declared: DeclaredCapability = field(default_factory=DeclaredCapability)

    def narrowing(self) -> tuple[str, ...]:
        """What this declaration takes from what its host would offer, each as the
        manifest key says it ("cuda=false", "gpus=1", "allow_jobs=mlp,gbt"); empty: it
        only sets a preference (priority) or a description."""
        d = self.declared
        said = [
            "cuda=false" if d.cuda is False else "",
            f"gpus={d.gpus}" if d.gpus is not None else "",
            f"vram_gib={d.vram_gib:g}" if d.vram_gib is not None else "",
            f"ram_gib={d.ram_gib:g}" if d.ram_gib is not None else "",
            f"allow_jobs={','.join(self.allow_jobs) or '(none)'}"
            if self.allow_jobs is not None
            else "",
            f"deny_jobs={','.join(self.deny_jobs)}" if self.deny_jobs else "",
        ]
        return tuple(s for s in said if s)

    def narrows_gpus(self) -> bool:
        """Whether it takes GPUs or GPU memory from its host (cuda, gpus, vram_gib)."""
        d = self.declared
        return d.cuda is False or d.gpus is not None or d.vram_gib is not None


def covering_mount(path: str, mounts: Iterable[str]) -> str | None:
    """The mount in ``mounts`` that holds ``path``, if any. Both are normalized first, so
    a ``..`` cannot climb out of a mount (paths only: nothing is looked up on disk)."""
    target = PurePath(os.path.normpath(path))
    for mount in mounts:
        root = PurePath(os.path.normpath(mount))
        if target == root or root in target.parents:
            return mount
    return None
