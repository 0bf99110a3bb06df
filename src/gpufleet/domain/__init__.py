"""Pure domain: models, the job state machine, ids, manifest parsing. No I/O."""

from gpufleet.domain.lifecycle import Event, sources, transition
from gpufleet.domain.models import (
    ACTIVE,
    TERMINAL,
    Capability,
    DeclaredCapability,
    GpuInfo,
    HostPolicy,
    JobSpec,
    JobStatus,
    Requirements,
    Role,
    WorkerStatus,
)
from gpufleet.domain.retries import backoff_seconds

__all__ = [
    "ACTIVE",
    "TERMINAL",
    "Capability",
    "DeclaredCapability",
    "Event",
    "GpuInfo",
    "HostPolicy",
    "JobSpec",
    "JobStatus",
    "Requirements",
    "Role",
    "WorkerStatus",
    "backoff_seconds",
    "sources",
    "transition",
]
