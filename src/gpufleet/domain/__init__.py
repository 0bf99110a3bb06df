"""Pure domain: models, the job state machine, ids, manifest parsing. No I/O."""

from gpufleet.domain.lifecycle import Event, backoff_seconds, sources, transition
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
