"""Matching requirements against capability, placing jobs on GPUs, ranking and explaining."""

from __future__ import annotations

from typing import Any

import pytest

from gpufleet.domain.models import (
    Capability,
    DeclaredCapability,
    GpuInfo,
    HostPolicy,
    JobSpec,
    Requirements,
    WorkerStatus,
)
from gpufleet.scheduling.matching import (
    Assignment,
    FreeGpu,
    FreeResources,
    JobView,
    WorkerView,
    assign,
    effective_gpus,
    ever_reason,
    explain,
    now_reason,
    rank_key,
)

GIB = 1024  # MiB
GRACE = 300.0
A100 = "NVIDIA A100-SXM4-80GB"


def gpu(index: int, gib: float = 80, name: str = A100, free_gib: float | None = None) -> GpuInfo:
    total = int(gib * GIB)
    free = total if free_gib is None else int(free_gib * GIB)
    return GpuInfo(index=index, name=name, total_mib=total, free_mib=free)


def worker(
    name: str = "box",
    *,
    gpus: tuple[GpuInfo, ...] = (),
    ram_gib: float = 64,
    labels: dict[str, str] | None = None,
    pool: str = "default",
    policy: HostPolicy | None = None,
    status: WorkerStatus = WorkerStatus.AVAILABLE,
    wid: str | None = None,
) -> WorkerView:
    return WorkerView(
        id=wid or f"w-{name}",
        name=name,
        status=status,
        capability=Capability(hostname=name, cores=8, ram_mib=int(ram_gib * GIB), gpus=gpus),
        labels=labels or {},
        pool=pool,
        policy=policy,
    )


def job(
    name: str = "train", *, model: str | None = None, pool: str = "default", **req: Any
) -> JobSpec:
    return JobSpec(
        name=name,
        command=("python", "train.py"),
        requirements=Requirements(**req),
        pool=pool,
        model=model,
    )


def free_all(w: WorkerView, cpu_slots: int = 1) -> FreeResources:
    return FreeResources(
        cpu_slots=cpu_slots, gpus=tuple(FreeGpu(g.index, g.free_mib) for g in w.capability.gpus)
    )


def policy(name: str = "box", **kw: Any) -> HostPolicy:
    return HostPolicy(name=name, **kw)


# ---- hard constraints -------------------------------------------------------------------


def test_require_cuda_on_a_cpu_worker() -> None:
    reason = ever_reason(job(require_cuda=True), worker())
    assert reason is not None
    assert "needs a GPU" in reason


def test_require_cuda_on_a_gpu_worker() -> None:
    assert ever_reason(job(require_cuda=True), worker(gpus=(gpu(0),))) is None


def test_cpu_job_runs_anywhere() -> None:
    assert ever_reason(job(), worker()) is None
    assert ever_reason(job(), worker(gpus=(gpu(0),))) is None


def test_gpu_count_more_than_the_worker_has() -> None:
    reason = ever_reason(job(gpu_count=2), worker(gpus=(gpu(0),)))
    assert reason is not None
    assert "2 GPUs" in reason
    assert "has 1" in reason
    assert ever_reason(job(gpu_count=2), worker(gpus=(gpu(0), gpu(1)))) is None


def test_min_vram_against_total_vram() -> None:
    small = worker(gpus=(gpu(0, gib=24),))
    reason = ever_reason(job(require_cuda=True, min_vram_gib=40), small)
    assert reason is not None
    assert "40 GiB" in reason
    assert "24.0 GiB" in reason
    assert ever_reason(job(require_cuda=True, min_vram_gib=24), small) is None


def test_min_vram_uses_total_not_current_free_memory_for_ever() -> None:
    busy = worker(gpus=(gpu(0, gib=80, free_gib=1),))
    # the GPU is big enough; it is merely busy right now, so the job is not unrunnable
    assert ever_reason(job(require_cuda=True, min_vram_gib=40), busy) is None


def test_min_ram() -> None:
    w = worker(ram_gib=64)
    reason = ever_reason(job(min_ram_gib=128), w)
    assert reason is not None
    assert "128 GiB RAM" in reason
    assert "64.0 GiB" in reason
    assert ever_reason(job(min_ram_gib=64), w) is None


@pytest.mark.parametrize("pattern", ["a100*", "A100*", "NVIDIA A100*", "*80GB"])
def test_gpu_name_glob_matches(pattern: str) -> None:
    assert ever_reason(job(require_cuda=True, gpu_name=pattern), worker(gpus=(gpu(0),))) is None


