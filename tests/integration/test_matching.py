"""Matching as a user sees it: the submit-time warning and ``why`` a job waits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from gpufleet.server import explain
from tests.integration.helpers import (
    TESTCLIENT_ON_HTTPX,
    assert_error,
    gpu,
    job_body,
    register,
    submit,
)

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX

NEVER = "no registered worker could ever run this job"


# ---- submit-time warning --------------------------------------------------------------------


def test_cuda_job_with_only_a_cpu_worker_is_queued_with_a_warning(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    register(client, worker, "laptop")
    body = job_body("finetune", requirements={"require_cuda": True})
    r = client.post("/v1/jobs", json=body, headers=admin)
    assert r.status_code == 201, r.text
    out = r.json()
    warning = out["warning"]
    assert warning is not None
    assert NEVER in warning
    assert "laptop" in warning
    assert "needs a GPU" in warning and "has none" in warning

    # It is queued all the same (a GPU box may join later), and the job remembers why.
    job_id = out["job"]["id"]
    assert out["job"]["status"] == "pending"
    detail = client.get(f"/v1/jobs/{job_id}", headers=admin).json()
    assert detail["unrunnable"] == warning
    assert [j["id"] for j in client.get("/v1/jobs", headers=admin).json()] == [job_id]


def test_job_some_worker_can_run_has_no_warning(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    register(client, worker, "laptop")
    r = client.post("/v1/jobs", json=job_body("cpu-job"), headers=admin)
    assert r.status_code == 201, r.text
    assert r.json()["warning"] is None


def test_no_warning_while_no_worker_is_registered(
    client: TestClient, admin: dict[str, str]
) -> None:
    body = job_body("early", requirements={"require_cuda": True})
    r = client.post("/v1/jobs", json=body, headers=admin)
    assert r.status_code == 201, r.text
    assert r.json()["warning"] is None


def test_manifest_reports_jobs_no_worker_could_run(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    register(client, worker, "laptop")
    plan = {
        "name": "sweep",
        "jobs": [
            job_body("small", manifest="sweep"),
            job_body("big", manifest="sweep", requirements={"require_cuda": True}),
        ],
    }
    r = client.post("/v1/manifests", json=plan, headers=admin)
    assert r.status_code == 200, r.text
    result = r.json()
    assert len(result["created"]) == 2
    assert len(result["unrunnable"]) == 1
    (reason,) = result["unrunnable"].values()
    assert NEVER in reason and "needs a GPU" in reason

    # Re-applying is idempotent: nothing new, nothing flagged again.
    again = client.post("/v1/manifests", json=plan, headers=admin).json()
    assert again["created"] == [] and sorted(again["unchanged"]) == sorted(result["created"])
    assert again["unrunnable"] == {}


# ---- why ----------------------------------------------------------------------------------


def test_why_names_the_reason_for_every_worker(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    register(client, worker, "cpu-box")
    register(client, worker, "gpu-box", gpus=[gpu(gib=8)])
    job_id = submit(
        client, admin, name="llm", requirements={"require_cuda": True, "min_vram_gib": 16}
    )

    r = client.get(f"/v1/jobs/{job_id}/why", headers=admin)
    assert r.status_code == 200, r.text
    why = r.json()
    assert why["job_id"] == job_id and why["status"] == "pending"
    assert why["summary"] == NEVER
    reasons = {w["name"]: w["reason"] for w in why["workers"]}
    assert set(reasons) == {"cpu-box", "gpu-box"}
    assert "needs a GPU" in reasons["cpu-box"] and "has none" in reasons["cpu-box"]
    assert "16 GiB VRAM" in reasons["gpu-box"] and "8.0 GiB" in reasons["gpu-box"]
    assert {w["status"] for w in why["workers"]} == {"connecting"}  # registered, never polled


def test_why_says_who_can_take_a_job_that_fits(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    register(client, worker, "cpu-box")
    register(client, worker, "gpu-box", gpus=[gpu(gib=8)])
    job_id = submit(
        client, admin, name="small", requirements={"require_cuda": True, "min_vram_gib": 4}
    )
    why = client.get(f"/v1/jobs/{job_id}/why", headers=admin).json()
    assert why["summary"].startswith("claimable now by gpu-box")
    reasons = {w["name"]: w["reason"] for w in why["workers"]}
    assert reasons["gpu-box"] is None
    assert "needs a GPU" in reasons["cpu-box"]


def test_why_gives_the_place_in_the_queue_among_jobs_the_same_workers_could_run(
    client: TestClient,
    admin: dict[str, str],
    worker: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    register(client, worker, "gpu-box", gpus=[gpu(gib=8)])
    gpu_job = {"require_cuda": True}
    first = submit(client, admin, name="a", requirements=gpu_job)
    submit(client, admin, name="b", requirements=gpu_job)
    urgent = submit(client, admin, name="urgent", priority=5, requirements=gpu_job)
    # a job no worker here could run is not ahead of anyone
    submit(client, admin, name="huge", requirements={"require_cuda": True, "min_vram_gib": 99})
    last = submit(client, admin, name="c", requirements=gpu_job)
    places = {
        j: client.get(f"/v1/jobs/{j}/why", headers=admin).json()["position"]
        for j in (urgent, first, last)
    }
    assert places == {urgent: 1, first: 2, last: 4}
    why = client.get(f"/v1/jobs/{last}/why", headers=admin).json()
    assert why["summary"].endswith("(place 4 in its queue)")
    assert why["workers"][0]["reasons"] == []
    # Deep in a long queue only the first jobs ahead are looked at: no exact place then
    monkeypatch.setattr(explain, "AHEAD", 2)
    deep = client.get(f"/v1/jobs/{last}/why", headers=admin).json()
    assert deep["position"] is None
    assert deep["summary"].endswith(
        "(over 2 jobs ahead of it in its queue; 2 of the first 2 compete with it)"
    )
    assert client.get(f"/v1/jobs/{first}/why", headers=admin).json()["position"] == 2


def test_why_with_no_workers_says_so(client: TestClient, admin: dict[str, str]) -> None:
    job_id = submit(client, admin)
    why = client.get(f"/v1/jobs/{job_id}/why", headers=admin).json()
    assert why["summary"] == "no workers are registered"
    assert why["workers"] == []


def test_why_of_a_cancelled_job_says_it_is_not_waiting(
    client: TestClient, admin: dict[str, str]
) -> None:
    job_id = submit(client, admin)
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=admin).status_code == 200
    why = client.get(f"/v1/jobs/{job_id}/why", headers=admin).json()
    assert why["status"] == "cancelled"
    assert "not waiting" in why["summary"]


def test_why_needs_a_client_token(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    job_id = submit(client, admin)
    assert_error(client.get(f"/v1/jobs/{job_id}/why"), 401, "unauthorized")
    assert_error(client.get(f"/v1/jobs/{job_id}/why", headers=worker), 403, "forbidden")
