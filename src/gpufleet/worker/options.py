"""What a worker is told at start (flags, environment, config file)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkerOptions:
    server: str
    token: str | None
    name: str
    labels: dict[str, str]
    cpu_slots: int
    ephemeral: bool
    heartbeat: float
    work_dir: Path
    drain_grace: float
    pool: str | None = None  # None: the token's pool
    claim_wait: float = 25.0
    cache_dir: Path | None = None  # default: WORK_DIR/cache
    cache_size: int = 50 << 30
    mounts: tuple[str, ...] = ()
    log_backlog: int = 256 << 20  # bytes of a job's unsent output kept on disk
    work_dir_retention: float | None = 86400.0  # seconds a finished job's dir stays; None: ever

    ca: Path | None = None  # PEM CA file an https:// server's certificate must chain to
    # A submitter token of this worker's pool, put in the session string (--share-token).
    share_token: str | None = None
    # Unix users jobs run as, one per running job (--run-as); none: the worker's own user.
    run_as: tuple[str, ...] = ()
    # Jobs' Python environments (uv): where they are kept, how many bytes at most, where
    # uv installs from (wheels folders, an index), a build's time limit, whether uv may
    # download a Python, and the torch build ("auto": this machine's CUDA driver's).
    env_cache_dir: Path | None = None  # default: the user cache's environments folder
    env_cache_size: int = 20 << 30
    env_find_links: tuple[str, ...] = ()
    env_index_url: str | None = None
    env_build_timeout: float = 1800.0
    env_python_downloads: bool = False
    env_torch_backend: str = "auto"
    # uv may build source distributions (None: only where the worker is not root)
    env_allow_builds: bool | None = None
    # The workstation owner's policy file (--owner-policy; gpufleet.domain.owner).
    owner_policy: Path | None = None
