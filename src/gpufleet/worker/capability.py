"""Detect what a worker's host can do: CPU, RAM, disk, GPUs and the software stack.

GPUs come from NVML, then ``nvidia-smi``, or from ``--simulate-gpus`` so that a
laptop without a GPU can pretend to be a GPU box in demos and tests.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from gpufleet.domain.models import MIB_PER_GIB, Capability, GpuInfo
from gpufleet.errors import ConfigError
from gpufleet.worker.nvml import (
    GpuProbe,
    GpuReading,
    live_readings,
    probe_nvidia_smi,
    probe_nvml,
)

GIT_TIMEOUT_SECONDS = 2.0
TOOL_TIMEOUT_SECONDS = 60.0  # a tool's --version may import a lot on a cold disk
#: Tools a job may need (requirements.tools): name -> how its --version names its version,
#: and the modules this worker needs to run that tool's jobs (its adapter's).
TOOLS = {"sleap-nn": (r"sleap-nn\s+v?(\S+)", ("zmq", "yaml"))}
_SIMULATE_FLAG = "--simulate-gpus"
_SIMULATE_FORM = 'NAME:VRAM_GIB (e.g. "A100:80", or "2xA100:80" for two)'
_REPEAT = re.compile(r"^(\d+)\s*[xX]\s*(.+)$")
_NO_GPUS = GpuProbe(gpus=(), driver_version=None, cuda_version=None)


# ------------------------------------------------------------------ simulation


def parse_simulated_gpus(text: str) -> tuple[GpuInfo, ...]:
    """Parse ``--simulate-gpus``: ``"RTX 4090:24,2xA100:80"`` into simulated GPUs.

    Each item is ``NAME:VRAM_GIB``, optionally prefixed with ``Nx`` to repeat it.
    Raises :class:`~gpufleet.errors.ConfigError` naming the first bad item.
    """
    gpus: list[GpuInfo] = []
    for position, raw in enumerate(text.split(","), start=1):
        item = raw.strip()
        if not item:
            raise ConfigError(
                f'{_SIMULATE_FLAG}: item {position} of "{text}" is empty; '
                f"expected comma-separated {_SIMULATE_FORM}"
            )
        count, name, total_mib = _parse_simulated_item(item)
        for _ in range(count):
            index = len(gpus)
            gpus.append(
                GpuInfo(
                    index=index,
                    name=name,
                    total_mib=total_mib,
                    free_mib=total_mib,
                    uuid=f"SIM-{index}",
                    simulated=True,
                )
            )
    return tuple(gpus)


def _parse_simulated_item(item: str) -> tuple[int, str, int]:
    """One ``[Nx]NAME:VRAM_GIB`` item -> (count, name, total MiB)."""
    head, colon, vram_text = item.rpartition(":")
    name = head.strip()
    if not colon or not name:
        raise _bad_item(item, f"must look like {_SIMULATE_FORM}")
    count = 1
    repeat = _REPEAT.match(name)
    if repeat is not None:
        count, name = int(repeat.group(1)), repeat.group(2).strip()
        if count < 1:
            raise _bad_item(
                item,
                f"repeats {count} times; write NAME:VRAM_GIB or NxNAME:VRAM_GIB "
                'with N >= 1 (e.g. "2xA100:80")',
            )
    return count, name, _vram_mib(item, vram_text.strip())


def _vram_mib(item: str, vram_text: str) -> int:
    try:
        gib = float(vram_text)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise _bad_item(
            item,
            f'has VRAM "{vram_text}"; it must look like NAME:VRAM_GIB '
            'with a positive number of GiB (e.g. "A100:80")',
        )
    return int(gib * MIB_PER_GIB)


def _bad_item(item: str, problem: str) -> ConfigError:
    return ConfigError(f'{_SIMULATE_FLAG}: item "{item}" {problem}')


# ------------------------------------------------------------------- detection


def detect(
    *,
    simulate: str | None = None,
    nvml_lib: Any | None = None,
    smi_run: Callable[[list[str]], str] | None = None,
    cwd: Path | None = None,
    notes: list[str] | None = None,
) -> Capability:
    """Detect this host's capability.

    GPUs come from ``simulate`` when given (never touching NVML), else NVML, else
    ``nvidia-smi``; with none of them the host has no GPUs. ``nvml_lib`` and
    ``smi_run`` are injectable for tests; ``cwd`` is where disk space and the git
    commit are read (default: the current directory). Why a tool on PATH is not offered
    goes to ``notes``.
    """
    where = cwd if cwd is not None else Path.cwd()
    probe = _probe_gpus(simulate, nvml_lib, smi_run)
    return Capability(
        hostname=socket.gethostname(),
        cores=os.cpu_count() or 1,
        ram_mib=int(psutil.virtual_memory().total) // (1024 * 1024),
        disk_free_mib=_disk_free_mib(where),
        os=platform.platform(),
        python=platform.python_version(),
        gpus=probe.gpus,
        driver_version=probe.driver_version,
        cuda_version=probe.cuda_version,
        torch_version=_torch_version(),
        git_commit=_git_commit(where),
        gpus_simulated=simulate is not None,
        tools=find_tools(notes=notes),
    )


def _probe_gpus(
    simulate: str | None,
    nvml_lib: Any | None,
    smi_run: Callable[[list[str]], str] | None,
) -> GpuProbe:
    if simulate is not None:
        return GpuProbe(gpus=parse_simulated_gpus(simulate), driver_version=None, cuda_version=None)
    probe = probe_nvml(nvml_lib)
    if probe is None:
        probe = probe_nvidia_smi(smi_run)
    return probe if probe is not None else _NO_GPUS


def _disk_free_mib(path: Path) -> int:
    """Free disk space under ``path`` in MiB; 0 (unknown) when it cannot be read."""
    try:
        return int(psutil.disk_usage(str(path)).free) // (1024 * 1024)
    except OSError:
        return 0


def _torch_version() -> str | None:
    """The installed torch version, read from metadata so torch is never imported."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def job_path(path: str | None = None) -> str:
    """The PATH a job runs with: the worker's Python's folder first, then the worker's."""
    bindir = str(Path(sys.executable).parent)
    return bindir + os.pathsep + (os.environ.get("PATH", os.defpath) if path is None else path)


