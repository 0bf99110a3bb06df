"""What implies a GPU, what a job aimed at a worker gets there, and how slots are held:
by jobs aimed at a worker before it claims them, and by a worker's own jobs when a poll
says otherwise."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gpufleet.domain.models import Capability, GpuInfo, JobSpec, Requirements
from gpufleet.scheduling.matching import (
    Assignment,
    FreeGpu,
    FreeResources,
    JobView,
    WorkerView,
    assign,
    ever_reason,
    memory_text,
    reserve,
    selection,
    unheld,
)
from gpufleet.wire import RequirementsModel

GIB = 1024
A100 = GpuInfo(index=0, name="NVIDIA A100-PCIE-40GB", total_mib=40 * GIB, free_mib=38 * GIB)
T4 = GpuInfo(index=1, name="NVIDIA T4", total_mib=16 * GIB, free_mib=15 * GIB)


def box(name: str, gpus: tuple[GpuInfo, ...] = (), cpu_slots: int = 1, **kw: Any) -> WorkerView:
    cap = Capability(hostname=name, cores=8, ram_mib=64 * GIB, gpus=gpus)
    return WorkerView(
        id=f"w-{name}", name=name, status=kw.pop("status", "available"), capability=cap,
        cpu_slots=cpu_slots, **kw,
    )  # fmt: skip


def spec(**req: Any) -> JobSpec:
    return JobSpec(name="train", command=("python", "t.py"), requirements=Requirements(**req))


def everything(w: WorkerView) -> FreeResources:
    return FreeResources(
        cpu_slots=w.cpu_slots, gpus=tuple(FreeGpu(g.index, g.free_mib) for g in w.capability.gpus)
    )


GPU_BOX = box("gpu-box", (A100, T4))
LAPTOP = box("laptop")


@pytest.mark.parametrize(
    "req",
    [
        {"require_cuda": True},
        {"gpu_count": 1},
        {"gpu_name": "a100*"},
        {"labels": {"gpu_type": "a100*"}},
        {"labels": {"CUDA_arch": "8*"}},
        {"labels": {"vram": "40*"}},
    ],
    ids=lambda r: next(iter(r)) + ("." + next(iter(r["labels"])) if "labels" in r else ""),
)
def test_every_constraint_that_names_a_gpu_gets_a_gpu(req: dict[str, Any]) -> None:
    job = spec(**req)
    assert job.requirements.needs_gpu
    # even a CPU machine that carries the label (by mistake) is not given the job
    matching = {k: glob.replace("*", "0") for k, glob in req.get("labels", {}).items()}
    reason = ever_reason(job, box("laptop", labels=matching))
    assert reason is not None and "needs a GPU" in reason, reason
    gpu_box = box("gpu-box", (A100, T4), labels=matching)
    got = assign(job, gpu_box, everything(gpu_box))
    assert isinstance(got, Assignment) and got.gpus, got


def test_min_vram_alone_applies_only_where_the_job_lands_on_a_gpu() -> None:
    """CIS490's meaning: with require_cuda false, min_vram_gib filters GPUs, not workers."""
    job = spec(min_vram_gib=24)
    assert not job.requirements.needs_gpu
    assert ever_reason(job, LAPTOP) is None
    assert assign(job, LAPTOP, everything(LAPTOP)) == Assignment(gpus=())
    preferring = spec(min_vram_gib=24, prefer_cuda=True)
    got = assign(preferring, GPU_BOX, everything(GPU_BOX))
    assert isinstance(got, Assignment) and got.gpus == (0,)  # the T4 is too small


def test_a_job_aimed_at_a_gpu_worker_takes_one_of_its_gpus() -> None:
    aimed = spec(worker="gpu-box")
    got = assign(aimed, GPU_BOX, everything(GPU_BOX))
    assert isinstance(got, Assignment) and got.gpus == (1,)  # best fit: the smaller GPU
    busy = FreeResources(cpu_slots=1, gpus=())
    assert assign(aimed, GPU_BOX, busy) == "needs 1 free GPU(s); 0 free"
    # aimed at a machine without GPUs it is a CPU job there
    assert assign(spec(worker="laptop"), LAPTOP, everything(LAPTOP)) == Assignment(gpus=())


def test_cpu_only_keeps_an_aimed_job_in_a_cpu_slot() -> None:
    aimed = spec(worker="gpu-box", cpu_only=True)
    assert assign(aimed, GPU_BOX, everything(GPU_BOX)) == Assignment(gpus=())


@pytest.mark.parametrize(
    "req",
    [{"gpu_name": "a100*"}, {"gpu_count": 2}, {"prefer_cuda": True}, {"labels": {"gpu": "x"}}],
)
def test_cpu_only_and_a_gpu_constraint_contradict_each_other(req: dict[str, Any]) -> None:
    problem = Requirements(cpu_only=True, **req).contradiction()
    assert problem is not None and "cpu_only" in problem
    with pytest.raises(ValueError, match="cpu_only"):
        RequirementsModel(cpu_only=True, **req)
    assert Requirements(cpu_only=True, min_vram_gib=8).contradiction() is None


