"""Output quotas through the API, and a database that runs out of space: answered 507, never
a 500 with a traceback, while ``/v1/health`` says degraded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from fastapi import FastAPI

from gpufleet.domain.models import Role
from gpufleet.domain.quota import MARKER, OutputQuota
from gpufleet.server import QueueSettings, create_app
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.store import SqlStore, open_store
from gpufleet.store.blobfiles import BlobFiles
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
KIB = 1024


@pytest.fixture
def settings() -> QueueSettings:
    return QueueSettings(output_quota=OutputQuota(total=16 * KIB, rate=KIB, burst=16 * KIB))


def running(client: TestClient, admin: dict[str, str], worker: dict[str, str]) -> dict[str, Any]:
    """A job claimed by a fresh worker (its lease, with the worker's id)."""
    job_id = submit(client, admin)
    w = register(client, worker, "box")
    lease = claim(client, worker, w["id"])
    assert lease["job_id"] == job_id
    return {**lease, "worker_id": w["id"]}


def test_output_over_its_quota_is_cut_marked_and_audited(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    lease = running(client, admin, worker)
    job_id, attempt = lease["job_id"], lease["attempt"]
    lines = [{"stream": "stdout", "line": f"{n:04d} " + "x" * 1000} for n in range(40)]
    for first in (0, 20):
        body = {"attempt": attempt, "lines": lines[first : first + 20], "first": first}
        r = client.post(f"/v1/jobs/{job_id}/output", json=body, headers=worker)
        assert r.status_code == 204, r.text  # the worker is not told off: the job runs on
    out = client.get(f"/v1/jobs/{job_id}/logs", headers=admin).json()["lines"]
    assert [x["line"][:4] for x in out[:-1]] == [f"{n:04d}" for n in range(len(out) - 1)]
    assert 10 <= len(out) - 1 < 16 and out[-1]["line"].startswith(MARKER)
    assert "output quota of 16 KiB" in out[-1]["line"]
    detail = client.get(f"/v1/jobs/{job_id}", headers=admin).json()
    [attempt_out] = detail["history"]
    assert attempt_out["output_dropped"] > 24 * 1000
    audit = client.get("/v1/audit", headers=admin).json()
    [cut] = [a for a in audit if a["event"] == "job.output_cut"]
    assert cut["target"] == job_id and "output quota of 16 KiB" in cut["detail"]


# ---- a database out of space -------------------------------------------------------------


def failing(errcode: str) -> str:
    """SQL that makes PostgreSQL refuse every write of a job or a log line with
    ``errcode``, as it does when its disk (or another resource) runs out."""
    return f"""
CREATE FUNCTION gpufleet_short() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'could not extend file "base/16384/16385": No space left on device'
        USING ERRCODE = '{errcode}';
END $$;
CREATE TRIGGER short_jobs BEFORE INSERT OR UPDATE ON jobs
    FOR EACH ROW EXECUTE FUNCTION gpufleet_short();
CREATE TRIGGER short_logs BEFORE INSERT ON job_logs
    FOR EACH ROW EXECUTE FUNCTION gpufleet_short();
"""


SPACE_FREED = """
DROP TRIGGER short_jobs ON jobs;
DROP TRIGGER short_logs ON job_logs;
"""


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[SqlStore]:
    store = open_store(pg_url)
    store.migrate()
    yield store
    store.close()


@pytest.fixture
def pg_client(pg_store: SqlStore, tmp_path: Path) -> Iterator[TestClient]:
    from fastapi.testclient import TestClient

    blobs = BlobService(pg_store, BlobFiles(tmp_path / "blobs"), BlobSettings())
    app: FastAPI = create_app(pg_store, QueueSettings(), blobs)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def run_sql(store: SqlStore, sql: str) -> None:
    with store.engine.begin() as conn:
        conn.exec_driver_sql(sql)


def assert_full(r: Any) -> None:
    """A 507 in the one error shape, saying what to do, with no traceback in it."""
    error = assert_error(r, 507, "insufficient_storage", "disk is full", "free space")
    assert "53100" in error["message"]
    assert "Traceback" not in r.text and 'File "' not in r.text
    assert r.headers["retry-after"].isdigit()


def test_postgresql_disk_full_is_507_and_health_degraded_until_a_write_commits(
    pg_store: SqlStore, pg_client: TestClient
) -> None:
    """SQLSTATE 53100 (disk_full) raised by the real PostgreSQL, through its driver: on a
    submit, a heartbeat and an output batch (which goes in by COPY, beneath SQLAlchemy)."""
    auth = Auth(pg_store)
    admin = bearer(auth.create("admin", Role.ADMIN)[1])
    worker = bearer(auth.create("worker", Role.WORKER)[1])
    lease = running(pg_client, admin, worker)
    job_id, attempt = lease["job_id"], lease["attempt"]
    assert pg_client.get("/v1/health").json()["status"] == "ok"
    run_sql(pg_store, failing("disk_full"))

    assert_full(pg_client.post("/v1/jobs", json=job_body(), headers=admin))
    beat = {"leases": [{"job_id": job_id, "attempt": attempt}]}
    assert_full(
        pg_client.post(f"/v1/workers/{lease['worker_id']}/heartbeat", json=beat, headers=worker)
    )
    secret = lease["secret"]
    lines = {"attempt": attempt, "secret": secret, "lines": [{"stream": "stdout", "line": "hi"}]}
    assert_full(pg_client.post(f"/v1/jobs/{job_id}/output", json=lines, headers=worker))
    start = {"kind": "start", "job_id": job_id, "attempt": attempt, "secret": secret}
    r = pg_client.post("/v1/reports", json={"reports": [start]}, headers=worker)
    [result] = r.json()["results"]  # each report its own answer: this one's is a 507
    assert (result["status"], result["error"]["code"]) == (507, "insufficient_storage")
    health = pg_client.get("/v1/health")
    assert health.status_code == 200
    assert health.json()["status"] == "degraded"
    assert any("disk is full" in p for p in health.json()["problems"])

    run_sql(pg_store, SPACE_FREED)
    submit(pg_client, admin)
    assert pg_client.get("/v1/health").json() == {
        **health.json(),
        "status": "ok",
        "problems": [],
    }


def test_postgresql_short_of_another_resource_is_503_with_retry_after(
    pg_store: SqlStore, pg_client: TestClient
) -> None:
    """Class 53 but not disk_full (here too_many_connections): 503 and ``Retry-After``;
    the disk is not full, so health stays ok."""
    admin = bearer(Auth(pg_store).create("admin", Role.ADMIN)[1])
    run_sql(pg_store, failing("too_many_connections"))
    r = pg_client.post("/v1/jobs", json=job_body(), headers=admin)
    assert_error(r, 503, "server_unavailable", "53300", "retry later")
    assert r.headers["retry-after"].isdigit() and "Traceback" not in r.text
    assert pg_client.get("/v1/health").json()["status"] == "ok"