def find_tools(path: str | None = None, notes: list[str] | None = None) -> dict[str, str]:
    """The commands jobs may ask for (``requirements.tools``) that are on a job's PATH,
    with the versions they report. A tool that does not answer ``--version``, or whose
    jobs need a module this worker lacks, is left out (said in ``notes``): its jobs
    would fail here."""
    import importlib.util

    found = {}
    for name, (pattern, modules) in TOOLS.items():
        exe = shutil.which(name, path=job_path(path))
        if exe is None:
            continue
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            if notes is not None:
                notes.append(
                    f"{name} is on PATH but not offered: this worker's Python lacks "
                    f"{', '.join(missing)} (pip install 'gpufleet[sleap]')"
                )
            continue
        try:
            done = subprocess.run(
                [exe, "--version"],
                capture_output=True,
                text=True,
                timeout=TOOL_TIMEOUT_SECONDS,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        said = re.search(pattern, done.stdout + done.stderr)
        if done.returncode == 0 and said:
            found[name] = said.group(1)
        elif notes is not None:
            notes.append(f"{name} is on PATH ({exe}) but `{name} --version` failed; not offered")
    return found


def _git_commit(path: Path) -> str | None:
    """``HEAD`` of the git work tree containing ``path``; None otherwise, never raises."""
    git = shutil.which("git")
    if git is None:
        return None
    try:
        done = subprocess.run(
            [git, "rev-parse", "--is-inside-work-tree", "HEAD"],
            cwd=path,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.split()
    if done.returncode != 0 or len(lines) != 2 or lines[0] != "true":
        return None
    return lines[1]


# ------------------------------------------------------------------ live state


def live_state(
    cap: Capability, nvml_lib: Any | None = None
) -> tuple[tuple[GpuInfo, ...], dict[int, GpuReading]]:
    """``cap``'s GPUs as :func:`live_gpus` gives them, and NVML's readings (with the
    processes on each GPU; empty without NVML or for simulated GPUs)."""
    if cap.gpus_simulated or not cap.gpus:
        return cap.gpus, {}
    now = live_readings(nvml_lib)
    if now is None:
        return cap.gpus, {}
    return tuple(_with_reading(gpu, now) for gpu in cap.gpus), now


def live_gpus(cap: Capability, nvml_lib: Any | None = None) -> tuple[GpuInfo, ...]:
    """``cap``'s GPUs with ``free_mib`` refreshed from NVML.

    Simulated GPUs, and every GPU when NVML is unavailable, are returned unchanged.
    """
    if cap.gpus_simulated or not cap.gpus:
        return cap.gpus
    now = live_readings(nvml_lib)
    if now is None:
        return cap.gpus
    return tuple(_with_reading(gpu, now) for gpu in cap.gpus)


def _with_reading(gpu: GpuInfo, now: dict[int, GpuReading]) -> GpuInfo:
    if gpu.simulated or gpu.index not in now:
        return gpu
    reading = now[gpu.index]
    return dataclasses.replace(gpu, free_mib=reading.free_mib, util_percent=reading.util_percent)


def capability_json(cap: Capability) -> dict[str, Any]:
    """``cap`` as a plain JSON-able dict (what ``gpufleet capability`` prints)."""
    data = dataclasses.asdict(cap)
    data["gpus"] = [dataclasses.asdict(gpu) for gpu in cap.gpus]
    return data
