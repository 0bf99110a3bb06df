"""/metrics: Prometheus's format, read by prometheus-client's own parser; job counts that
match /v1/status; who may read it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from gpufleet.domain.models import Role
from gpufleet.server import QueueSettings, create_app
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.store import SqlStore
from gpufleet.store.blobfiles import BlobFiles
from tests.integration.helpers import (
    TESTCLIENT_ON_HTTPX,
    assert_error,
    bearer,
    claim,
    gpu,
    register,
    submit,
)

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX


def _scrape(
    client: TestClient, headers: dict[str, str]
) -> dict[str, list[tuple[dict[str, str], float]]]:
    r = client.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def test_metrics_count_what_status_counts(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    ids = [submit(client, admin, name=f"j{n}") for n in range(4)]
    submit(client, admin, name="other", pool="gpu-room")
    w = register(client, worker, "w1", gpus=[gpu(0, 24, "NVIDIA A100")])
    lease = claim(client, worker, w["id"])
    client.post(f"/v1/jobs/{lease['job_id']}/start", json={"attempt": 1}, headers=worker)
    done = client.post(
        f"/v1/jobs/{lease['job_id']}/finish", json={"attempt": 1, "exit_code": 0}, headers=worker
    )
    assert done.status_code == 200, done.text
    assert client.post(f"/v1/jobs/{ids[3]}/cancel", headers=admin).status_code == 200

    m = _scrape(client, admin)
    status = client.get("/v1/status", headers=admin).json()
    by_status: dict[str, float] = {}
    for labels, value in m["gpufleet_jobs"]:
        by_status[labels["status"]] = by_status.get(labels["status"], 0) + value
    assert {k: v for k, v in by_status.items() if v} == {
        k: v for k, v in status["jobs"].items() if v
    }
    assert ({"status": "pending", "pool": "gpu-room"}, 1.0) in m["gpufleet_jobs"]
    # counters end in _total; what this server did
    assert m["gpufleet_jobs_submitted_total"] == [({}, 5.0)]
    assert m["gpufleet_claims_total"] == [({}, 1.0)]
    finished = {labels["outcome"]: v for labels, v in m["gpufleet_jobs_finished_total"]}
    assert finished == {"succeeded": 1.0, "cancelled": 1.0}
    assert [v for labels, v in m["gpufleet_queue_wait_seconds_count"]] == [1.0]
    assert [v for labels, v in m["gpufleet_run_duration_seconds_count"]] == [1.0]
    # the fleet: workers by status and pool, and each GPU in bytes
    assert ({"status": "available", "pool": "default"}, 1.0) in m["gpufleet_workers"]
    gpu_total = m["gpufleet_gpu_memory_total_bytes"]
    assert gpu_total == [({"worker": "w1", "gpu": "0", "name": "NVIDIA A100"}, 24 * 2**30)]
    assert m["gpufleet_oldest_pending_job_age_seconds"][0][1] >= 0
    # no label names a job, a user or a token
    for samples in m.values():
        for labels, _ in samples:
            assert not {"job", "job_id", "user", "token"} & set(labels)


def test_metrics_need_an_operator_unless_public(
    client: TestClient, store: SqlStore, tmp_path: Path
) -> None:
    assert client.get("/metrics").status_code == 401
    submitter = Auth(store).create("alice", Role.SUBMITTER, pools=["default"])[1]
    refused = client.get("/metrics", headers=bearer(submitter))
    assert refused.status_code == 403
    operator = Auth(store).create("ops", Role.OPERATOR)[1]
    assert client.get("/metrics", headers=bearer(operator)).status_code == 200
    # an operator of pool A alone would see pool B's queue and GPUs in them: refused
    scoped = Auth(store).create("ops-a", Role.OPERATOR, pools=["a"])[1]
    assert_error(client.get("/metrics", headers=bearer(scoped)), 403, "forbidden", "every pool")

    from fastapi.testclient import TestClient

    blobs = BlobService(store, BlobFiles(tmp_path / "blobs2"), BlobSettings())
    public = create_app(store, QueueSettings(), blobs, metrics_public=True)
    with TestClient(public) as open_client:
        r = open_client.get("/metrics")
        assert r.status_code == 200
        assert "gpufleet_jobs" in r.text
