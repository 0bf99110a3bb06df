"""How rows hold domain objects, read by their own tolerant models, not the API's.

A job's spec, a worker's capability and GPUs, and a host policy are kept as JSON and read
straight into the domain's dataclasses: keys this version does not know (written by a
newer one) are ignored, a field missing (written by an older one) takes its default, and
none of the API's limits apply. So renaming or tightening an API field never makes a
stored row unreadable; the API checks what comes in, the store keeps what it was given.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import TypeAdapter

from gpufleet.domain.models import Capability, GpuInfo, HostPolicy, JobSpec

# A plain dataclass read by pydantic ignores keys it does not have (its default).
_SPEC = TypeAdapter(JobSpec)
_CAPABILITY = TypeAdapter(Capability)
_GPUS = TypeAdapter(tuple[GpuInfo, ...])
_HOST = TypeAdapter(HostPolicy)


@dataclass(frozen=True)
class HostOrigin:
    """Where a stored host policy came from, kept beside it in the same JSON: the manifest
    file as the applying client named it, and the name of the token that applied it
    (None: not known, as for an entry written before they were kept)."""

    file: str | None = None
    applied_by: str | None = None


_ORIGIN = TypeAdapter(HostOrigin)


def spec(text: str | bytes) -> JobSpec:
    return _SPEC.validate_json(text)


def spec_json(value: JobSpec) -> str:
    return _SPEC.dump_json(value).decode()


def capability(text: str | bytes) -> Capability:
    return _CAPABILITY.validate_json(text)


def gpus(text: str | bytes) -> tuple[GpuInfo, ...]:
    return _GPUS.validate_json(text)


def host_policy(text: str | bytes) -> HostPolicy:
    return _HOST.validate_json(text)


def host_origin(text: str | bytes) -> HostOrigin:
    return _ORIGIN.validate_json(text)


def host_entry(policy: dict[str, Any], origin: HostOrigin) -> str:
    """A host policy (as the API took it) and its origin, as the hosts table keeps them."""
    return json.dumps({**policy, **asdict(origin)})
