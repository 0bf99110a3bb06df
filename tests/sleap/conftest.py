"""The real sleap-nn, in a virtualenv of its own (``make test-sleap``; not in ``make test``).

The install is large (torch, about 6 GB) and takes minutes, so the virtualenv is kept
between runs on one machine: ``GPUFLEET_SLEAP_VENV``, default
``~/.cache/gpufleet/test-sleap-nn-0.3.5``. A ``.complete`` file marks one whose install
finished; a half-made one is removed and made again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Fleet, fleet

__all__ = ["fleet"]

SLEAP_NN = "sleap-nn==0.3.5"
# torch and torchvision as this machine's disk has them (pip takes them from there); a
# torch without its own torchvision pulls a CUDA build of several GB from the network.
TORCH = ("torch==2.14.1", "torchvision==0.29.1")
VENV = Path(
    os.environ.get("GPUFLEET_SLEAP_VENV")
    or Path.home() / ".cache" / "gpufleet" / f"test-{SLEAP_NN.replace('==', '-')}"
)
INSTALL_TIMEOUT = 40 * 60  # seconds: the first install on a slow machine


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).parent.name == "sleap":
            item.add_marker(pytest.mark.sleap)
            # the first test's setup may make the virtualenv
            item.add_marker(pytest.mark.timeout(INSTALL_TIMEOUT + 600))


def _install(venv: Path) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
    ]
    subprocess.run([*pip, *TORCH, SLEAP_NN], check=True, timeout=INSTALL_TIMEOUT)
    (venv / ".complete").write_text(f"{SLEAP_NN} {' '.join(TORCH)}\n")


@pytest.fixture(scope="session")
def sleap_venv() -> Path:
    """The virtualenv with sleap-nn 0.3.5 (made the first time, then reused)."""
    marker = VENV / ".complete"
    if not marker.is_file() or SLEAP_NN not in marker.read_text():
        _install(VENV)
    version = subprocess.run(
        [str(VENV / "bin" / "sleap-nn"), "--version"], capture_output=True, text=True, timeout=300
    )
    assert version.returncode == 0 and "0.3.5" in version.stdout, version.stderr
    return VENV


@pytest.fixture
def sleap_fleet(fleet: Fleet, sleap_venv: Path) -> Iterator[Fleet]:
    """A server and a CPU worker with the real sleap-nn on its PATH."""
    fleet.start_server(lease_timeout=30.0)
    path = f"{sleap_venv / 'bin'}{os.pathsep}{os.environ['PATH']}"
    fleet.start_worker("lab", env_extra={"PATH": path})
    yield fleet


def run_in_venv(venv: Path, *args: str, timeout: float = 300) -> str:
    """Run Python with the sleap-nn virtualenv's interpreter (it has sleap-io)."""
    done = subprocess.run(
        [str(venv / "bin" / "python"), *args], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout
