"""The boundary to NVIDIA's NVML library and its ``nvidia-smi`` fallback.

This module is deliberately thin: it only calls ``nvml*`` functions (or runs
``nvidia-smi``) and turns their answers into :class:`~gpufleet.domain.models.GpuInfo`.
No GPU is present in CI, so everything that could go wrong - decoding, unit
conversion, error handling, initialising NVML once per process - lives in small functions
that take the NVML module as an argument (``lib``) and are driven by a fake in the
tests. The only code that needs real hardware is ``import pynvml`` and the
``subprocess`` call to ``nvidia-smi``.

Any failure at this boundary means "no GPU seen this way": the probes return
``None`` instead of raising, and the caller decides what to fall back to.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import io
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gpufleet.domain.models import GpuInfo

_log = logging.getLogger(__name__)

_T = TypeVar("_T")

BYTES_PER_MIB = 1024 * 1024
SMI_TIMEOUT_SECONDS = 10.0
SMI_FIELDS = (
    "index",
    "name",
    "memory.total",
    "memory.free",
    "uuid",
    "compute_cap",
    "driver_version",
)
SMI_COMMAND = (
    "nvidia-smi",
    "--query-gpu=" + ",".join(SMI_FIELDS),
    "--format=csv,noheader,nounits",
)
_SMI_UNKNOWN = "[N/A]"


@dataclass(frozen=True)
class GpuProbe:
    """What one probe (NVML or nvidia-smi) saw: the GPUs and the driver stack."""

    gpus: tuple[GpuInfo, ...]
    driver_version: str | None
    cuda_version: str | None


# --------------------------------------------------------------------------- NVML


def probe_nvml(lib: Any | None = None) -> GpuProbe | None:
    """Read every GPU and the driver/CUDA versions through NVML.

    ``lib`` is the ``pynvml`` module (imported lazily when omitted) or a fake with the
    same functions. Returns ``None`` when NVML is missing or any NVML call fails.
    """
    return shared(lib).read(_read_probe)


def live_free_mib(lib: Any | None = None) -> dict[int, int] | None:
    """Current free memory in MiB per GPU index, or ``None`` when NVML is unavailable."""
    return shared(lib).read(_read_free_mib)


@dataclass(frozen=True)
class GpuReading:
    """One GPU now: free memory, how busy it was over NVML's last sample period (None
    when the driver does not say), and the compute processes on it (pid, MiB used)."""

    free_mib: int
    util_percent: int | None = None
    processes: tuple[tuple[int, int], ...] | None = None  # None: the driver did not say


def live_readings(lib: Any | None = None) -> dict[int, GpuReading] | None:
    """Every GPU's :class:`GpuReading` by index, or ``None`` when NVML is unavailable."""
    return shared(lib).read(_read_live)


