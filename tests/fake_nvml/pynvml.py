"""A fake ``pynvml`` for end-to-end tests: real worker processes, GPUs that are not there.

A test puts this folder first on a worker's ``PYTHONPATH`` and describes the GPUs in
``FAKE_NVML_GPUS`` (a JSON list of ``{"name", "total_mib", "free_mib"}``). The worker then
runs its real NVML code (``gpufleet.worker.nvml``), detection and live free-memory reads
included; only this module, the boundary to the driver, is fake. Free memory is read from
the environment at every call, as NVML reads the driver's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20


class NVMLError(Exception):
    pass


@dataclass(frozen=True)
class _Memory:
    total: int
    free: int
    used: int


def _gpus() -> list[dict[str, Any]]:
    gpus: list[dict[str, Any]] = json.loads(os.environ.get("FAKE_NVML_GPUS", "[]"))
    return gpus


def nvmlInit() -> None:
    if not _gpus():
        raise NVMLError("no GPUs in FAKE_NVML_GPUS")


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if not 0 <= index < len(_gpus()):
        raise NVMLError(f"no GPU {index}")
    return index


def nvmlDeviceGetMemoryInfo(handle: int) -> _Memory:
    gpu = _gpus()[handle]
    total, free = gpu["total_mib"] * MIB, gpu["free_mib"] * MIB
    return _Memory(total=total, free=free, used=total - free)


def nvmlDeviceGetName(handle: int) -> str:
    return str(_gpus()[handle]["name"])


def nvmlDeviceGetUUID(handle: int) -> str:
    return f"GPU-fake-{handle:04d}"


def nvmlDeviceGetCudaComputeCapability(handle: int) -> tuple[int, int]:
    return (8, 0)


def nvmlSystemGetDriverVersion() -> str:
    return "550.00-fake"


def nvmlSystemGetCudaDriverVersion() -> int:
    return 12040


@dataclass(frozen=True)
class _Utilization:
    gpu: int
    memory: int


@dataclass(frozen=True)
class _Process:
    pid: int
    usedGpuMemory: int | None


def nvmlDeviceGetUtilizationRates(handle: int) -> _Utilization:
    """A GPU's ``util`` (percent) from FAKE_NVML_GPUS; NVMLError when it has none."""
    gpu = _gpus()[handle]
    if "util" not in gpu:
        raise NVMLError("utilization not supported")
    return _Utilization(gpu=int(gpu["util"]), memory=0)


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[_Process]:
    """The compute processes on a GPU: the GPU's ``processes`` in FAKE_NVML_GPUS, and
    those a test (or a job it runs) wrote to the JSON file FAKE_NVML_PROCESSES names
    ({"GPU index": [[pid, MiB], ...]}), read at every call, as a driver would list them:
    a test makes a process appear on a GPU, or go, while the worker runs."""
    return _listed(handle, "processes", str(handle))


def nvmlDeviceGetGraphicsRunningProcesses(handle: int) -> list[_Process]:
    """The graphics processes on a GPU (a desktop's display server, a 3D application):
    the GPU's ``graphics`` in FAKE_NVML_GPUS, and ``"graphics:INDEX"`` in the file."""
    return _listed(handle, "graphics", f"graphics:{handle}")


def _listed(handle: int, key: str, file_key: str) -> list[_Process]:
    listed = [tuple(p) for p in _gpus()[handle].get(key, [])]
    path = os.environ.get("FAKE_NVML_PROCESSES")
    if path and os.path.exists(path):
        with open(path) as f:
            listed += [tuple(p) for p in json.load(f).get(file_key, [])]
    return [_Process(pid=int(pid), usedGpuMemory=int(mib) * MIB) for pid, mib in listed]
