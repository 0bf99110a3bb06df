"""Plain domain types: jobs, requirements, workers, capability, host policy.

These are frozen dataclasses with no I/O; the wire (pydantic) types in
:mod:`gpufleet.wire` convert to and from them at the edge.
"""

from __future__ import annotations

import os.path
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import PurePath
from typing import Any

MIB_PER_GIB = 1024


class JobStatus(StrEnum):
    PENDING = "pending"
    CLAIMED = "claimed"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def active(self) -> bool:
        return self in ACTIVE


TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
ACTIVE = frozenset({JobStatus.CLAIMED, JobStatus.RUNNING})


class WorkerStatus(StrEnum):
    CONNECTING = "connecting"
    IDLE = "idle"
    BUSY = "busy"
    DRAINING = "draining"
    OFFLINE = "offline"


class Role(StrEnum):
    """Token roles. Issue 2 uses admin and worker; operator and submitter come with pools."""

    ADMIN = "admin"
    OPERATOR = "operator"
    SUBMITTER = "submitter"
    WORKER = "worker"


@dataclass(frozen=True)
class Requirements:
    """Hard constraints (who *may* run a job) and the CUDA preference."""

    require_cuda: bool = False
    prefer_cuda: bool = False
    gpu_count: int = 0
    min_vram_gib: float = 0.0
    min_ram_gib: float = 0.0
    gpu_name: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    allowed_hosts: tuple[str, ...] = ()
    worker: str | None = None

    @property
    def gpus_wanted(self) -> int:
        """GPUs the job takes when it runs on a GPU (0: a CPU job)."""
        if self.gpu_count > 0:
            return self.gpu_count
        return 1 if (self.require_cuda or self.prefer_cuda) else 0

    @property
    def needs_gpu(self) -> bool:
        return self.require_cuda or self.gpu_count > 0


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


def covering_mount(path: str, mounts: Iterable[str]) -> str | None:
    """The mount in ``mounts`` that holds ``path``, if any. Both are normalized first, so
    a ``..`` cannot climb out of a mount (paths only: nothing is looked up on disk)."""
    target = PurePath(os.path.normpath(path))
    for mount in mounts:
        root = PurePath(os.path.normpath(mount))
        if target == root or root in target.parents:
            return mount
    return None