def test_gpu_name_glob_mismatch_names_the_gpus() -> None:
    reason = ever_reason(job(require_cuda=True, gpu_name="h100*"), worker(gpus=(gpu(0),)))
    assert reason is not None
    assert "h100*" in reason
    assert A100 in reason


def test_gpu_name_reason_counts_only_matching_gpus() -> None:
    """One A100 and one T4: a job wanting two A100s is rejected for the name, not VRAM."""
    w = worker(gpus=(gpu(0), gpu(1, gib=15, name="Tesla T4")))
    reason = ever_reason(job(gpu_count=2, gpu_name="a100*"), w)
    assert reason is not None
    assert "a100*" in reason, reason
    assert "0 GiB VRAM" not in reason, reason


def test_vram_reason_reports_the_largest_matching_gpu() -> None:
    """A 40 GiB A100 and an 80 GiB H100: an A100 job needing 60 GiB cannot fit, and the
    reason must not claim an 80 GiB GPU is available to it."""
    w = worker(gpus=(gpu(0, gib=40, name="NVIDIA A100-PCIE-40GB"), gpu(1, name="NVIDIA H100")))
    reason = ever_reason(job(require_cuda=True, gpu_name="a100*", min_vram_gib=60), w)
    assert reason is not None
    assert "60 GiB" in reason
    assert "80.0 GiB" not in reason, reason


def test_label_globs() -> None:
    want = job(labels={"zone": "eu-*"})
    assert ever_reason(want, worker(labels={"zone": "EU-west"})) is None
    mismatch = ever_reason(want, worker(labels={"zone": "us"}))
    assert mismatch is not None
    assert "zone" in mismatch
    assert "eu-*" in mismatch
    missing = ever_reason(want, worker(labels={"site": "lab"}))
    assert missing is not None
    assert "no label 'zone'" in missing


def test_allowed_hosts_globs() -> None:
    want = job(allowed_hosts=("lab-*", "spot-?"))
    assert ever_reason(want, worker("lab-01")) is None
    assert ever_reason(want, worker("spot-3")) is None
    reason = ever_reason(want, worker("office-pc"))
    assert reason is not None
    assert "office-pc" in reason
    assert "allowed_hosts" in reason


def test_explicit_target_worker_by_id_or_name() -> None:
    w = worker("gpu-box", wid="w-123abc")
    assert ever_reason(job(worker="w-123abc"), w) is None
    assert ever_reason(job(worker="gpu-box"), w) is None
    reason = ever_reason(job(worker="other-box"), w)
    assert reason is not None
    assert "other-box" in reason


def test_pool_mismatch() -> None:
    reason = ever_reason(job(pool="vision"), worker(pool="nlp"))
    assert reason is not None
    assert "vision" in reason
    assert "nlp" in reason
    assert ever_reason(job(pool="nlp"), worker(pool="nlp")) is None


# ---- host policy --------------------------------------------------------------------------


def test_host_policy_allow_list() -> None:
    w = worker(policy=policy(allow_jobs=("resnet*", "gbt")))
    assert ever_reason(job(model="resnet50"), w) is None
    assert ever_reason(job(model="gbt"), w) is None
    reason = ever_reason(job(model="bert"), w)
    assert reason is not None
    assert "allow_jobs" in reason
    assert "bert" in reason


def test_host_policy_deny_wins_over_allow() -> None:
    w = worker(policy=policy(allow_jobs=("resnet*",), deny_jobs=("resnet152",)))
    assert ever_reason(job(model="resnet50"), w) is None
    reason = ever_reason(job(model="resnet152"), w)
    assert reason is not None
    assert "deny_jobs" in reason


def test_host_policy_without_lists_allows_everything() -> None:
    w = worker(policy=policy(priority=3))
    assert ever_reason(job(model="anything"), w) is None
    assert ever_reason(job(), w) is None


def test_host_policy_empty_allow_list_allows_nothing() -> None:
    reason = ever_reason(job(model="mlp"), worker(policy=policy(allow_jobs=())))
    assert reason is not None
    assert "allow_jobs" in reason


def test_host_policy_falls_back_to_the_job_name_without_a_model() -> None:
    assert ever_reason(job("bert-base"), worker(policy=policy(allow_jobs=("bert*",)))) is None
    denied = ever_reason(job("bert-base"), worker(policy=policy(deny_jobs=("bert*",))))
    assert denied is not None
    assert "bert-base" in denied
    # a model, when given, is what the lists are matched against
    deny_bert = worker(policy=policy(deny_jobs=("bert*",)))
    assert ever_reason(job("bert-base", model="gru"), deny_bert) is None


