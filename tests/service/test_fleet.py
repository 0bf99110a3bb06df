"""``server/fleet.py``: the host policies a manifest declares limit what its hosts'
workers claim.
"""

from __future__ import annotations

from gpufleet.scheduling.matching import FreeGpu, FreeResources
from gpufleet.server.services import Services
from gpufleet.store import Store
from gpufleet.wire import HostModel, ManifestApply
from tests.queue_steps import CPU, GIB, FakeClock, manifest_job, register, service


def test_host_policies_from_apply_limit_claims(store: Store, queue: Services) -> None:
    queue.submission.apply(
        ManifestApply(
            name="plan",
            hosts=[
                HostModel(name="bert-box", allow_jobs=["bert*"]),
                HostModel(name="no-resnet", deny_jobs=["resnet*"]),
            ],
            jobs=[manifest_job("resnet-train", "resnet50")],
        )
    )
    fresh = service(store, FakeClock(), queue.blobs)
    bert_box = register(fresh, "bert-box")
    no_resnet = register(fresh, "no-resnet")
    anyone = register(fresh, "anyone")
    assert fresh.dispatch.try_claim(bert_box.id, CPU) is None
    assert fresh.dispatch.try_claim(no_resnet.id, CPU) is None
    lease = fresh.dispatch.try_claim(anyone.id, CPU)
    assert lease is not None
    assert lease.spec.model == "resnet50"


def test_host_declared_capability_from_apply(store: Store, queue: Services) -> None:
    queue.submission.apply(
        ManifestApply(
            name="plan",
            hosts=[HostModel(name="shared-gpu", declared={"cuda": False})],
            jobs=[
                manifest_job("cuda-job", "gru", requirements={"require_cuda": True}),
            ],
        )
    )
    fresh = service(store, FakeClock(), queue.blobs)
    w = register(fresh, "shared-gpu", gpus=[("NVIDIA A100-SXM4-80GB", 80)])
    free = FreeResources(cpu_slots=1, gpus=(FreeGpu(0, 80 * GIB),))
    assert fresh.dispatch.try_claim(w.id, free) is None
