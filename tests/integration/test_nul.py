"""A NUL, over-long text or odd Unicode (invalid UTF-8, surrogates, controls) in a path or
query answers 4xx naming where, on SQLite and on PostgreSQL alike (PostgreSQL cannot store
a NUL in text: those requests answered 500)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpufleet.domain.models import Role
from gpufleet.server import QueueSettings, create_app
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.store import open_store
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
    store = open_store(url)
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


LONG = "a" * 20_000  # a proxy would refuse it (8 KiB); a client may still send it
ODD = [
    "%FF%FE",  # not UTF-8 at all
    "%ED%A0%80",  # a UTF-16 surrogate, encoded as UTF-8 (invalid)
    "%C0%80",  # an over-long encoding of NUL
    "%E2%80%AE%E2%80%8B",  # right-to-left override, zero-width space
    "%F0%9F%98%80" * 50,  # emoji, four bytes each
    "%EF%BF%BF",  # a noncharacter
    "x%0Ay%0D",  # line breaks
]


PATHS = [
    "/v1/jobs/{}",
    "/v1/jobs/{}/why",
    "/v1/jobs/{}/logs",
    "/v1/jobs/{}/artifact",
    "/v1/workers/{}",
    "/v1/jobs?status={}",
    "/v1/jobs?status=running,{}",
    "/v1/workers?pool={}",
    "/v1/audit?since={}",
    "/v1/jobs/{}/cancel",
]


def test_over_long_or_odd_text_in_a_path_or_query_is_a_4xx(
    served: tuple[TestClient, str],
) -> None:
    """Text no job, worker or pool can be named answers 404 (not there) or 422 (not a
    valid value), in the error shape; never a 5xx, on either database. (One store per
    database for all of them: each case is a read, or a refused change.)"""
    client, token = served
    wrong = []
    for template in PATHS:
        for odd in [*ODD, LONG]:
            path = template.format(odd)
            method = client.post if path.endswith("/cancel") else client.get
            r = method(path, headers=bearer(token))
            if not 400 <= r.status_code < 500 or set(r.json()) != {"error"}:
                wrong.append((path[:120], r.status_code, r.text[:200]))
    assert wrong == []
