"""Out of memory read from a failed attempt: the GPU's from the frameworks' own messages
(samples as users reported them in the projects' issues), never the host's RAM; the
host's from a SIGKILL while the kernel's OOM killer ran."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.domain.oom import MAX_LINE, gpu_oom, host_oom, total_gib, tried_gib

PYTORCH = [
    # 2.5 and later (pytorch/pytorch#16417, a comment of 2024)
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 has a "
    "total capacity of 23.65 GiB of which 11.06 MiB is free. Including non-PyTorch memory, "
    "this process has 23.60 GiB memory in use. Of the allocated memory 22.90 GiB is "
    "allocated by PyTorch, and 194.87 MiB is reserved by PyTorch but unallocated.",
    # 2.1, with its misspelt "capacty" (wxian3/NeuroLens#2)
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 55.57 GiB. GPU 0 "
    "has a total capacty of 12.00 GiB of which 9.02 GiB is free.",
    # before 1.13 (rshaojimmy/MADDoG#11)
    "RuntimeError: CUDA out of memory. Tried to allocate 2.87 GiB (GPU 0; 14.76 GiB total "
    "capacity; 8.77 GiB already allocated; 19.75 MiB free; 13.71 GiB reserved in total by "
    "PyTorch)",
    # a CUDA call outside the allocator (taohan10200/IIM#28; Wan2GP#1083 for 2.5+)
    "RuntimeError: CUDA error: out of memory",
    "torch.AcceleratorError: CUDA error: out of memory",
    # cuBLAS's handle (QwenLM/Qwen3#873)
    "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "torch.cuda.OutOfMemoryError",
    "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 GiB.",
]
JAX = [
    # google-deepmind/alphafold#1023, patrickbryant1/AFProfile#8
    "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying "
    "to allocate 7406166528 bytes.",
    # sokrypton/ColabFold#65 (JAX of 2021 raised RuntimeError)
    "RuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 14285187448 bytes.",
    # onpix/LLNeRF#9 (the older wording)
    "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating "
    "20029400304 bytes.",
    "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
    "73.30GiB.",
]
TENSORFLOW = [
    # tensorflow/models#7142, keras-team/keras#9643 (a second GPU)
    "ResourceExhaustedError (see above for traceback): OOM when allocating tensor with "
    "shape[500,17,17,4032] and type float on /job:localhost/replica:0/task:0/device:GPU:0 "
    "by allocator GPU_0_bfc.",
    "ResourceExhaustedError: OOM when allocating tensor with shape[128,128,109,109] and type "
    "float on /job:localhost/replica:0/task:0/device:GPU:1 by allocator GPU_1_bfc",
    # TF 1's kernel warning (zzw922cn/Automatic_Speech_Recognition#78)
    "2018-06-08 17:26:00.908130: W tensorflow/core/framework/op_kernel.cc:1202] OP_REQUIRES "
    "failed at tile_ops.cc:123 : Resource exhausted: OOM when allocating tensor with "
    "shape[16,1,892800,8,4,2,2] and type float on /job:localhost/replica:0/task:0/device:GPU:0"
    " by allocator GPU_0_bfc",
    "  (0) Resource exhausted: OOM when allocating tensor with shape[16,112,112,147] and type "
    "float on /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc",
    # the allocator's own line, when it is a failure
    "2024-07-13 01:58:23.985593: W tensorflow/tsl/framework/bfc_allocator.cc:485] Allocator "
    "(GPU_0_bfc) ran out of memory trying to allocate 3.07GiB (rounded to 3300000000)"
    "requested by op _EagerConst",
]
HOST = [
    "MemoryError",
    "MemoryError: Unable to allocate array",
    "numpy.core._exceptions._ArrayMemoryError: Unable to allocate 1.00 TiB for an array with "
    "shape (1000000, 137438) and data type float64",
    "numpy.core._exceptions.MemoryError: Unable to allocate 8.00 GiB for an array with shape "
    "(1073741824,) and data type float64",
    # TensorFlow on the CPU (tensorflow/tensorflow#45238)
    "2020-11-28 09:40:14.792808: W tensorflow/core/framework/op_kernel.cc:1763] OP_REQUIRES "
    "failed at image_resizer_state.h:142 : Resource exhausted: OOM when allocating tensor "
    "with shape[1,416,416,3] and type float on /job:localhost/replica:0/task:0/device:CPU:0 "
    "by allocator cpu",
    "W tensorflow/core/framework/op_kernel.cc:1751] Resource exhausted: MemoryError: Unable to "
    "allocate 184. MiB for an array with shape (64, 26, 26, 3, 371) and data type float32",
    "RuntimeError: [enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough "
    "memory: you tried to allocate 85899345920 bytes.",
]
OTHER = [
    "Traceback (most recent call last):",
    "ValueError: shapes (3,4) and (5,6) not aligned",
    "RuntimeError: CUDA error: device-side assert triggered",
    "RuntimeError: CUDA error: no kernel image is available for execution on the device",
    "grpc._channel._InactiveRpcError: StatusCode.RESOURCE_EXHAUSTED: Received message larger "
    "than max",
    "epoch 3: loss 0.12 (memory 10.2 GiB)",
    # a warning TensorFlow survives: the allocator says it is not a failure
    "W tensorflow/core/common_runtime/bfc_allocator.cc:217] Allocator (GPU_0_bfc) ran out of "
    "memory trying to allocate 1.51GiB. The caller indicates that this is not a failure, but "
    "may mean that there could be performance gains if more memory is available.",
]


@pytest.mark.parametrize("line", PYTORCH + JAX + TENSORFLOW)
def test_each_frameworks_gpu_out_of_memory_is_recognised(line: str) -> None:
    said = ["Traceback (most recent call last):", '  File "train.py", line 9', line]
    assert gpu_oom(said) == line.strip()[:MAX_LINE]


@pytest.mark.parametrize("line", HOST + OTHER)
def test_the_hosts_memory_and_other_failures_are_not_a_gpu_out_of_memory(line: str) -> None:
    assert gpu_oom(["Traceback (most recent call last):", line]) is None


def test_the_line_found_is_the_frameworks_last_such_line_among_others() -> None:
    lines = [
        "epoch 1 done",
        "RuntimeError: CUDA error: out of memory",
        "CUDA kernel errors might be asynchronously reported at some other API call, so the",
        "stacktrace below might be incorrect.",
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
    ]
    assert gpu_oom(lines) == "RuntimeError: CUDA error: out of memory"
    assert gpu_oom(iter([*lines, PYTORCH[0]])) == PYTORCH[0][:MAX_LINE]
    assert gpu_oom([]) is None


def test_a_long_line_is_trimmed_and_stripped() -> None:
    line = "  " + PYTORCH[0] + " " + "x" * 500 + "\n"
    found = gpu_oom([line])
    assert found is not None and len(found) == MAX_LINE
    assert found.startswith("torch.OutOfMemoryError: CUDA out of memory.")


def test_a_tensorflow_error_naming_no_device_counts_only_after_the_gpus_allocator_ran_out() -> None:
    # keras-ocr#195: TF 2's eager error names no device; its GPU allocator said it ran out.
    error = "tensorflow.python.framework.errors_impl.ResourceExhaustedError: failed to allocate "
    error += "memory [Op:AddV2]"
    assert gpu_oom([error]) is None
    warned = "W bfc_allocator.cc:296] Allocator (GPU_0_bfc) ran out of memory trying to "
    warned += "allocate 902.00MiB with freed_by_count=0. The caller indicates that this is not "
    warned += "a failure, but this may mean that there could be performance gains"
    assert gpu_oom([warned]) is None
    assert gpu_oom([warned, error]) == error


@pytest.mark.parametrize(
    ("line", "tried", "total"),
    [
        (PYTORCH[0], 22 / 1024, 23.65),
        (PYTORCH[1], 55.57, 12.0),
        (PYTORCH[2], 2.87, 14.76),
        (
            "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 3.2 GiB is free.",
            20.0,
            79.19,
        ),
        (
            "RuntimeError: CUDA out of memory. Tried to allocate 1024.00 KiB (GPU 0; 11.17 GiB "
            "total capacity; 10.90 GiB already allocated)",
            1 / 1024,
            11.17,
        ),
        (JAX[0], 7406166528 / 2**30, None),
        (JAX[2], 20029400304 / 2**30, None),
        (JAX[3], 73.30, None),
        ("RuntimeError: CUDA error: out of memory", None, None),
    ],
)
def test_what_was_tried_and_what_the_gpu_holds_are_read_when_stated(
    line: str, tried: float | None, total: float | None
) -> None:
    assert tried_gib(line) == (None if tried is None else pytest.approx(tried))
    assert total_gib(line) == (None if total is None else pytest.approx(total))


@given(st.floats(0.01, 100_000, allow_nan=False), st.sampled_from(["MiB", "GiB"]))
def test_any_size_pytorch_states_is_read_back_in_gib(size: float, unit: str) -> None:
    line = f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {size:.2f} {unit}. "
    line += f"GPU 0 has a total capacity of {size:.2f} {unit} of which 0 bytes is free."
    gib = float(f"{size:.2f}") / (1024 if unit == "MiB" else 1)
    assert tried_gib(line) == pytest.approx(gib)
    assert total_gib(line) == pytest.approx(gib)


@given(st.lists(st.sampled_from(HOST + OTHER), max_size=30))
def test_no_mix_of_host_and_other_lines_is_a_gpu_out_of_memory(lines: list[str]) -> None:
    assert gpu_oom(lines) is None


@pytest.mark.parametrize(
    ("code", "kills", "host"),
    [
        (-9, True, True),  # SIGKILLed, as the worker's process reports it
        (137, True, True),  # a shell's child SIGKILLed (128 + 9)
        (-9, False, False),  # SIGKILLed by someone else, not the kernel's OOM killer
        (137, False, False),
        (1, True, False),  # the OOM killer ran, but killed something else
        (-15, True, False),
        (0, True, False),
        (None, True, False),  # no exit code: it never ran, or was lost
    ],
)
def test_a_host_out_of_memory_is_a_sigkill_while_the_oom_killer_ran(
    code: int | None, kills: bool, host: bool
) -> None:
    assert host_oom(code, kills) is host
