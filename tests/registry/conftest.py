"""A real build from the package registry (``make test-registry``; not in ``make test``).

The worker's uv reads PyPI itself (no ``--env-find-links``), so these tests need the
network. uv's cache is kept between runs on one machine, so only the first run downloads
the wheels: ``GPUFLEET_TEST_UV_CACHE``, default ``~/.cache/gpufleet-test-uv`` (never the
per-test cache folder the other tests get).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.conftest import fleet

__all__ = ["UV_CACHE", "fleet"]

UV_CACHE = Path(
    os.environ.get("GPUFLEET_TEST_UV_CACHE") or Path.home() / ".cache" / "gpufleet-test-uv"
)
#: seconds: a cold build downloads about 60 MB and compiles its bytecode on two cores
BUILD_TIMEOUT = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).parent.name == "registry":
            item.add_marker(pytest.mark.registry)
            item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT + 120))
