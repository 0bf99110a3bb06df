"""Out of memory, read from what a failed attempt left: its last lines of output, its exit
code, and whether the kernel's OOM killer ran while it did.

A GPU out-of-memory is recognised from the frameworks' own messages (PyTorch, JAX/XLA,
TensorFlow), never from a host one: Python's ``MemoryError``, numpy's "Unable to allocate
... for an array", PyTorch's ``DefaultCPUAllocator`` and a TensorFlow OOM on a CPU device
are the host's RAM, not the GPU's. A host out-of-memory is a SIGKILL while the kernel's OOM
killer ran. Pure: the caller reads the lines and the kernel's counter.

Where each message comes from (the projects' own sources; samples in the unit tests are
quoted from their users' bug reports):

- PyTorch, ``c10/cuda/CUDACachingAllocator.cpp``: "CUDA out of memory. Tried to allocate
  X GiB. GPU 0 has a total capacity of Y GiB ..." raised as ``torch.OutOfMemoryError``
  (``torch.cuda.OutOfMemoryError`` in 2.0 to 2.4, where "capacity" was misspelt
  "capacty" in 2.1; ``RuntimeError`` before 1.13, with "(GPU 0; Y GiB total capacity;
  ...)"). ROCm builds say "HIP out of memory".
- PyTorch, ``c10/cuda/CUDAException.h`` (``C10_CUDA_CHECK``): "CUDA error: out of memory"
  when a CUDA call outside the allocator fails (``RuntimeError``, from 2.5
  ``torch.AcceleratorError``); ``aten/src/ATen/cuda/CublasHandlePool.cpp``:
  "CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`".
- JAX/XLA, ``xla/pjrt`` and ``xla/tsl/framework/bfc_allocator.cc``: "RESOURCE_EXHAUSTED:
  Out of memory while trying to allocate N bytes." raised as
  ``jaxlib.xla_extension.XlaRuntimeError`` (``jax.errors.JaxRuntimeError`` in newer JAX);
  older JAX said "Out of memory allocating N bytes".
- TensorFlow, ``tensorflow/core/framework/op_kernel.cc``: "OOM when allocating tensor with
  shape[...] and type float on /job:localhost/replica:0/task:0/device:GPU:0 by allocator
  GPU_0_bfc", raised as ``ResourceExhaustedError``; ``bfc_allocator.cc``: "Allocator
  (GPU_0_bfc) ran out of memory trying to allocate ...", a failure unless it adds "The
  caller indicates that this is not a failure".
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass

#: The most characters of the framework's line that :func:`gpu_oom` returns.
MAX_LINE = 300

# Each names the GPU itself: a line that matches one is a GPU out-of-memory.
_GPU_OOM = re.compile(
    r"\b(?:CUDA|HIP) out of memory"  # PyTorch's caching allocator, any version
    r"|\btorch\.(?:cuda\.)?OutOfMemoryError\b"
    r"|\bCUDA error: out of memory"  # PyTorch's C10_CUDA_CHECK
    r"|\bCUBLAS_STATUS_ALLOC_FAILED\b"
    r"|\bRESOURCE_EXHAUSTED: Out of memory\b"  # XLA (JAX), both wordings
    r"|\b(?:Xla|Jax)RuntimeError: RESOURCE_EXHAUSTED\b"
)
# TensorFlow's: a GPU out-of-memory only where it names a GPU (here or, for a line that
# names no device, in a GPU allocator's line of the same output).
_TF_OOM = re.compile(r"\bOOM when allocating\b|\bResourceExhaustedError\b|Resource exhausted:")
_GPU_DEVICE = re.compile(r"device:GPU:\d+|\bGPU_\d+_bfc\b", re.IGNORECASE)
_BFC_GPU = re.compile(r"\bAllocator \(GPU_\d+_bfc\) ran out of memory")
_NOT_A_FAILURE = "not a failure"
# The host's RAM, whatever else the line says.
_HOST = re.compile(
    r"device:CPU:\d+|\bby allocator cpu\b|\bDefaultCPUAllocator\b"
    r"|\bUnable to allocate .* for an array\b|(?:^|[\s:.])MemoryError\b",
    re.IGNORECASE,
)

_NUMBER = r"(\d+(?:\.\d+)?)\s?(bytes|B|KiB|MiB|GiB|TiB)\b"
_TRIED = re.compile(
    r"\b(?:Tried|trying) to allocate " + _NUMBER + r"|Out of memory allocating " + _NUMBER
)
_TOTAL = re.compile(r"\btotal capac(?:i)?ty of " + _NUMBER + r"|" + _NUMBER + r" total capacity\b")
_GIB = {
    "bytes": 2.0**-30,
    "B": 2.0**-30,
    "KiB": 2.0**-20,
    "MiB": 2.0**-10,
    "GiB": 1.0,
    "TiB": 1024.0,
}


def _is_gpu_oom(line: str, gpu_allocator_ran_out: bool) -> bool:
    if _HOST.search(line):
        return False
    if _GPU_OOM.search(line):
        return True
    if _BFC_GPU.search(line):
        return _NOT_A_FAILURE not in line
    if _TF_OOM.search(line):
        return bool(_GPU_DEVICE.search(line)) or gpu_allocator_ran_out
    return False


def gpu_oom(lines: Iterable[str]) -> str | None:
    """The framework's own line saying the GPU ran out of memory (its last such line,
    trimmed to :data:`MAX_LINE` characters), or None when the output says no such thing.
    ``lines``: the last lines a failed attempt wrote, stdout and stderr together."""
    tail = list(lines)
    ran_out = any(_BFC_GPU.search(line) for line in tail)
    found = None
    for line in tail:
        if _is_gpu_oom(line, ran_out):
            found = line
    return None if found is None else found.strip()[:MAX_LINE]


def _gib(match: re.Match[str] | None) -> float | None:
    if match is None:
        return None
    number, unit = (g for g in match.groups() if g is not None)
    return float(number) * _GIB[unit]


def tried_gib(line: str) -> float | None:
    """The GiB the framework says it tried to allocate ("Tried to allocate 20.00 GiB",
    "MiB" and the rest converted; XLA's "trying to allocate N bytes" too), when stated."""
    return _gib(_TRIED.search(line))


def total_gib(line: str) -> float | None:
    """The GPU's whole memory in GiB as PyTorch states it ("GPU 0 has a total capacity of
    23.65 GiB", or before 1.13 "(GPU 0; 23.65 GiB total capacity; ...)"), when stated."""
    return _gib(_TOTAL.search(line))


def host_oom(exit_code: int | None, oom_kills_seen: bool) -> bool:
    """Whether the attempt ran the host out of memory: its process was SIGKILLed (exit
    -9, or 137 as a shell reports a child killed so) while the kernel's OOM killer ran
    (``oom_kills_seen``: its count of kills grew during the attempt)."""
    killed = exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL)
    return killed and oom_kills_seen


