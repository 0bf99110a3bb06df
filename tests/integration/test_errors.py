"""Errors a user meets: one JSON shape everywhere, 404s that name what was missing, 409s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.integration.helpers import (
    TESTCLIENT_ON_HTTPX,
    assert_error,
    bearer,
    claim,
    job_body,
    register,
    submit,
)

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX


# ---- one shape for every error -------------------------------------------------------------

# (method, path, who, body or raw bytes, expected status)
ERRORS: list[tuple[str, str, str, Any, int]] = [
    ("GET", "/v1/jobs", "nobody", None, 401),
    ("GET", "/v1/jobs", "stranger", None, 401),
    ("POST", "/v1/tokens", "worker", {"name": "x", "role": "admin"}, 403),
    ("GET", "/v1/jobs/j-missing", "admin", None, 404),
    ("GET", "/v1/no-such-route", "admin", None, 404),
    ("GET", "/no-such-route", "nobody", None, 404),
    ("DELETE", "/v1/jobs", "admin", None, 405),
    ("PUT", "/v1/health", "nobody", None, 405),
    ("POST", "/v1/jobs", "admin", {"name": "x", "command": []}, 422),
    ("POST", "/v1/jobs", "admin", b"{not json", 422),
    ("POST", "/v1/jobs", "admin", None, 422),
    ("GET", "/v1/jobs?limit=0", "admin", None, 422),
    ("GET", "/v1/jobs?status=bogus", "admin", None, 422),
    ("POST", "/v1/workers/w-missing/heartbeat", "worker", {}, 404),
]


@pytest.mark.parametrize(
    ("method", "path", "who", "body", "status"),
    ERRORS,
    ids=[f"{m} {p} {s}" for m, p, _, _, s in ERRORS],
)
def test_every_error_has_the_one_json_shape(
    client: TestClient,
    admin: dict[str, str],
    worker: dict[str, str],
    method: str,
    path: str,
    who: str,
    body: Any,
    status: int,
) -> None:
    headers = {
        "nobody": {},
        "stranger": bearer("gf_stranger"),
        "admin": admin,
        "worker": worker,
    }[who]
    if isinstance(body, bytes):
        headers = {**headers, "Content-Type": "application/json"}
        r = client.request(method, path, content=body, headers=headers)
    else:
        r = client.request(method, path, json=body, headers=headers)
    assert_error(r, status)


def test_unknown_route_is_404_not_found(client: TestClient, admin: dict[str, str]) -> None:
    assert_error(client.get("/v1/jobz", headers=admin), 404, "not_found")


def test_wrong_method_is_405_and_says_so(client: TestClient, admin: dict[str, str]) -> None:
    r = client.delete("/v1/jobs", headers=admin)
    error = assert_error(r, 405, "method_not_allowed")
    assert "method not allowed" in error["message"].lower()


def test_wrong_method_405_lists_the_allowed_methods(
    client: TestClient, admin: dict[str, str]
) -> None:
    """RFC 9110 15.5.6: a 405 must send ``Allow``. (src bug: the handler drops exc.headers.)"""
    r = client.delete("/v1/jobs", headers=admin)
    assert r.status_code == 405
    assert "allow" in r.headers, dict(r.headers)
    assert {"GET", "POST"} <= {m.strip() for m in r.headers["allow"].split(",")}


# ---- 404: the message names what was not found ---------------------------------------------


@pytest.mark.parametrize(
    ("method", "suffix"),
    [("GET", ""), ("POST", "/cancel"), ("POST", "/requeue"), ("GET", "/why"), ("GET", "/logs")],
    ids=["show", "cancel", "requeue", "why", "logs"],
)
def test_unknown_job_is_404_naming_it(
    client: TestClient, admin: dict[str, str], method: str, suffix: str
) -> None:
    r = client.request(method, f"/v1/jobs/j-0123456789abcdef{suffix}", headers=admin)
    error = assert_error(r, 404, "not_found", "j-0123456789abcdef")
    assert error["detail"] == {"job": "j-0123456789abcdef"}


def test_unknown_job_by_ambiguous_name_asks_for_the_id(
    client: TestClient, admin: dict[str, str]
) -> None:
    submit(client, admin, name="twin")
    submit(client, admin, name="twin")
    r = client.get("/v1/jobs/twin", headers=admin)
    assert_error(r, 404, "not_found", "twin", "use the job id")


@pytest.mark.parametrize(
    ("method", "suffix", "body"),
    [
        ("POST", "/claim", {"cpu_slots": 1, "wait": 0}),
        ("POST", "/heartbeat", {"leases": []}),
        ("GET", "", None),
        ("POST", "/drain", None),
    ],
    ids=["claim", "heartbeat", "show", "drain"],
)
def test_unknown_worker_is_404_naming_it(
    client: TestClient,
    admin: dict[str, str],
    worker: dict[str, str],
    method: str,
    suffix: str,
    body: Any,
) -> None:
    headers = worker if suffix in ("/claim", "/heartbeat") else admin
    r = client.request(method, f"/v1/workers/w-ghost{suffix}", json=body, headers=headers)
    error = assert_error(r, 404, "not_found", "w-ghost")
    assert error["detail"] == {"worker": "w-ghost"}


def test_lease_write_for_unknown_job_is_404(client: TestClient, worker: dict[str, str]) -> None:
    r = client.post("/v1/jobs/j-ghost/start", json={"attempt": 1}, headers=worker)
    assert_error(r, 404, "not_found", "j-ghost")


# ---- 409: the state forbids the call --------------------------------------------------------


def _run_to_success(client: TestClient, admin: dict[str, str], worker: dict[str, str]) -> str:
    job_id = submit(client, admin, name="done")
    register(client, worker, "cpu-1")
    lease = claim(client, worker, "cpu-1")
    assert lease["job_id"] == job_id
    r = client.post(f"/v1/jobs/{job_id}/start", json={"attempt": 1}, headers=worker)
    assert r.status_code == 204, r.text
    r = client.post(
        f"/v1/jobs/{job_id}/finish", json={"attempt": 1, "exit_code": 0}, headers=worker
    )
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "succeeded"
    return job_id


def test_cancel_of_a_succeeded_job_is_409_and_changes_nothing(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    job_id = _run_to_success(client, admin, worker)
    r = client.post(f"/v1/jobs/{job_id}/cancel", headers=admin)
    error = assert_error(r, 409, "conflict", job_id, "succeeded")
    assert error["detail"] == {"job": job_id, "status": "succeeded"}
    job = client.get(f"/v1/jobs/{job_id}", headers=admin).json()
    assert job["status"] == "succeeded" and job["exit_code"] == 0


def test_requeue_of_a_pending_job_is_409(client: TestClient, admin: dict[str, str]) -> None:
    job_id = submit(client, admin)
    r = client.post(f"/v1/jobs/{job_id}/requeue", headers=admin)
    assert_error(r, 409, "conflict", job_id, "pending", "only a failed or cancelled job")
    assert client.get(f"/v1/jobs/{job_id}", headers=admin).json()["status"] == "pending"


def test_cancel_twice_is_409_then_requeue_works(client: TestClient, admin: dict[str, str]) -> None:
    job_id = submit(client, admin)
    first = client.post(f"/v1/jobs/{job_id}/cancel", headers=admin)
    assert first.status_code == 200 and first.json()["status"] == "cancelled", first.text
    assert_error(client.post(f"/v1/jobs/{job_id}/cancel", headers=admin), 409, "conflict")
    again = client.post(f"/v1/jobs/{job_id}/requeue", headers=admin)
    assert again.status_code == 200 and again.json()["status"] == "pending", again.text


def test_stale_lease_writes_are_409_and_the_job_is_recorded_once(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    job_id = submit(client, admin)
    register(client, worker, "cpu-1")
    lease = claim(client, worker, "cpu-1")
    assert (lease["job_id"], lease["attempt"]) == (job_id, 1)

    # A lease the worker never held.
    for path, body in [
        ("start", {"attempt": 2}),
        ("output", {"attempt": 2, "lines": [{"line": "hello"}]}),
        ("finish", {"attempt": 2, "exit_code": 0}),
        ("release", {"attempt": 2}),
    ]:
        r = client.post(f"/v1/jobs/{job_id}/{path}", json=body, headers=worker)
        error = assert_error(r, 409, "conflict", "stale lease", job_id)
        assert error["detail"]["attempt"] == 2, path

    ok = client.post(f"/v1/jobs/{job_id}/start", json={"attempt": 1}, headers=worker)
    assert ok.status_code == 204, ok.text
    # A retried start (its answer lost on the way) is accepted: the job keeps running.
    again = client.post(f"/v1/jobs/{job_id}/start", json={"attempt": 1}, headers=worker)
    assert again.status_code == 204, again.text
    assert client.get(f"/v1/jobs/{job_id}", headers=admin).json()["status"] == "running"

    # The operator cancels while it runs: the worker is told to stop, its writes are refused.
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=admin).status_code == 200
    beat = client.post(
        "/v1/workers/cpu-1/heartbeat",
        json={"leases": [{"job_id": job_id, "attempt": 1}]},
        headers=worker,
    )
    assert beat.status_code == 200, beat.text
    assert [(o["job_id"], o["order"]) for o in beat.json()["orders"]] == [(job_id, "cancel")]
    for path, body in [
        ("output", {"attempt": 1, "lines": [{"line": "late"}]}),
        ("finish", {"attempt": 1, "exit_code": 0}),
    ]:
        r = client.post(f"/v1/jobs/{job_id}/{path}", json=body, headers=worker)
        assert_error(r, 409, "conflict", "stale lease", "cancelled")

    job = client.get(f"/v1/jobs/{job_id}", headers=admin).json()
    assert job["status"] == "cancelled"
    assert [a["outcome"] for a in job["history"]] == ["cancelled"]
    logs = client.get(f"/v1/jobs/{job_id}/logs", headers=admin).json()
    assert logs["lines"] == []


def test_finishing_twice_is_409(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    job_id = _run_to_success(client, admin, worker)
    r = client.post(
        f"/v1/jobs/{job_id}/finish", json={"attempt": 1, "exit_code": 1}, headers=worker
    )
    assert_error(r, 409, "conflict", "stale lease", "succeeded")
    assert client.get(f"/v1/jobs/{job_id}", headers=admin).json()["status"] == "succeeded"


def test_manifest_with_two_identical_jobs_is_422(client: TestClient, admin: dict[str, str]) -> None:
    job = job_body("same", manifest="m")
    r = client.post("/v1/manifests", json={"name": "m", "jobs": [job, job]}, headers=admin)
    assert_error(r, 422, "validation_error", "two identical jobs")
    assert client.get("/v1/jobs", headers=admin).json() == []