def test_choosing_judges_each_worker_as_if_the_job_were_aimed_at_it() -> None:
    """The GPU box whose GPUs are all taken cannot start the job on a GPU; the laptop
    could, in a CPU slot, and says so (--auto-select passes it over: it is no GPU)."""
    job = JobView("(new)", spec(), 0.0)
    full = FreeResources(cpu_slots=1, gpus=())
    rows = selection(job, [(GPU_BOX, full), (LAPTOP, everything(LAPTOP))], 0.0, 0.0)
    assert [(c.worker.name, c.reason, c.on_gpu, c.ever) for c in rows] == [
        ("laptop", None, False, True),
        ("gpu-box", "needs 1 free GPU(s); 0 free", True, True),
    ]
    free = everything(GPU_BOX)
    rows = selection(job, [(GPU_BOX, free), (LAPTOP, everything(LAPTOP))], 0.0, 0.0)
    assert rows[0].worker.name == "gpu-box" and rows[0].reason is None and rows[0].gpus


RTX = GpuInfo(index=0, name="NVIDIA RTX 4090", total_mib=24 * GIB, free_mib=24 * GIB)


def test_choosing_ranks_by_the_gpu_the_job_gets_not_the_sum_of_a_workers_gpus() -> None:
    two = box("two-24", (RTX, replace(RTX, index=1)))
    one = box("one-40", (replace(A100, free_mib=40 * GIB),))
    job = JobView("(new)", spec(), 0.0)
    rows = selection(job, [(two, everything(two)), (one, everything(one))], 0.0, 0.0)
    assert [(c.worker.name, c.gpu_free_mib) for c in rows] == [
        ("one-40", 40 * GIB),
        ("two-24", 24 * GIB),
    ]
    # two GPUs wanted: the one-GPU box cannot; the job gets both of the other's
    pair = JobView("(new)", spec(gpu_count=2), 0.0)
    rows = selection(pair, [(one, everything(one)), (two, everything(two))], 0.0, 0.0)
    assert rows[0].worker.name == "two-24" and rows[0].gpus == (0, 1)
    assert rows[1].reason == "needs 2 GPUs; worker has 1" and not rows[1].ever


def test_a_cpu_job_is_chosen_a_machine_with_fewer_gpus() -> None:
    job = JobView("(new)", spec(cpu_only=True), 0.0)
    rows = selection(job, [(GPU_BOX, everything(GPU_BOX)), (LAPTOP, everything(LAPTOP))], 0, 0)
    assert [c.worker.name for c in rows] == ["laptop", "gpu-box"]
    assert not rows[0].on_gpu and rows[0].gpu_free_mib is None


@pytest.mark.parametrize(
    ("gib", "text"),
    [(40, "40 GiB"), (12.5, "12.5 GiB"), (100000 / 1024, "100000 MiB (97.7 GiB)"),
     (1 / 3, "0.3 GiB")],
)  # fmt: skip
def test_memory_a_job_asks_for_reads_as_it_was_given(gib: float, text: str) -> None:
    assert memory_text(gib) == text
    too_big = ever_reason(spec(require_cuda=True, min_vram_gib=100000 / 1024), GPU_BOX)
    assert too_big == "needs 100000 MiB (97.7 GiB) VRAM per GPU; largest GPU has 40.0 GiB"


def test_jobs_aimed_at_a_worker_hold_their_slots_in_claim_order() -> None:
    free = everything(GPU_BOX)
    first, second = spec(worker="gpu-box"), spec(worker="gpu-box", gpu_name="a100*")
    left = reserve([first, second], GPU_BOX, free)
    assert left.gpus == () and left.cpu_slots == 1
    third = spec(worker="gpu-box")
    assert assign(third, GPU_BOX, left) == "needs 1 free GPU(s); 0 free"
    # one that cannot start now takes nothing
    waiting = spec(worker="gpu-box", gpu_count=3)
    assert reserve([waiting], GPU_BOX, free) == free
    cpu = reserve([spec(worker="gpu-box", cpu_only=True)], GPU_BOX, free)
    assert cpu == replace(free, cpu_slots=0)


def test_slots_the_server_knows_are_held_are_not_free_whatever_a_poll_says() -> None:
    said = FreeResources(cpu_slots=2, gpus=(FreeGpu(0, 100), FreeGpu(1, 100)))
    assert unheld(said, [(1,), ()], cpu_slots=2) == FreeResources(1, (FreeGpu(0, 100),))
    assert unheld(said, [(), ()], cpu_slots=2).cpu_slots == 0
    # never more than the worker said, either
    assert unheld(FreeResources(0, ()), [], cpu_slots=4) == FreeResources(0, ())
