"""Which running job a waiting job of a higher priority preempts, if any
(gpufleet.scheduling.preemption): the time is an argument, so no clock is needed."""

from __future__ import annotations

from dataclasses import replace

from gpufleet.domain.models import Capability, GpuInfo, JobSpec, Requirements, WorkerStatus
from gpufleet.domain.sharing import Preemption
from gpufleet.scheduling.matching import FreeGpu, FreeResources, JobView, WorkerView
from gpufleet.scheduling.preemption import Holder, Slots, decide, freed, may_lose_slot, plan

GIB = 1024
NOW = 10_000.0
RULES = Preemption(enabled=True, min_priority=5, min_wait=60, protection=600)
CUDA_GRACE = 300.0


def gpu_box(name: str = "box", gpus: int = 2, gib: int = 24, pool: str = "default") -> WorkerView:
    cards = tuple(GpuInfo(i, "RTX", gib * GIB, gib * GIB) for i in range(gpus))
    return WorkerView(
        id=f"w-{name}",
        name=name,
        status=WorkerStatus.BUSY,
        capability=Capability(hostname=name, cores=8, ram_mib=64 * GIB, gpus=cards),
        pool=pool,
        cpu_slots=0,
    )


def waiting(priority: int = 10, gpus: int = 1, vram: float = 0, pool: str = "default") -> JobView:
    req = Requirements(require_cuda=True, gpu_count=gpus, min_vram_gib=vram)
    spec = JobSpec(name="urgent", command=("x",), priority=priority, requirements=req, pool=pool)
    return JobView("urgent", spec, NOW - 120)


def running(job_id: str, gpu: int, priority: int = 0, started: float = NOW - 500, **kw: object):
    fields: dict[str, object] = {"allows": True, "grace": 30.0, **kw}
    return Holder(job_id, 1, priority, (gpu,), started, **fields)  # type: ignore[arg-type]


def full(*held: Holder, worker: WorkerView | None = None) -> Slots:
    return Slots(worker or gpu_box(), FreeResources(cpu_slots=0), tuple(held))


def test_the_lowest_priority_then_the_newest_start_is_chosen() -> None:
    box = full(
        running("old-low", 0, priority=0, started=NOW - 900),
        running("new-low", 1, priority=0, started=NOW - 100),
    )
    other = full(running("mid", 0, priority=3), worker=gpu_box("other"))
    d = decide(waiting(), [other, box], RULES, NOW, CUDA_GRACE)
    assert d.victim is not None and d.victim.job_id == "new-low"
    assert d.worker is not None and d.worker.name == "box"


def test_no_victim_when_a_worker_can_take_the_job_now() -> None:
    box = Slots(gpu_box(), FreeResources(0, (FreeGpu(1, 24 * GIB),)), (running("low", 0),))
    d = decide(waiting(), [box], RULES, NOW, CUDA_GRACE)
    assert d.victim is None and "can take it now" in d.why


def test_only_a_job_that_allows_it_and_ranks_strictly_lower_is_preempted() -> None:
    box = full(
        running("not-allowed", 0, priority=0, allows=False),
        running("same-rank", 1, priority=10),
    )
    d = decide(waiting(priority=10), [box], RULES, NOW, CUDA_GRACE)
    assert d.victim is None and "no running job it may preempt" in d.why


def test_a_job_preempted_within_its_protection_is_left_alone() -> None:
    recent = running("recent", 0, preempted_at=NOW - 599)
    assert not may_lose_slot(recent, 10, RULES, NOW)
    assert may_lose_slot(replace(recent, preempted_at=NOW - 600), 10, RULES, NOW)
    d = decide(
        waiting(), [full(recent, running("older", 1, preempted_at=NOW - 700))], RULES, NOW, 0
    )
    assert d.victim is not None and d.victim.job_id == "older"


