"""How a worker builds and keeps job environments, as its operator set it: the cache's
place and cap, uv, the torch build, the indexes, and which of the worker's ``UV_*``
variables change what uv installs (they enter the build key)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The worker's ``UV_*`` variables that change what uv installs: part of the build key.
RESULT_VARS = frozenset(
    {
        "UV_INDEX",
        "UV_DEFAULT_INDEX",
        "UV_INDEX_URL",
        "UV_EXTRA_INDEX_URL",
        "UV_FIND_LINKS",
        "UV_NO_INDEX",
        "UV_INDEX_STRATEGY",
        "UV_TORCH_BACKEND",
        "UV_PRERELEASE",
        "UV_RESOLUTION",
        "UV_FORK_STRATEGY",
        "UV_EXCLUDE_NEWER",
        "UV_NO_BINARY",
        "UV_NO_BUILD",
        "UV_NO_BINARY_PACKAGE",
        "UV_NO_BUILD_PACKAGE",
        "UV_NO_SOURCES",
        "UV_CONSTRAINT",
        "UV_OVERRIDE",
        "UV_BUILD_CONSTRAINT",
        "UV_CONFIG_FILE",
        "UV_NO_CONFIG",
    }
)
#: ... and those among them that point uv away from the public index (PyPI).
INDEX_VARS = frozenset(
    {"UV_INDEX", "UV_DEFAULT_INDEX", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS"}
)


def uv_variables(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The ``UV_*`` variables of the worker's environment (for ``EnvSettings.uv_env``)."""
    return {k: v for k, v in environ.items() if k.startswith("UV_")}


@dataclass(frozen=True)
class EnvSettings:
    """How a worker builds and keeps environments (set by its operator)."""

    root: Path  # the cache: root/envs/<build key>/ (one venv each), root/tmp, root/locks
    cap_bytes: int  # the size cap of root/envs
    uv: str  # the uv binary (uv.find_uv_bin())
    build_timeout: float = 1800.0  # a build's own limit (not the job's timeout)
    python_downloads: bool = False  # uv may download a managed Python; default never
    # "auto": from the worker's GPUs and CUDA driver; "none": never; else e.g. cu126, cpu
    torch_backend: str = "auto"
    find_links: tuple[str, ...] = ()  # folders (or pages) of wheels: the whole index
    index_url: str | None = None  # a local index, in place of PyPI
    uv_env: Mapping[str, str] = field(default_factory=dict)  # the worker's UV_* variables
    # uv may build source distributions (their own code runs, as the worker): by default
    # only where the worker is not root
    allow_builds: bool = True

    def reads_public_index(self) -> bool:
        """Whether uv reads PyPI (no index or folder of wheels configured)."""
        return not (self.find_links or self.index_url or INDEX_VARS & self.uv_env.keys())

    def index_options(self) -> dict[str, Any]:
        """The index settings, as they enter the build key."""
        env = {k: v for k, v in sorted(self.uv_env.items()) if k in RESULT_VARS}
        return {
            "find_links": list(self.find_links),
            "index_url": self.index_url,
            "env": env,
            "builds": self.allow_builds,
        }
