"""Faults a user can find: every answer names its request, a crash is answered and logged
once with that name, and the access log (when on) has a line per request."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpufleet.server import QueueSettings, create_app
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.store import SqlStore
from gpufleet.store.blobfiles import BlobFiles
from tests.integration.helpers import TESTCLIENT_ON_HTTPX, assert_error

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX


def _crash(*_: object) -> None:
    raise RuntimeError("the disk caught fire")


def _records(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == name]


def test_a_crash_is_answered_in_the_error_shape_and_logged_once_with_its_request_id(
    app: FastAPI,
    client: TestClient,
    admin: dict[str, str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(app.state.gpufleet.services.reads, "jobs", _crash)
    with caplog.at_level(logging.INFO):
        r = client.get("/v1/jobs", headers=admin)
    rid = r.headers["x-request-id"]
    error = assert_error(r, 500, "internal_error", f"request id {rid}", "see the server log")
    assert error["detail"] == {"request_id": rid}
    assert "fire" not in r.text  # the cause is the operator's to read, not the caller's
    [logged] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert rid in logged.getMessage() and "GET /v1/jobs" in logged.getMessage()
    assert logged.exc_info and "the disk caught fire" in str(logged.exc_info[1])
    assert _records(caplog, "gpufleet.access") == []  # the access log is off by default


def test_every_answer_carries_a_request_id_and_a_sane_one_from_the_client_is_kept(
    client: TestClient, admin: dict[str, str]
) -> None:
    ids = {client.get("/v1/health").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3 and all(len(i) == 16 for i in ids)
    refused = client.get("/v1/jobs/nope", headers={**admin, "X-Request-Id": "lb-7f3a.01"})
    assert refused.status_code == 404 and refused.headers["x-request-id"] == "lb-7f3a.01"
    odd = client.get("/v1/health", headers={"X-Request-Id": "a b\tc" + "x" * 70})
    assert odd.headers["x-request-id"] != "a b\tc" + "x" * 70


@pytest.fixture
def logged_app(store: SqlStore, tmp_path: Path) -> FastAPI:
    blobs = BlobService(store, BlobFiles(tmp_path / "blobs"), BlobSettings())
    return create_app(store, QueueSettings(lease_timeout=120.0), blobs, access_log=True)


def test_the_access_log_has_a_line_per_request_with_status_latency_and_id(
    logged_app: FastAPI, admin: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    from fastapi.testclient import TestClient

    with TestClient(logged_app) as client, caplog.at_level(logging.INFO, "gpufleet.access"):
        ok = client.get("/v1/jobs", headers=admin)
        missing = client.get("/v1/jobs/j-none%0Aforged", headers=admin)
    lines = [r.getMessage() for r in _records(caplog, "gpufleet.access")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("testclient GET /v1/jobs 200 ")
    assert lines[0].endswith(f"ms request {ok.headers['x-request-id']}")
    assert lines[1].startswith("testclient GET /v1/jobs/j-none\\nforged 404 ")
    assert missing.headers["x-request-id"] in lines[1]