def _load_nvml(lib: Any | None) -> Any | None:
    if lib is not None:
        return lib
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class Nvml:
    """NVML for the life of a process: ``nvmlInit`` on the first read, once, and
    ``nvmlShutdown`` once, at :meth:`close` (at exit for :func:`shared` ones). A worker
    reads free memory at every heartbeat and claim; each read is then the query alone.

    An init that fails (no driver, no library) is tried again at most every
    ``retry`` seconds. Reads may come from several threads; they take turns."""

    def __init__(
        self,
        lib: Any | None = None,
        retry: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lib = lib
        self._nvml: Any | None = None
        self._failed_at: float | None = None
        self._retry = retry
        self._clock = clock
        self._lock = threading.Lock()

    def _open(self) -> Any | None:
        if self._nvml is not None:
            return self._nvml
        if self._failed_at is not None and self._clock() - self._failed_at < self._retry:
            return None
        nvml = _load_nvml(self._lib)
        # NVML raises its own NVMLError subclasses (LibraryNotFound, DriverNotLoaded, ...)
        # and a fake raises whatever it likes: at this boundary every failure means the
        # same thing, "no GPU via NVML", so the catches are deliberately broad.
        try:
            if nvml is None:
                raise ImportError("no pynvml")
            nvml.nvmlInit()
        except Exception as exc:
            _log.debug("NVML unavailable: %s", exc)
            self._failed_at = self._clock()
            return None
        self._nvml = nvml
        return nvml

    def read(self, read: Callable[[Any], _T]) -> _T | None:
        """``read(nvml)`` on an initialised NVML; None if NVML or the read fails."""
        with self._lock:
            nvml = self._open()
            if nvml is None:
                return None
            try:
                return read(nvml)
            except Exception as exc:
                _log.debug("NVML query failed: %s", exc)
                return None

    def close(self) -> None:
        """Shut NVML down if it was initialised (a failing shutdown is ignored)."""
        with self._lock:
            nvml, self._nvml = self._nvml, None
            if nvml is not None:
                with contextlib.suppress(Exception):
                    nvml.nvmlShutdown()


_SHARED: dict[int, tuple[Any, Nvml]] = {}
_SHARED_LOCK = threading.Lock()


def shared(lib: Any | None = None) -> Nvml:
    """This process's NVML handle for ``lib`` (the real ``pynvml`` when None; a test's
    fake otherwise), shut down at exit."""
    with _SHARED_LOCK:
        if not _SHARED:
            atexit.register(_close_shared)
        _, handle = _SHARED.setdefault(id(lib), (lib, Nvml(lib)))
        return handle


def _close_shared() -> None:
    with _SHARED_LOCK:
        handles = [h for _, h in _SHARED.values()]
    for handle in handles:
        handle.close()


def _read_probe(nvml: Any) -> GpuProbe:
    count = int(nvml.nvmlDeviceGetCount())
    gpus = tuple(_read_gpu(nvml, index) for index in range(count))
    return GpuProbe(
        gpus=gpus,
        driver_version=_text(nvml.nvmlSystemGetDriverVersion()),
        cuda_version=cuda_version_text(int(nvml.nvmlSystemGetCudaDriverVersion())),
    )


def _read_gpu(nvml: Any, index: int) -> GpuInfo:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    return GpuInfo(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        total_mib=int(memory.total) // BYTES_PER_MIB,
        free_mib=int(memory.free) // BYTES_PER_MIB,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        compute_capability=f"{int(major)}.{int(minor)}",
    )


def _read_free_mib(nvml: Any) -> dict[int, int]:
    free: dict[int, int] = {}
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        free[index] = int(nvml.nvmlDeviceGetMemoryInfo(handle).free) // BYTES_PER_MIB
    return free


def _read_live(nvml: Any) -> dict[int, GpuReading]:
    out: dict[int, GpuReading] = {}
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        free = int(nvml.nvmlDeviceGetMemoryInfo(handle).free) // BYTES_PER_MIB
        try:
            util: int | None = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nvml.NVMLError:  # not supported on this GPU or driver
            util = None
        out[index] = GpuReading(free, util, _processes(nvml, handle))
    return out


def _processes(nvml: Any, handle: Any) -> tuple[tuple[int, int], ...] | None:
    """The compute and graphics processes on a GPU (pid, MiB), each pid once; None when
    the driver withholds per-process accounting."""
    found: dict[int, int] = {}
    said = False
    for query in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            listed = getattr(nvml, query)(handle)
        except (nvml.NVMLError, AttributeError):  # some drivers withhold it
            continue
        said = True
        for p in listed:
            mib = int(p.usedGpuMemory or 0) // BYTES_PER_MIB
            found[int(p.pid)] = max(mib, found.get(int(p.pid), 0))
    return tuple(found.items()) if said else None


def _text(value: object) -> str:
    """NVML returns ``bytes`` in older bindings and ``str`` in newer ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def cuda_version_text(version: int) -> str:
    """NVML's encoded CUDA driver version to text: ``12040`` -> ``"12.4"``."""
    return f"{version // 1000}.{version % 1000 // 10}"


# --------------------------------------------------------------------- nvidia-smi


def parse_nvidia_smi(csv_text: str) -> GpuProbe:
    """Parse the output of :data:`SMI_COMMAND`; raises ``ValueError`` on a malformed row.

    ``nvidia-smi --query-gpu`` cannot report the CUDA version, so it is ``None``.
    """
    reader = csv.reader(io.StringIO(csv_text), skipinitialspace=True)
    rows = [[cell.strip() for cell in row] for row in reader if any(c.strip() for c in row)]
    gpus = tuple(_smi_gpu(row) for row in rows)
    driver = _smi_optional(rows[0][-1]) if rows else None
    return GpuProbe(gpus=gpus, driver_version=driver, cuda_version=None)


def _smi_gpu(row: list[str]) -> GpuInfo:
    if len(row) != len(SMI_FIELDS):
        raise ValueError(
            f"nvidia-smi row has {len(row)} fields, expected {len(SMI_FIELDS)}: {row!r}"
        )
    index, name, total, free, uuid, compute_cap, _driver = row
    return GpuInfo(
        index=int(index),
        name=name,
        total_mib=int(float(total)),
        free_mib=int(float(free)),
        uuid=_smi_optional(uuid) or "",
        compute_capability=_smi_optional(compute_cap) or "",
    )


def _smi_optional(cell: str) -> str | None:
    return None if cell in ("", _SMI_UNKNOWN) else cell


def probe_nvidia_smi(run: Callable[[list[str]], str] | None = None) -> GpuProbe | None:
    """Probe GPUs with ``nvidia-smi``; ``None`` when it is absent, fails or is unparsable.

    ``run`` takes the argv and returns stdout (raising on a non-zero exit); it is
    injectable for tests. Without it the real ``nvidia-smi`` on ``PATH`` is used.
    """
    argv = list(SMI_COMMAND)
    if run is None:
        executable = shutil.which(SMI_COMMAND[0])
        if executable is None:
            return None
        argv[0] = executable
        run = _run_command
    try:
        return parse_nvidia_smi(run(argv))
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        _log.debug("nvidia-smi probe failed: %s", exc)
        return None


def _run_command(argv: list[str]) -> str:
    done = subprocess.run(
        argv, capture_output=True, text=True, check=True, timeout=SMI_TIMEOUT_SECONDS
    )
    return done.stdout


def group_gpu_mib(readings: dict[int, GpuReading], pgid: int) -> int | None:
    """The GPU memory (MiB) the processes of process group ``pgid`` use, over every GPU;
    None when the driver lists no processes at all (it does not say)."""
    if not readings or all(r.processes is None for r in readings.values()):
        return None
    total = 0
    for reading in readings.values():
        for pid, mib in reading.processes or ():
            try:
                if os.getpgid(pid) == pgid:
                    total += mib
            except OSError:  # gone, or in another PID namespace (a container)
                continue
    return total