def test_a_victim_must_hold_a_slot_the_waiting_job_fits() -> None:
    small = full(running("low-small", 0), worker=gpu_box("small", gpus=1, gib=8))
    other_pool = full(running("low-pool", 0), worker=gpu_box("far", pool="lab"))
    d = decide(waiting(vram=16), [small, other_pool], RULES, NOW, CUDA_GRACE)
    assert d.victim is None, "an 8 GiB GPU does not fit, and another pool's slot is no use"
    big = full(running("low-big", 0), worker=gpu_box("big", gpus=1, gib=48))
    d = decide(waiting(vram=16), [small, other_pool, big], RULES, NOW, CUDA_GRACE)
    assert d.victim is not None and d.victim.job_id == "low-big"


def test_one_victim_must_be_enough() -> None:
    """A job that needs two GPUs does not preempt one of two single-GPU jobs: freeing one
    slot would not let it run (one victim at a time, never more than needed)."""
    box = full(running("a", 0), running("b", 1))
    assert decide(waiting(gpus=2), [box], RULES, NOW, CUDA_GRACE).victim is None
    half = Slots(gpu_box(), FreeResources(0, (FreeGpu(1, 24 * GIB),)), (running("a", 0),))
    d = decide(waiting(gpus=2), [half], RULES, NOW, CUDA_GRACE)
    assert d.victim is not None and d.victim.job_id == "a"


def test_a_slot_coming_free_within_the_grace_period_means_waiting() -> None:
    victim = running("low", 0, grace=30.0)
    ending = running("ends-soon", 1, priority=20, ends_by=NOW + 29)
    d = decide(waiting(), [full(victim, ending)], RULES, NOW, CUDA_GRACE)
    assert d.victim is None and "ends-soon" in d.why
    later = replace(ending, ends_by=NOW + 31)
    d = decide(waiting(), [full(victim, later)], RULES, NOW, CUDA_GRACE)
    assert d.victim is not None and d.victim.job_id == "low"
    stopping = replace(ending, ends_by=None, leaving=True)
    assert decide(waiting(), [full(victim, stopping)], RULES, NOW, CUDA_GRACE).victim is None


def test_one_victim_per_waiting_job_at_a_time() -> None:
    vacating = running("first", 0, leaving=True, making_way_for="urgent")
    d = decide(waiting(), [full(vacating, running("second", 1))], RULES, NOW, CUDA_GRACE)
    assert d.victim is None and "still making way" in d.why


def test_each_slot_is_counted_for_one_waiting_job() -> None:
    """Two urgent jobs, two low ones: each urgent job gets its own victim in one round; a
    victim already making way for the first is not the second's slot coming."""
    box = full(running("low-a", 0, started=NOW - 10), running("low-b", 1, started=NOW - 20))
    first, second = waiting(), replace(waiting(), id="urgent-2")
    decisions = plan([first, second], [box], RULES, NOW, CUDA_GRACE)
    assert [d.victim.job_id if d.victim else None for d in decisions] == ["low-a", "low-b"]
    making_way = full(
        running("low-a", 0, leaving=True, making_way_for="urgent"),
        running("low-b", 1, started=NOW - 20),
    )
    decisions = plan([first, second], [making_way], RULES, NOW, CUDA_GRACE)
    assert decisions[0].victim is None
    assert decisions[1].victim is not None and decisions[1].victim.job_id == "low-b"


def test_a_draining_worker_offers_no_slot() -> None:
    draining = full(running("low", 0), worker=replace(gpu_box(), status=WorkerStatus.DRAINING))
    assert decide(waiting(), [draining], RULES, NOW, CUDA_GRACE).victim is None


def test_a_freed_gpu_has_its_registered_memory_and_a_cpu_slot_comes_back() -> None:
    box = full(running("low", 1))
    assert [(g.index, g.free_mib) for g in freed(box, box.held[0]).gpus] == [(1, 24 * GIB)]
    cpu = Slots(gpu_box(gpus=0), FreeResources(cpu_slots=0), ())
    assert freed(cpu, Holder("c", 1, 0)).cpu_slots == 1
