"""Job, worker and token ids. Manifest job ids are a stable hash of identity fields."""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from gpufleet.domain.models import HyperStyle, JobSpec


def new_job_id() -> str:
    return "j-" + secrets.token_hex(8)


def new_worker_id() -> str:
    return "w-" + secrets.token_hex(6)


def identity(spec: JobSpec) -> dict[str, Any]:
    """The fields that make a manifest job *the same job* when a manifest is re-applied.
    The hyper style changes the command line, so it counts too (only when not the default,
    so ids made before it existed stay the same)."""
    style = {} if spec.hyper_style == HyperStyle.DASH else {"hyper_style": spec.hyper_style.value}
    return {
        **style,
        "manifest": spec.manifest,
        "name": spec.name,
        "model": spec.model,
        "mode": spec.mode,
        "vars": spec.vars,
        "command": list(spec.command),
        "shell": spec.shell,
        "hyper": spec.hyper,
    }


def manifest_job_id(spec: JobSpec) -> str:
    """A stable id: same identity, same id, on any machine and in any process."""
    blob = json.dumps(identity(spec), sort_keys=True, separators=(",", ":"), default=str)
    return "j-" + hashlib.sha256(blob.encode()).hexdigest()[:16]
