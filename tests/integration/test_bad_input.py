"""A client's mistake is a 4xx that names the field, never a 5xx, and writes nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from gpufleet.store import SqlStore
from tests.integration.helpers import (
    TESTCLIENT_ON_HTTPX,
    assert_error,
    claim,
    gpu,
    job_body,
    register,
    submit,
    worker_body,
)

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX

TOO_BIG = 2**63  # one past the largest SQL BIGINT


def _no_jobs(client: TestClient, admin: dict[str, str]) -> None:
    r = client.get("/v1/jobs", headers=admin)
    assert r.status_code == 200, r.text
    assert r.json() == []


# ---- POST /v1/jobs ------------------------------------------------------------------------

BAD_JOBS: list[tuple[str, dict[str, Any], str]] = [
    (
        "negative-vram",
        job_body(requirements={"min_vram_gib": -1}),
        "requirements.min_vram_gib",
    ),
    (
        "misspelt-requirement",
        job_body(requirements={"require_cude": True}),
        "requirements.require_cude",
    ),
    ("unknown-top-level-field", job_body(comand=["x"]), "comand"),
    ("empty-command", job_body(command=[]), "command"),
    ("no-command", {"name": "x"}, "command"),
    ("empty-name", job_body(name=""), "name"),
    ("command-is-a-string", job_body(command="python train.py"), "command"),
    ("priority-is-a-word", job_body(priority="high"), "priority"),
    ("requirements-is-a-list", job_body(requirements=["cuda"]), "requirements"),
    ("gpu-count-is-a-float", job_body(requirements={"gpu_count": 1.5}), "requirements.gpu_count"),
    ("env-value-is-a-number", job_body(env={"SEED": 1}), "env.SEED"),
    ("zero-attempts", job_body(max_attempts=0), "max_attempts"),
    ("negative-timeout", job_body(timeout=-5), "timeout"),
    ("huge-priority", job_body(priority=TOO_BIG), "priority"),
]


@pytest.mark.parametrize(("body", "field"), [b[1:] for b in BAD_JOBS], ids=[b[0] for b in BAD_JOBS])
def test_bad_job_is_422_naming_the_field_and_writes_nothing(
    client: TestClient, admin: dict[str, str], body: dict[str, Any], field: str
) -> None:
    r = client.post("/v1/jobs", json=body, headers=admin)
    error = assert_error(r, 422, "validation_error", field)
    assert error["message"].startswith(f"invalid request: {field}:"), error["message"]
    assert field in [p["field"] for p in error["detail"]]
    _no_jobs(client, admin)


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b'{"name": "x", "command": ["a"]', b"", b"[1, 2", b"\xff\xfe"],
    ids=["garbage", "truncated", "empty", "open-list", "not-utf8"],
)
def test_malformed_json_is_422_and_writes_nothing(
    client: TestClient, admin: dict[str, str], raw: bytes
) -> None:
    headers = {**admin, "Content-Type": "application/json"}
    r = client.post("/v1/jobs", content=raw, headers=headers)
    assert_error(r, 422, "validation_error")
    _no_jobs(client, admin)


@pytest.mark.parametrize("body", [[], "job", 3, None], ids=["list", "string", "number", "null"])
def test_body_that_is_not_an_object_is_422(
    client: TestClient, admin: dict[str, str], body: Any
) -> None:
    assert_error(client.post("/v1/jobs", json=body, headers=admin), 422, "validation_error")
    _no_jobs(client, admin)


def test_every_problem_is_listed_in_detail(client: TestClient, admin: dict[str, str]) -> None:
    body = {"name": "", "command": [], "requirements": {"min_vram_gib": -1}}
    error = assert_error(client.post("/v1/jobs", json=body, headers=admin), 422)
    fields = {p["field"] for p in error["detail"]}
    assert {"name", "command", "requirements.min_vram_gib"} <= fields
    assert "more)" in error["message"]


# ---- GET /v1/jobs -------------------------------------------------------------------------


@pytest.mark.parametrize("status", ["bogus", "pending,bogus", "PENDING"])
def test_unknown_status_filter_is_422_naming_it(
    client: TestClient, admin: dict[str, str], status: str
) -> None:
    bad = "bogus" if "bogus" in status else status
    r = client.get("/v1/jobs", params={"status": status}, headers=admin)
    error = assert_error(r, 422, "validation_error", repr(bad), "pending")
    assert error["detail"] == {"field": "status"}


@pytest.mark.parametrize("limit", ["0", "-1", "many", "100001"])
def test_bad_limit_is_422(client: TestClient, admin: dict[str, str], limit: str) -> None:
    r = client.get("/v1/jobs", params={"limit": limit}, headers=admin)
    assert_error(r, 422, "validation_error", "limit")


def test_known_status_filter_works(client: TestClient, admin: dict[str, str]) -> None:
    job_id = submit(client, admin)
    r = client.get("/v1/jobs", params={"status": "pending, running"}, headers=admin)
    assert [j["id"] for j in r.json()] == [job_id]
    assert client.get("/v1/jobs", params={"status": "failed"}, headers=admin).json() == []


# ---- POST /v1/manifests -------------------------------------------------------------------


def test_manifest_job_from_another_manifest_is_422_and_writes_nothing(
    client: TestClient, admin: dict[str, str], store: SqlStore
) -> None:
    plan = {
        "name": "sweep",
        "hosts": [{"name": "lab-1", "priority": 1}],
        "jobs": [job_body("a", manifest="sweep"), job_body("b", manifest="other")],
    }
    r = client.post("/v1/manifests", json=plan, headers=admin)
    error = assert_error(r, 422, "validation_error", "'b'", "'other'", "'sweep'")
    assert error["detail"] == {"job": "b", "field": "manifest"}
    _no_jobs(client, admin)
    assert store.hosts() == []


def test_manifest_job_without_manifest_name_is_422(
    client: TestClient, admin: dict[str, str]
) -> None:
    r = client.post("/v1/manifests", json={"name": "m", "jobs": [job_body("a")]}, headers=admin)
    assert_error(r, 422, "validation_error", "manifest is None")
    _no_jobs(client, admin)


def test_manifest_with_bad_job_field_is_422_naming_the_path(
    client: TestClient, admin: dict[str, str]
) -> None:
    plan = {"name": "m", "jobs": [job_body("a", manifest="m", requirements={"gpu_count": -1})]}
    r = client.post("/v1/manifests", json=plan, headers=admin)
    assert_error(r, 422, "validation_error", "jobs.0.requirements.gpu_count")
    _no_jobs(client, admin)


# ---- POST /v1/workers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "w"}, "capability"),
        (worker_body("w", gpus=[{**gpu(), "total_mib": -1}]), "capability.gpus.0.total_mib"),
        (worker_body("w", cpu_slots=-1), "cpu_slots"),
        (worker_body("w", colour="blue"), "colour"),
    ],
    ids=["no-capability", "negative-vram", "negative-slots", "unknown-field"],
)
def test_bad_worker_registration_is_422_and_registers_nothing(
    client: TestClient,
    admin: dict[str, str],
    worker: dict[str, str],
    body: dict[str, Any],
    field: str,
) -> None:
    r = client.post("/v1/workers", json=body, headers=worker)
    assert_error(r, 422, "validation_error", field)
    assert client.get("/v1/workers", headers=admin).json() == []


def test_claim_wait_over_a_minute_is_422(client: TestClient, worker: dict[str, str]) -> None:
    register(client, worker, "cpu-1")
    r = client.post("/v1/workers/cpu-1/claim", json={"cpu_slots": 1, "wait": 61}, headers=worker)
    assert_error(r, 422, "validation_error", "wait")


# ---- integers too large for the database (src bugs: 500 today) -----------------------------
#
# The wire models bound some integers (priority, gpu_count) but not these; a value past
# 2**63 - 1 reaches SQLite (or PostgreSQL) and the server answers 500 internal_error.


def test_logs_after_beyond_bigint_is_not_a_server_error(
    client: TestClient, admin: dict[str, str]
) -> None:
    job_id = submit(client, admin)
    r = client.get(f"/v1/jobs/{job_id}/logs", params={"after": str(TOO_BIG)}, headers=admin)
    assert r.status_code < 500, r.text
    assert_error(r, 422, "validation_error", "after")


def test_heartbeat_with_huge_lease_attempt_is_not_a_server_error(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    job_id = submit(client, admin)
    register(client, worker, "cpu-1")
    body = {"leases": [{"job_id": job_id, "attempt": TOO_BIG}]}
    r = client.post("/v1/workers/cpu-1/heartbeat", json=body, headers=worker)
    assert r.status_code < 500, r.text
    assert_error(r, 422, "validation_error", "leases.0.attempt")


def test_output_with_huge_attempt_is_not_a_server_error(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    job_id = submit(client, admin)
    body = {"attempt": TOO_BIG, "lines": [{"line": "x"}]}
    r = client.post(f"/v1/jobs/{job_id}/output", json=body, headers=worker)
    assert r.status_code < 500, r.text
    assert r.status_code in (409, 422), r.text
    assert_error(r, r.status_code)


def test_register_with_huge_running_attempt_is_422_and_registers_nothing(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    body = worker_body("cpu-1", running=[{"job_id": "j-0123456789abcdef", "attempt": TOO_BIG}])
    r = client.post("/v1/workers", json=body, headers=worker)
    assert r.status_code < 500, r.text
    assert_error(r, 422, "validation_error", "running.0.attempt")
    assert client.get("/v1/workers", headers=admin).json() == []


def test_finish_with_huge_exit_code_is_not_a_server_error(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    job_id = submit(client, admin)
    register(client, worker, "cpu-1")
    claim(client, worker, "cpu-1")
    body = {"attempt": 1, "exit_code": TOO_BIG}
    r = client.post(f"/v1/jobs/{job_id}/finish", json=body, headers=worker)
    assert r.status_code < 500, r.text
    assert_error(r, 422, "validation_error", "exit_code")
    assert client.get(f"/v1/jobs/{job_id}", headers=admin).json()["status"] == "claimed"


# ---- a float that overflows in matching (src bug: 500, and the bad policy is kept) --------


def test_manifest_host_with_absurd_vram_is_422_and_does_not_poison_the_server(
    client: TestClient, admin: dict[str, str], worker: dict[str, str], store: SqlStore
) -> None:
    """``declared.vram_gib`` has no upper bound on the wire (the TOML parser has one).

    1e308 GiB * 1024 overflows to inf in ``effective_gpus``; int(inf) raises. Today the
    manifest answers 500 after its host policy was already written, so every later call
    that matches GPU jobs on that host (``/v1/status``, claims, ``why``) answers 500 too.
    """
    register(client, worker, "gpu-1", gpus=[gpu(gib=8)])
    plan = {
        "name": "m",
        "hosts": [{"name": "gpu-1", "declared": {"vram_gib": 1e308}}],
        "jobs": [job_body("a", manifest="m", requirements={"require_cuda": True})],
    }
    r = client.post("/v1/manifests", json=plan, headers=admin)
    status = client.get("/v1/status", headers=admin)
    assert (r.status_code, status.status_code) == (422, 200), (r.text, status.text)
    assert_error(r, 422, "validation_error", "vram_gib")
    assert store.hosts() == []
