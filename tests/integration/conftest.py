"""The API in-process: a migrated store per test (SQLite, or PostgreSQL with
``GPUFLEET_TEST_BACKENDS``), the app over it, and tokens.

``fastapi.testclient`` is imported inside the ``client`` fixture, not at module level: its
import warns (starlette wants ``httpx2``), and each test module ignores exactly that warning
with ``pytestmark`` (see ``helpers.TESTCLIENT_ON_HTTPX``), which only applies while a test runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from fastapi import FastAPI

from gpufleet.domain.models import Role
from gpufleet.server import QueueSettings, create_app
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.store import SqlStore
from gpufleet.store.blobfiles import BlobFiles
from tests.integration.helpers import bearer

if TYPE_CHECKING:
    from fastapi.testclient import TestClient


@pytest.fixture
def store(database: str | None, tmp_path: Path) -> Iterator[SqlStore]:
    """A migrated store on the test's backend (a SQLite file, or a PostgreSQL schema)."""
    store = SqlStore(database or f"sqlite:///{tmp_path}/db.sqlite")
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
    """
    from fastapi.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