# ---- declared capability ------------------------------------------------------------------


def declared(**kw: Any) -> HostPolicy:
    return policy(declared=DeclaredCapability(**kw))


def test_declared_cuda_false_hides_gpus() -> None:
    w = worker(gpus=(gpu(0),), policy=declared(cuda=False))
    assert effective_gpus(w) == ()
    reason = ever_reason(job(require_cuda=True), w)
    assert reason is not None
    assert "needs a GPU" in reason


def test_declared_gpu_count_limits() -> None:
    w = worker(gpus=(gpu(0), gpu(1), gpu(2)), policy=declared(gpus=1))
    assert [g.index for g in effective_gpus(w)] == [0]
    reason = ever_reason(job(gpu_count=2), w)
    assert reason is not None
    assert "has 1" in reason
    # declaring more than detected does not invent GPUs
    more = worker(gpus=(gpu(0),), policy=declared(gpus=4))
    assert ever_reason(job(gpu_count=2), more) is not None


def test_declared_vram_caps() -> None:
    w = worker(gpus=(gpu(0, gib=80),), policy=declared(vram_gib=16))
    reason = ever_reason(job(require_cuda=True, min_vram_gib=24), w)
    assert reason is not None
    assert "16.0 GiB" in reason
    assert ever_reason(job(require_cuda=True, min_vram_gib=16), w) is None
    # declaring more than detected does not add memory
    more = worker(gpus=(gpu(0, gib=24),), policy=declared(vram_gib=160))
    assert ever_reason(job(require_cuda=True, min_vram_gib=40), more) is not None


def test_declared_ram_caps() -> None:
    w = worker(ram_gib=64, policy=declared(ram_gib=8))
    reason = ever_reason(job(min_ram_gib=16), w)
    assert reason is not None
    assert "8.0 GiB" in reason
    more = worker(ram_gib=64, policy=declared(ram_gib=512))
    assert ever_reason(job(min_ram_gib=100), more) is not None


# ---- prefer_cuda and the grace window -----------------------------------------------------


def test_prefer_cuda_takes_a_gpu_on_a_gpu_worker() -> None:
    w = worker(gpus=(gpu(0),))
    jv = JobView("j-1", job(prefer_cuda=True), created_at=1000.0)
    verdict = now_reason(jv, w, free_all(w), now=1000.0, prefer_cuda_grace=GRACE)
    assert verdict == Assignment(gpus=(0,), vram_mib=80 * GIB)


def test_prefer_cuda_on_a_cpu_worker_waits_for_the_grace_window() -> None:
    w = worker()
    jv = JobView("j-1", job(prefer_cuda=True), created_at=1000.0)
    early = now_reason(jv, w, free_all(w), now=1000.0 + GRACE - 1, prefer_cuda_grace=GRACE)
    assert isinstance(early, str)
    assert "grace" in early
    at = now_reason(jv, w, free_all(w), now=1000.0 + GRACE, prefer_cuda_grace=GRACE)
    assert at == Assignment(gpus=())
    later = now_reason(jv, w, free_all(w), now=1000.0 + 10 * GRACE, prefer_cuda_grace=GRACE)
    assert later == Assignment(gpus=())


def test_prefer_cuda_is_not_unrunnable_on_a_cpu_worker() -> None:
    assert ever_reason(job(prefer_cuda=True), worker()) is None


def test_plain_cpu_job_needs_no_grace() -> None:
    w = worker()
    jv = JobView("j-1", job(), created_at=1000.0)
    assert now_reason(jv, w, free_all(w), now=1000.0, prefer_cuda_grace=GRACE) == Assignment(())


@pytest.mark.parametrize("status", [WorkerStatus.DRAINING, WorkerStatus.OFFLINE])
def test_draining_or_offline_workers_take_nothing(status: WorkerStatus) -> None:
    w = worker(status=status)
    verdict = now_reason(JobView("j", job(), 0.0), w, free_all(w), 0.0, GRACE)
    assert verdict == f"worker is {status.value}"


# ---- assignment (best fit) ----------------------------------------------------------------


MIXED = (gpu(0, gib=80), gpu(1, gib=24), gpu(2, gib=48))


def test_best_fit_picks_the_smallest_sufficient_gpu() -> None:
    w = worker(gpus=MIXED)
    assert assign(job(require_cuda=True, min_vram_gib=20), w, free_all(w)) == Assignment(
        gpus=(1,), vram_mib=24 * GIB
    )
    assert assign(job(require_cuda=True, min_vram_gib=40), w, free_all(w)) == Assignment(
        gpus=(2,), vram_mib=48 * GIB
    )
    assert assign(job(require_cuda=True, min_vram_gib=60), w, free_all(w)) == Assignment(
        gpus=(0,), vram_mib=80 * GIB
    )


def test_best_fit_only_among_free_gpus() -> None:
    w = worker(gpus=MIXED)
    free = FreeResources(cpu_slots=1, gpus=(FreeGpu(0, 80 * GIB), FreeGpu(2, 48 * GIB)))
    result = assign(job(require_cuda=True, min_vram_gib=20), w, free)
    assert isinstance(result, Assignment)
    assert result.gpus == (2,)


def test_best_fit_respects_free_vram() -> None:
    w = worker(gpus=MIXED)
    # GPU 1 is free of jobs but another process holds most of its memory
    free = FreeResources(
        cpu_slots=1, gpus=(FreeGpu(0, 80 * GIB), FreeGpu(1, 2 * GIB), FreeGpu(2, 48 * GIB))
    )
    result = assign(job(require_cuda=True, min_vram_gib=20), w, free)
    assert isinstance(result, Assignment)
    assert result.gpus == (2,)


def test_multi_gpu_job_takes_the_smallest_gpus() -> None:
    w = worker(gpus=MIXED)
    result = assign(job(gpu_count=2), w, free_all(w))
    assert result == Assignment(gpus=(1, 2), vram_mib=(24 + 48) * GIB)


def test_no_free_gpu() -> None:
    w = worker(gpus=(gpu(0),))
    result = assign(job(require_cuda=True), w, FreeResources(cpu_slots=1, gpus=()))
    assert isinstance(result, str)
    assert "free GPU" in result
    vram = assign(
        job(require_cuda=True, min_vram_gib=40),
        w,
        FreeResources(cpu_slots=1, gpus=(FreeGpu(0, 10 * GIB),)),
    )
    assert isinstance(vram, str)
    assert "40 GiB free" in vram


def test_cpu_job_needs_a_free_cpu_slot() -> None:
    w = worker(gpus=(gpu(0),))
    assert assign(job(), w, FreeResources(cpu_slots=0, gpus=(FreeGpu(0, 80 * GIB),))) == (
        "no free CPU slot"
    )
    assert assign(job(), w, FreeResources(cpu_slots=1)) == Assignment(gpus=())


# ---- ranking ------------------------------------------------------------------------------


def test_rank_prefers_higher_host_priority_then_smaller_gpu() -> None:
    want = job(require_cuda=True)
    big_hi = worker("big-hi", gpus=(gpu(0, gib=80),), policy=policy("big-hi", priority=5))
    big = worker("big", gpus=(gpu(0, gib=80),))
    small = worker("small", gpus=(gpu(0, gib=24),))

    def key(w: WorkerView) -> tuple[int, int, int]:
        placed = assign(want, w, free_all(w))
        assert isinstance(placed, Assignment)
        return rank_key(want, w, placed)

    ranked = sorted([small, big, big_hi], key=key)
    assert [w.name for w in ranked] == ["big-hi", "small", "big"]


def test_rank_sends_cpu_jobs_to_workers_with_fewer_gpus() -> None:
    want = job()
    gpu_box = worker("gpu-box", gpus=(gpu(0), gpu(1)))
    laptop = worker("laptop")
    keys = {w.name: rank_key(want, w, Assignment(gpus=())) for w in (gpu_box, laptop)}
    assert keys["laptop"] < keys["gpu-box"]


# ---- explain ------------------------------------------------------------------------------


def test_explain_gives_one_verdict_per_worker() -> None:
    gpu_box = worker("gpu-box", gpus=(gpu(0),))
    laptop = worker("laptop")
    draining = worker("old", gpus=(gpu(0),), status=WorkerStatus.DRAINING)
    full = worker("full", gpus=(gpu(0),))
    jv = JobView("j-1", job(require_cuda=True), created_at=0.0)
    verdicts = explain(
        jv,
        [
            (gpu_box, free_all(gpu_box)),
            (laptop, free_all(laptop)),
            (draining, free_all(draining)),
            (full, FreeResources(cpu_slots=1, gpus=())),
        ],
        now=0.0,
        prefer_cuda_grace=GRACE,
    )
    assert [w.name for w, _ in verdicts] == ["gpu-box", "laptop", "old", "full"]
    reasons = {w.name: "; ".join(r) for w, r in verdicts}
    assert reasons["gpu-box"] == ""
    assert "needs a GPU" in reasons["laptop"]
    assert reasons["old"] == "worker is draining"
    assert "free GPU" in reasons["full"]


