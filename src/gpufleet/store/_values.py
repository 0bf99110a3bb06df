"""Column values both stores write: a new job's row."""

from __future__ import annotations

from typing import Any

from gpufleet.domain import lifecycle
from gpufleet.domain.models import JobSpec
from gpufleet.store.stored import spec_json


def job_values(
    job_id: str, spec: JobSpec, now: float, unrunnable: str | None, submitted_by: str | None
) -> dict[str, Any]:
    """The row of a job just submitted: where the lifecycle starts every job."""
    return {
        "submitted_by": submitted_by,
        "target": spec.requirements.worker,
        "id": job_id,
        "name": spec.name,
        "status": lifecycle.INITIAL.value,
        "spec": spec_json(spec),
        "priority": spec.priority,
        "pool": spec.pool,
        "manifest": spec.manifest,
        "model": spec.model,
        "attempts": 0,
        "max_attempts": spec.max_attempts,
        "lease": 0,
        "gpus": "[]",
        "created_at": now,
        "unrunnable": unrunnable,
    }
