"""The torch build a worker's environments get, from what its NVML says of its GPUs and
driver (the fake ``pynvml`` at the driver's boundary; the worker's real NVML code)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gpufleet.domain.environments import EnvSpec
from gpufleet.worker.capability import detect
from gpufleet.worker.environments import EnvCache, EnvSettings
from gpufleet.worker.envphase import uv_binary

FAKE = Path(__file__).parents[1] / "fake_nvml" / "pynvml.py"
TORCH = EnvSpec(with_=("torch==2.5.1", "numpy"))


def _fake_nvml() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fake_pynvml", FAKE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fake_pynvml", module)  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gpu_box(monkeypatch: pytest.MonkeyPatch) -> tuple[int, str | None]:
    gpus = [{"name": "NVIDIA A100-SXM4-40GB", "total_mib": 40960, "free_mib": 40000}] * 2
    monkeypatch.setenv("FAKE_NVML_GPUS", json.dumps(gpus))
    cap = detect(nvml_lib=_fake_nvml())
    assert cap.cuda_version == "12.4"  # what the fake driver says
    return len(cap.gpus), cap.cuda_version


def _cache(tmp_path: Path, **settings: object) -> EnvCache:
    return EnvCache(EnvSettings(tmp_path / "envs", 1 << 30, uv_binary(), **settings))  # type: ignore[arg-type]


def test_a_gpu_worker_gets_the_cuda_build_its_driver_runs(
    gpu_box: tuple[int, str | None], tmp_path: Path
) -> None:
    gpus, cuda = gpu_box
    cache = _cache(tmp_path)
    assert cache.torch_backend(TORCH, {}, gpus, cuda) == "cu124"
    assert cache.torch_backend(TORCH, {}, 0, None) == "cpu"  # a CPU worker
    assert cache.torch_backend(EnvSpec(with_=("numpy",)), {}, gpus, cuda) is None


def test_the_torch_build_is_part_of_the_key(
    gpu_box: tuple[int, str | None], tmp_path: Path
) -> None:
    gpus, cuda = gpu_box
    cache = _cache(tmp_path)
    on_gpu = asyncio.run(cache.plan(TORCH, {}, gpus, cuda))
    on_cpu = asyncio.run(cache.plan(TORCH, {}, 0, None))
    assert (on_gpu.torch_backend, on_cpu.torch_backend) == ("cu124", "cpu")
    assert on_gpu.build_key != on_cpu.build_key  # never one build for both
    assert on_gpu.lock_key != on_cpu.lock_key  # each resolves its own torch


def test_a_worker_pointed_at_its_own_index_asks_for_no_torch_build(
    gpu_box: tuple[int, str | None], tmp_path: Path
) -> None:
    gpus, cuda = gpu_box
    for settings in ({"find_links": ("/srv/wheels",)}, {"index_url": "http://mirror/simple"}):
        assert _cache(tmp_path, **settings).torch_backend(TORCH, {}, gpus, cuda) is None
    assert _cache(tmp_path, torch_backend="none").torch_backend(TORCH, {}, gpus, cuda) is None
    assert _cache(tmp_path, torch_backend="cu118").torch_backend(TORCH, {}, gpus, cuda) == "cu118"
