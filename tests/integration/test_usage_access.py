"""``GET /v1/usage`` for a pool-scoped submitter: only its pools' users, and a clear 4xx
for every bad query value."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from gpufleet.domain.models import Role
from gpufleet.server.auth import Auth
from gpufleet.store import SqlStore
from tests.integration.helpers import (
    TESTCLIENT_ON_HTTPX,
    assert_error,
    bearer,
    claim,
    register,
    submit,
)

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX


@pytest.mark.parametrize(
    "query",
    [
        "window_hours=nan",
        "window_hours=inf",
        "window_hours=-inf",
        "window_hours=0",
        "window_hours=-1",
        "window_hours=1e400",
        "window_hours=9000",
        "window_hours=abc",
        "pool=" + "p" * 201,
    ],
)
def test_bad_query_values_are_422(client: TestClient, admin: dict[str, str], query: str) -> None:
    r = client.get(f"/v1/usage?{query}", headers=admin)
    assert_error(r, 422)


def test_a_pool_scoped_submitter_sees_only_its_pools_users(
    client: TestClient, admin: dict[str, str], store: SqlStore
) -> None:
    auth = Auth(store)
    alice = bearer(auth.create("alice", Role.SUBMITTER, ["a"])[1])
    bob = bearer(auth.create("bob-secret-project", Role.SUBMITTER, ["b"])[1])
    worker_b = bearer(auth.create("wb", Role.WORKER, ["b"])[1])
    wid = register(client, worker_b, "wb")["id"]
    job = submit(client, bob, name="b-job", pool="b")
    lease = claim(client, worker_b, wid)
    started = client.post(
        f"/v1/jobs/{job}/start", json={"attempt": lease["attempt"]}, headers=worker_b
    )
    assert started.status_code == 204, started.text
    submit(client, alice, name="a-job", pool="a")
    everyone = client.get("/v1/usage", headers=admin)
    assert everyone.status_code == 200
    assert {r["pool"] for r in everyone.json()["rows"]} == {"b"}
    seen = client.get("/v1/usage", headers=alice)
    assert seen.status_code == 200
    assert seen.json()["rows"] == []
    assert "bob-secret-project" not in seen.text
    assert_error(client.get("/v1/usage?pool=b", headers=alice), 404)
