"""Pure scheduling: who may run a job, who runs it first, and why a job waits."""

from gpufleet.scheduling.matching import (
    Assignment,
    FreeGpu,
    FreeResources,
    JobView,
    WorkerView,
    assign,
    effective_gpus,
    ever_reason,
    explain,
    rank_key,
)

__all__ = [
    "Assignment",
    "FreeGpu",
    "FreeResources",
    "JobView",
    "WorkerView",
    "assign",
    "effective_gpus",
    "ever_reason",
    "explain",
    "rank_key",
]
