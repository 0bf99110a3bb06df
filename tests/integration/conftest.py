"""The API in-process: a migrated store per test (SQLite, or PostgreSQL with
``GPUFLEET_TEST_BACKENDS``), the app over it, and tokens.

``fastapi.testclient`` is imported inside the ``client`` fixture, not at module level: its
import warns (starlette wants ``httpx2``), and each test module ignores exactly that warning
with ``pytestmark`` (see ``helpers.TESTCLIENT_ON_HTTPX``), which only applies while a test runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import pytest
from fastapi import FastAPI

from gpufleet.domain.models import Role
from gpufleet.server import QueueSettings, create_app
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.store import SqlStore, open_store
from gpufleet.store.blobfiles import BlobFiles
from tests.integration.helpers import bearer

if TYPE_CHECKING:
    from fastapi.testclient import TestClient


@pytest.fixture
def store(database: str | None, tmp_path: Path) -> Iterator[SqlStore]:
    """A migrated store on the test's backend (a SQLite file, or a PostgreSQL schema)."""
    store = open_store(database or f"sqlite:///{tmp_path}/db.sqlite")
    store.migrate()
    yield store
    store.close()


@pytest.fixture
def settings() -> QueueSettings:
    return QueueSettings(lease_timeout=120.0, retry_backoff=10.0)


@pytest.fixture
def blob_settings() -> BlobSettings:
    return BlobSettings()


@pytest.fixture
def app(
    store: SqlStore, settings: QueueSettings, blob_settings: BlobSettings, tmp_path: Path
) -> FastAPI:
    blobs = BlobService(store, BlobFiles(tmp_path / "blobs"), blob_settings)
    return create_app(store, settings, blobs)


@pytest.fixture
def admin_token(store: SqlStore) -> str:
    return Auth(store).create("admin", Role.ADMIN)[1]


@pytest.fixture
def worker_token(store: SqlStore) -> str:
    return Auth(store).create("worker", Role.WORKER)[1]


@pytest.fixture
def admin(admin_token: str) -> dict[str, str]:
    """Headers for an admin caller."""
    return bearer(admin_token)


@pytest.fixture
def worker(worker_token: str) -> dict[str, str]:
    """Headers for a worker-role caller."""
    return bearer(worker_token)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    """A client with no default token; the lifespan (lease sweeper) runs for the test.

    Server exceptions become 500 answers, as a user would see them, not test-side raises.
    Like a worker, it sends each attempt's secret with that attempt's writes (see
    :func:`holding_secrets`), unless the test gives one itself (None: send none).
    """
    from fastapi.testclient import TestClient

    class Holding(TestClient):
        def request(self, method: str, url: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            kwargs["json"] = holding_secrets(app, str(url), kwargs.get("json"))
            return super().request(method, url, **kwargs)

    with Holding(app, raise_server_exceptions=False) as c:
        yield c


_WRITE = re.compile(r"/v1/jobs/([^/]+)/(start|output|finish|release|artifact|checkpoints)$")


def holding_secrets(app: FastAPI, url: str, body: Any) -> Any:
    """``body`` with the secret of the attempt it writes for, as the worker holding that
    attempt would send it, where the body names an attempt and no secret."""
    services = app.state.gpufleet.services

    def held(job_id: str, part: dict[str, Any]) -> dict[str, Any]:
        attempt = part.get("attempt")
        if "secret" in part or not isinstance(attempt, int) or not isinstance(job_id, str):
            return part
        job = services.store.get_job(job_id)
        if job is None or job.claimed_at is None or job.lease != attempt:
            return part
        return {**part, "secret": services.holders.secrets.make(job_id, attempt, job.claimed_at)}

    if not isinstance(body, dict):
        return body
    found = _WRITE.search(urlsplit(url).path)
    if found:
        return held(unquote(found.group(1)), body)
    if urlsplit(url).path.endswith("/v1/reports") and isinstance(body.get("reports"), list):
        reports = [held(r.get("job_id"), r) if isinstance(r, dict) else r for r in body["reports"]]
        return {**body, "reports": reports}
    return body
