"""A NUL in a path or query answers 422 naming where, on SQLite and on PostgreSQL alike
(PostgreSQL cannot store it in text: those requests answered 500)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpufleet.domain.models import Role
from gpufleet.server import QueueSettings, create_app
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.store import SqlStore
from gpufleet.store.blobfiles import BlobFiles
from tests.integration.helpers import TESTCLIENT_ON_HTTPX, bearer

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX


@pytest.fixture(params=["sqlite", "postgresql"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[TestClient, str]]:
    """The app over a fresh store of each database, and an admin token."""
    from fastapi.testclient import TestClient

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/db.sqlite"
    else:
        url = request.getfixturevalue("pg_url")
    store = SqlStore(url)
    store.migrate()
    blobs = BlobService(store, BlobFiles(tmp_path / "blobs"), BlobSettings())
    app = create_app(store, QueueSettings(lease_timeout=120.0), blobs)
    token = Auth(store).create("admin", Role.ADMIN)[1]
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client, token
    finally:
        store.close()


@pytest.mark.parametrize(
    ("path", "where"),
    [
        ("/v1/jobs/abc%00def", "path"),
        ("/v1/jobs/abc%00def/why", "path"),
        ("/v1/jobs/abc%00def/logs", "path"),
        ("/v1/workers/x%00y", "path"),
        ("/v1/jobs?status=pend%00ing", "query.status"),
        ("/v1/workers?pool=a%00b", "query.pool"),
    ],
)
def test_a_nul_in_a_path_or_query_is_a_422_naming_where(
    served: tuple[TestClient, str], path: str, where: str
) -> None:
    client, token = served
    r = client.get(path, headers=bearer(token))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["detail"] == {"field": where}
    assert where in error["message"] and "NUL" in error["message"]
    # and the same reference without the NUL is simply not there (or listed)
    assert client.get(path.replace("%00", ""), headers=bearer(token)).status_code in (200, 404)
