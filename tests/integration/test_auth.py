"""Bearer tokens over HTTP: who gets in, what each role may do, and the token lifecycle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from gpufleet.domain.models import Role
from gpufleet.server.auth import Auth, digest
from gpufleet.store import SqlStore
from tests.integration.helpers import TESTCLIENT_ON_HTTPX, assert_error, bearer, job_body

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX


# ---- who gets in --------------------------------------------------------------------------


def test_no_token_is_401_and_says_how_to_send_one(client: TestClient) -> None:
    error = assert_error(client.get("/v1/jobs"), 401, "unauthorized")
    assert "Authorization: Bearer <token>" in error["message"]


def test_wrong_token_is_401(client: TestClient) -> None:
    r = client.get("/v1/jobs", headers=bearer("gf_not-a-real-token"))
    assert_error(r, 401, "unauthorized", "invalid or revoked token")


@pytest.mark.parametrize(
    "header",
    ["Bearer", "Token gf_abc", "Basic dXNlcjpwYXNzd29yZA==", "gf_abc", "bearer\tgf_abc"],
    ids=["scheme-only", "other-scheme", "basic-auth", "no-scheme", "tab-separated"],
)
def test_malformed_authorization_header_is_401(client: TestClient, header: str) -> None:
    r = client.get("/v1/jobs", headers={"Authorization": header})
    assert_error(r, 401, "unauthorized", "Bearer <token>")


def test_the_admin_token_gets_in(client: TestClient, admin: dict[str, str]) -> None:
    r = client.get("/v1/jobs", headers=admin)
    assert r.status_code == 200, r.text
    assert r.json() == []


def test_token_revoked_in_the_store_is_401(client: TestClient, store: SqlStore) -> None:
    row, secret = Auth(store).create("ci", Role.OPERATOR)
    assert store.revoke_token(row.id, 1.0)
    assert_error(client.get("/v1/jobs", headers=bearer(secret)), 401, "unauthorized")


def test_health_needs_no_token_and_names_the_database(client: TestClient, backend: str) -> None:
    r = client.get("/v1/health")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ok"
    assert body["database"] == backend
    assert body["version"]


# ---- what each role may do ----------------------------------------------------------------


def test_worker_token_may_not_apply_a_manifest(
    client: TestClient, worker: dict[str, str], admin: dict[str, str]
) -> None:
    plan = {"name": "m", "jobs": [job_body("a", manifest="m")]}
    error = assert_error(client.post("/v1/manifests", json=plan, headers=worker), 403, "forbidden")
    assert "worker token" in error["message"]
    assert "needs: admin, operator" in error["message"]
    assert client.get("/v1/jobs", headers=admin).json() == []


def test_worker_token_may_not_create_tokens(
    client: TestClient, worker: dict[str, str], admin: dict[str, str]
) -> None:
    before = client.get("/v1/tokens", headers=admin).json()
    r = client.post("/v1/tokens", json={"name": "sneaky", "role": "admin"}, headers=worker)
    error = assert_error(r, 403, "forbidden")
    assert "needs: admin" in error["message"]
    assert client.get("/v1/tokens", headers=admin).json() == before


def test_worker_token_may_not_read_the_queue(client: TestClient, worker: dict[str, str]) -> None:
    error = assert_error(client.get("/v1/jobs", headers=worker), 403, "forbidden")
    assert "operator" in error["message"] and "submitter" in error["message"]


def test_submitter_may_submit_but_not_apply_a_manifest(
    client: TestClient, store: SqlStore, admin: dict[str, str]
) -> None:
    submitter = bearer(Auth(store).create("alice", Role.SUBMITTER, ["default"])[1])
    r = client.post("/v1/jobs", json=job_body(), headers=submitter)
    assert r.status_code == 201, r.text
    plan = {"name": "m", "jobs": [job_body("a", manifest="m")]}
    r = client.post("/v1/manifests", json=plan, headers=submitter)
    assert_error(r, 403, "forbidden", "needs: admin, operator")
    assert [j["name"] for j in client.get("/v1/jobs", headers=admin).json()] == ["train"]


def test_client_token_may_not_speak_the_worker_protocol(
    client: TestClient, store: SqlStore
) -> None:
    operator = bearer(Auth(store).create("ops", Role.OPERATOR)[1])
    r = client.post(
        "/v1/workers",
        json={"name": "w", "capability": {"hostname": "w", "cores": 1, "ram_mib": 1024}},
        headers=operator,
    )
    assert_error(r, 403, "forbidden", "needs: admin, worker")


# ---- token lifecycle ----------------------------------------------------------------------


def test_token_secret_is_shown_once_and_never_listed(
    client: TestClient, admin: dict[str, str], admin_token: str
) -> None:
    r = client.post("/v1/tokens", json={"name": "ci", "role": "operator"}, headers=admin)
    assert r.status_code == 201, r.text
    created = r.json()
    secret = created["token"]
    assert secret.startswith("gf_")
    assert created["name"] == "ci" and created["role"] == "operator"
    assert created["revoked_at"] is None

    # The new secret works at once.
    assert client.get("/v1/jobs", headers=bearer(secret)).status_code == 200

    listed = client.get("/v1/tokens", headers=admin)
    assert listed.status_code == 200, listed.text
    rows = listed.json()
    assert {t["id"] for t in rows} >= {created["id"]}
    for row in rows:
        assert "token" not in row and "hash" not in row
    for leaked in (secret, digest(secret), admin_token, digest(admin_token)):
        assert leaked not in listed.text


def test_revoking_a_token_locks_it_out_at_once(client: TestClient, admin: dict[str, str]) -> None:
    created = client.post(
        "/v1/tokens", json={"name": "laptop", "role": "operator"}, headers=admin
    ).json()
    secret = bearer(created["token"])
    # Used once, so the server has it in its short lookup cache.
    assert client.get("/v1/jobs", headers=secret).status_code == 200

    r = client.delete(f"/v1/tokens/{created['id']}", headers=admin)
    assert r.status_code == 200, r.text
    assert r.json()["revoked_at"] and "token" not in r.json()  # never the secret again

    assert_error(client.get("/v1/jobs", headers=secret), 401, "unauthorized", "revoked")
    listed = {t["id"]: t for t in client.get("/v1/tokens", headers=admin).json()}
    assert listed[created["id"]]["revoked_at"] is not None

    # Revoking again: it is no longer an active token.
    again = client.delete(f"/v1/tokens/{created['id']}", headers=admin)
    assert_error(again, 404, "not_found", created["id"])


def test_revoking_a_worker_token_ends_its_waiting_claim_poll(client: TestClient) -> None:
    """A worker's long-poll waits up to its ``wait``; a revoke of its token ends it at
    once (nothing is handed to a token that no longer gets in), and the next poll is 401.
    Without the hold the poll waited its whole 20 s."""
    import asyncio

    from tests.integration.helpers import asgi, on_loop, register, until

    st = client.app.state.gpufleet  # type: ignore[attr-defined]
    row, secret = st.auth.create("box", Role.WORKER, ["default"])
    worker = register(client, bearer(secret), "box")["id"]
    body = {"cpu_slots": 1, "wait": 20}

    async def scenario() -> tuple[int, float, int]:
        async with asgi(client.app) as c:  # type: ignore[arg-type]
            path = f"/v1/workers/{worker}/claim"
            poll = asyncio.create_task(c.post(path, json=body, headers=bearer(secret)))
            await until(lambda: len(st.holds) == 1, "the poll to wait")
            loop = asyncio.get_running_loop()
            started = loop.time()
            await asyncio.to_thread(st.auth.revoke, row.id)
            answer = await poll
            took = loop.time() - started
            again = await c.post(path, json=body, headers=bearer(secret))
            return answer.status_code, took, again.status_code

    status, took, again = on_loop(client, scenario)
    assert status == 204 and took < 2.0, (status, took)
    assert again == 401


def test_revoking_an_unknown_token_is_404(client: TestClient, admin: dict[str, str]) -> None:
    assert_error(client.delete("/v1/tokens/t-nope", headers=admin), 404, "not_found", "t-nope")


def test_token_with_unknown_role_is_422(client: TestClient, admin: dict[str, str]) -> None:
    before = client.get("/v1/tokens", headers=admin).json()
    r = client.post("/v1/tokens", json={"name": "x", "role": "root"}, headers=admin)
    assert_error(r, 422, "validation_error", "role")
    assert client.get("/v1/tokens", headers=admin).json() == before


def test_a_burst_of_wrong_tokens_never_stalls_the_event_loop(
    app: FastAPI, store: SqlStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A token not in the cache is read from the database in a thread. Here each read
    takes 200 ms (a drained PostgreSQL pool waits like that), and asyncio's debug mode
    reports any step of the loop over 150 ms. Read on the loop, each of ten wrong tokens
    at once stalled it for the whole read: ten reports. Off the loop there are none; one
    is allowed, for a pause of a busy CI machine that has nothing to do with tokens."""
    import asyncio
    import logging
    import time

    import httpx

    real = store.token_by_hash

    def slow(digest_: str) -> Any:
        time.sleep(0.2)
        return real(digest_)

    monkeypatch.setattr(store, "token_by_hash", slow)

    async def burst() -> list[int]:
        asyncio.get_running_loop().slow_callback_duration = 0.15
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            await c.get("/v1/jobs", headers=bearer("gf_warm_up"))  # the first call's setup
            answers = await asyncio.gather(
                *(c.get("/v1/jobs", headers=bearer(f"gf_wrong{n:02d}")) for n in range(10))
            )
        return [a.status_code for a in answers]

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        statuses = asyncio.run(burst(), debug=True)
    assert statuses == [401] * 10
    stalls = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert len(stalls) <= 1, stalls
