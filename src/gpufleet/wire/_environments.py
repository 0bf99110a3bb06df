"""Job environments on the wire: what an attempt ran in (its start report), what a worker
has built (its heartbeats), and the fleet-wide locks of unlocked specs."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import AfterValidator, Field

from gpufleet.wire._base import Attempt, LeaseSecret, Sha256, Strict, Wire, _no_nul

#: A build key, spec key or lock key: a SHA-256, 64 lowercase hex digits.
EnvKey = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="64 hex digits")]
#: A Python version as a worker says it (3.12.4, 3.13.0rc1).
PythonVersion = Annotated[str, Field(min_length=1, max_length=32), AfterValidator(_no_nul)]
#: The torch build an environment was made for (cpu, cu124, rocm6.2), as uv names it.
TorchBackend = Annotated[
    str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$", description="cpu, cu124, ...")
]
#: The most packages an environment's report lists, and the longest name or version.
MOST_PACKAGES = 2000
PACKAGE_CHARS = 200
#: The most environments a worker's heartbeat lists.
MOST_BUILT = 500
_Package = Annotated[str, Field(min_length=1, max_length=PACKAGE_CHARS), AfterValidator(_no_nul)]
_Version = Annotated[str, Field(max_length=PACKAGE_CHARS), AfterValidator(_no_nul)]


class EnvUsed(Strict):
    """The environment an attempt runs in, as its worker reports it when the job starts."""

    key: EnvKey = Field(description="the build key: the worker's cache entry")
    spec_key: EnvKey = Field(description="the spec key: what the job asked for")
    python: PythonVersion
    built: bool = Field(
        description="built for this attempt (else found in the worker's cache, or built by "
        "another job it waited for)"
    )
    seconds: float = Field(
        ge=0, le=10_000_000, description="the build's time, or the wait for another's build"
    )
    versions: dict[_Package, _Version] = Field(
        default_factory=dict,
        max_length=MOST_PACKAGES,
        description="package -> version, as installed",
    )
    torch_backend: TorchBackend | None = None


class EnvBuiltModel(Strict):
    """An environment in a worker's cache."""

    key: EnvKey = Field(description="the build key")
    spec_key: EnvKey
    python: PythonVersion
    size_bytes: int = Field(ge=0, le=2**50)
    last_used: float = Field(ge=0, le=1e11, description="when a job last used it (epoch s)")
    describe: str = Field("", max_length=500, description="what it is built from, in a line")
    torch_backend: TorchBackend | None = None


class EnvLockOut(Wire):
    """A pool's lock of an unlocked environment spec: every build of the spec in the pool
    (for this Python and torch build) installs the versions its blob holds."""

    pool: str = Field(description="the pool whose workers install it (locks are per pool)")
    key: str = Field(description="the lock key: spec, Python major.minor and torch build")
    sha256: str = Field(description="the blob of the lock: uv's pinned requirements or uv.lock")
    spec_key: str
    python: str = Field(description="major.minor")
    torch_backend: str | None
    job_id: str = Field(description="the job whose build recorded it")
    worker_name: str = Field(description="the worker that built it")
    created_at: datetime = Field(description="when the key was first locked")
    replaced_at: datetime | None = Field(
        None, description="when a job asking for a fresh resolution (upgrade) last replaced it"
    )


class EnvLockPut(Strict):
    """A worker records the lock its first build of an unlocked spec resolved. It must
    hold ``job_id``'s attempt ``attempt`` (its lease and secret), and have uploaded the
    blob first."""

    sha256: Sha256 = Field(description="the lock's blob, uploaded first")
    spec_key: EnvKey
    python: Annotated[str, Field(pattern=r"^\d{1,2}\.\d{1,3}$", description="major.minor")]
    torch_backend: TorchBackend | None = None
    job_id: Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_no_nul)]
    attempt: Attempt
    secret: LeaseSecret = None
    replace: bool = Field(
        False,
        description="replace a lock recorded before (a job asking for a fresh resolution, "
        "upgrade); else the first lock recorded stands",
    )