#: The share of its GPUs' memory a failed job's processes held at a reading (NVML) that
#: makes its failure an out-of-memory, when its framework said nothing of it.
FULL = 0.95


def gpu_full(peak_mib: int, total_mib: int) -> bool:
    """Whether a job's processes held at least :data:`FULL` of its GPUs' memory at one of
    the worker's NVML readings."""
    return total_mib > 0 and peak_mib >= FULL * total_mib


#: The classes of failure that ask for more memory on the next attempt.
GPU_OOM, HOST_OOM = "gpu_oom", "host_oom"
#: How much more than the memory that was not enough the next attempt asks for (MiB).
MARGIN_MIB = 1


@dataclass(frozen=True)
class Raised:
    """A requirement raised after an attempt ran out of memory: the field, its new
    value, and why (for ``why`` and the job's error)."""

    field: str  # "min_vram_gib" or "min_ram_gib"
    value: float
    why: str


def raised_need(failure: str, attempt: int, had_gib: float | None) -> Raised | None:
    """What the next attempt of a job whose attempt ``attempt`` failed with ``failure``
    needs: more GPU memory than the GPU it had (``had_gib``), or more host memory than
    its machine had; None for another failure, or when the memory it had is not known."""
    if had_gib is None or failure not in (GPU_OOM, HOST_OOM):
        return None
    gpu = failure == GPU_OOM
    kind = "GPU" if gpu else "host"
    why = (
        f"attempt {attempt} ran out of {kind} memory on a {'GPU' if gpu else 'machine'} "
        f"with {had_gib:g} GiB; the next needs more"
    )
    more = (round(had_gib * 1024) + MARGIN_MIB) / 1024  # a whole MiB more: "24577 MiB"
    return Raised("min_vram_gib" if gpu else "min_ram_gib", more, why)