def test_explain_with_no_workers() -> None:
    assert explain(JobView("j", job(), 0.0), [], now=0.0, prefer_cuda_grace=GRACE) == []


def test_a_job_reading_a_shared_path_goes_only_to_workers_holding_it() -> None:
    from dataclasses import replace

    from gpufleet.domain.models import InputKind, JobInput

    spec = replace(
        job(), inputs=(JobInput(kind=InputKind.PATH, ref="/mnt/lab/digits", sha256="0" * 64),)
    )
    plain = worker("spot")
    mounted = replace(plain, capability=replace(plain.capability, mounts=("/mnt/lab",)))
    assert ever_reason(spec, mounted) is None
    reason = ever_reason(spec, plain)
    assert reason is not None and "/mnt/lab/digits" in reason and "--mount" in reason
    elsewhere = replace(plain, capability=replace(plain.capability, mounts=("/mnt/other",)))
    assert ever_reason(spec, elsewhere) is not None


@pytest.mark.parametrize(
    ("path", "held"),
    [
        ("/mnt/lab", True),
        ("/mnt/lab/digits/train.csv", True),
        ("/mnt/lab/../etc/passwd", False),  # .. cannot climb out of the mount
        ("/mnt/laboratory", False),  # a prefix of the name is not the folder
        ("/mnt", False),
    ],
)
def test_covering_mount(path: str, held: bool) -> None:
    from gpufleet.domain.models import covering_mount

    assert (covering_mount(path, ("/srv/x", "/mnt/lab/")) is not None) is held


# ---- every reason -------------------------------------------------------------------------


def test_why_names_every_constraint_not_only_the_first() -> None:
    """A CPU-only host whose allow list excludes the model: both the allow list and the
    missing CUDA keep it from the job; a draining GPU box with the wrong label says its
    state and the label."""
    cpu_box = worker("cpu-box", policy=policy(allow_jobs=("gbt",)))
    gpu_box = worker(
        "gpu-box", gpus=(gpu(0),), labels={"site": "lab"}, status=WorkerStatus.DRAINING
    )
    spec = job(model="resnet50", require_cuda=True, labels={"site": "cloud*"})
    free = FreeResources(cpu_slots=1, gpus=(FreeGpu(0, 80 * GIB),))
    verdicts = dict(
        (w.name, reasons)
        for w, reasons in explain(
            JobView("j", spec, 0.0), [(cpu_box, free), (gpu_box, free)], 0.0, GRACE
        )
    )
    cpu = verdicts["cpu-box"]
    assert any("allow_jobs" in r for r in cpu), cpu
    assert any("needs a GPU" in r for r in cpu), cpu
    assert any("label 'site'" in r or "no label 'site'" in r for r in cpu), cpu
    gpu_reasons = verdicts["gpu-box"]
    assert gpu_reasons[0] == "worker is draining"
    assert any("site='lab' does not match" in r for r in gpu_reasons), gpu_reasons
    assert len(gpu_reasons) == 2  # its GPU fits: nothing else stands in the way
    # the claim path still stops at the first reason
    assert ever_reason(spec, cpu_box) == cpu[0]


def test_a_job_needing_a_tool_goes_only_to_workers_that_have_it_and_why_says_so() -> None:
    from dataclasses import replace

    spec = job(tools=("sleap-nn",), require_cuda=True)
    bare = worker("bare", gpus=(gpu(0),))
    sleapy = replace(bare, capability=replace(bare.capability, tools={"sleap-nn": "0.3.5"}))
    assert ever_reason(spec, sleapy) is None
    assert ever_reason(spec, bare) == "needs sleap-nn on the worker's PATH (tools); worker has none"
    laptop = worker("laptop")  # no tool and no GPU: both are said
    verdicts = explain(
        JobView("j", spec, 0.0), [(laptop, free_all(laptop))], now=0.0, prefer_cuda_grace=GRACE
    )
    said = "; ".join(verdicts[0][1])
    assert "sleap-nn" in said and "needs a GPU" in said
