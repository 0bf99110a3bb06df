"""The dashboard's server side: its page and files, sign-in by session cookie with a CSRF
token, the security headers, and the paged job list and event log it reads."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpufleet.domain.models import Role
from gpufleet.server import QueueSettings, create_app
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.server.gate import SESSION_COOKIE
from gpufleet.store import SqlStore
from gpufleet.store.blobfiles import BlobFiles
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


def _sign_in(client: TestClient, token: str) -> str:
    """Sign in; the session's CSRF token (the cookie stays in the client)."""
    r = client.post("/v1/session", json={"token": token})
    assert r.status_code == 200, r.text
    csrf: str = r.json()["csrf"]
    return csrf


def test_the_page_and_its_files_are_served_with_a_policy_that_runs_no_inline_script(
    client: TestClient,
) -> None:
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    # every script is a file of the server's own, none inline
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", r.text, re.S)
    assert scripts and all("src=" in attrs and not body.strip() for attrs, body in scripts)
    assert re.search(r"\son[a-z]+=", r.text) is None  # no inline event handlers
    files = ("/ui/app.js", "/ui/job.js", "/ui/admin.js", "/ui/vendor/uPlot.iife.min.js")
    for path in (*files, "/ui/style.css"):
        got = client.get(path)
        assert got.status_code == 200, path
        assert "content-security-policy" in got.headers
    assert "MIT License" in client.get("/ui/vendor/uPlot.LICENSE").text
    assert client.get("/ui/missing.js").status_code == 404
    assert "content-security-policy" in client.get("/v1/health").headers
    # FastAPI's API browser (inline script from a CDN) is off unless asked for
    assert client.get("/docs").status_code == 404
    assert client.get("/redoc").status_code == 404
    assert client.get("/openapi.json").status_code == 200


def test_the_api_browser_is_served_when_asked_for(
    store: SqlStore, settings: QueueSettings, blob_settings: BlobSettings, tmp_path: Path
) -> None:
    from fastapi.testclient import TestClient

    blobs = BlobService(store, BlobFiles(tmp_path / "blobs"), blob_settings)
    with TestClient(create_app(store, settings, blobs, api_docs=True)) as client:
        page = client.get("/docs")
        assert page.status_code == 200 and "swagger" in page.text.lower()
        # its page keeps its own script: the dashboard's policy would break it
        assert "content-security-policy" not in page.headers


def test_sign_in_sets_an_httponly_strict_cookie_and_never_returns_the_token(
    client: TestClient, admin_token: str, store: SqlStore
) -> None:
    r = client.post("/v1/session", json={"token": admin_token})
    assert r.status_code == 200
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{SESSION_COOKIE}=")
    for flag in ("HttpOnly", "SameSite=strict", "Path=/", "Max-Age="):
        assert flag.lower() in cookie.lower(), flag
    assert admin_token not in r.text and admin_token not in cookie
    assert r.json()["role"] == "admin" and r.json()["csrf"]
    assert r.headers["cache-control"] == "no-store"
    secret = client.cookies[SESSION_COOKIE]
    # the server keeps the session's hash, not its secret
    assert store.session_token(secret, 0) is None
    # the cookie alone reads
    assert client.get("/v1/jobs").status_code == 200
    me = client.get("/v1/session").json()
    assert me["name"] == "admin" and me["csrf"] == r.json()["csrf"]


def test_a_change_through_the_cookie_needs_the_sessions_csrf_token(
    client: TestClient, admin_token: str, admin: dict[str, str]
) -> None:
    job = submit(client, admin, name="steer-me")
    csrf = _sign_in(client, admin_token)
    error = assert_error(client.post(f"/v1/jobs/{job}/cancel"), 403, "forbidden", "X-CSRF-Token")
    assert error["detail"] == {"field": "header.X-CSRF-Token"}
    wrong = {"X-CSRF-Token": "0" * 32}
    assert_error(client.post(f"/v1/jobs/{job}/cancel", headers=wrong), 403, "forbidden")
    assert client.get(f"/v1/jobs/{job}").json()["status"] == "pending"  # nothing changed
    r = client.post(f"/v1/jobs/{job}/cancel", headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200 and r.json()["status"] == "cancelled"


def test_the_admin_pages_calls_take_the_sessions_role_and_csrf_token(
    client: TestClient, store: SqlStore, worker: dict[str, str]
) -> None:
    """What the dashboard's admin pages call: tokens (admin), drain and remove (operator).
    The page hides the buttons a role cannot use; the server refuses them anyway."""
    auth = Auth(store)
    box = register(client, worker, "box")["id"]
    new = {"name": "box-2", "role": "worker", "pools": ["default"]}
    drain, tokens = f"/v1/workers/{box}/drain", "/v1/tokens"
    for role in (Role.SUBMITTER, Role.OPERATOR):
        csrf = {"X-CSRF-Token": _sign_in(client, auth.create(role.value, role)[1])}
        assert_error(client.post(tokens, json=new, headers=csrf), 403, "forbidden")
        assert_error(client.get(tokens), 403, "forbidden")
        assert_error(client.post(f"{tokens}/t-nope/rotate", headers=csrf), 403, "forbidden")
        if role == Role.SUBMITTER:
            assert_error(client.post(drain, headers=csrf), 403, "forbidden")
            assert_error(client.delete(f"/v1/workers/{box}", headers=csrf), 403, "forbidden")
        else:
            assert_error(client.post(drain), 403, "forbidden", "X-CSRF-Token")
            assert client.get(f"/v1/workers/{box}").json()["status"] != "draining"  # unchanged
            assert client.post(drain, headers=csrf).json()["status"] == "draining"
        client.cookies.clear()
    csrf = {"X-CSRF-Token": _sign_in(client, auth.create("root", Role.ADMIN)[1])}
    assert_error(client.post(tokens, json=new), 403, "forbidden", "X-CSRF-Token")
    made = client.post(tokens, json=new, headers=csrf)
    assert made.status_code == 201 and made.json()["token"].startswith("gf_")


def test_sign_in_refuses_bad_worker_and_empty_tokens(client: TestClient, worker_token: str) -> None:
    assert_error(client.post("/v1/session", json={"token": "gf_nope"}), 401, "unauthorized")
    assert_error(client.post("/v1/session", json={"token": worker_token}), 403, "forbidden")
    assert_error(client.post("/v1/session", json={"token": ""}), 422, "validation_error")
    assert_error(client.post("/v1/session", json={}), 422, "validation_error", "token")
    assert SESSION_COOKIE not in client.cookies
    assert_error(client.get("/v1/session"), 401, "unauthorized")


def test_sign_out_revoke_and_rotate_each_end_the_session(
    client: TestClient, store: SqlStore, admin: dict[str, str]
) -> None:
    auth = Auth(store)
    row, secret = auth.create("alice", Role.OPERATOR)
    csrf = _sign_in(client, secret)
    kept = client.cookies[SESSION_COOKIE]
    r = client.delete("/v1/session", headers={"X-CSRF-Token": csrf})
    assert r.status_code == 204 and SESSION_COOKIE not in client.cookies  # told to forget it
    client.cookies[SESSION_COOKIE] = kept  # a copy kept elsewhere no longer works either
    assert_error(client.get("/v1/jobs"), 401, "unauthorized", "sign in again")
    client.cookies.clear()

    _sign_in(client, secret)
    assert client.post(f"/v1/tokens/{row.id}/rotate", headers=admin).status_code == 200
    assert_error(client.get("/v1/jobs"), 401, "unauthorized")

    row2, secret2 = auth.create("bob", Role.SUBMITTER)
    _sign_in(client, secret2)
    assert client.get("/v1/jobs").status_code == 200
    assert client.delete(f"/v1/tokens/{row2.id}", headers=admin).status_code == 200
    assert_error(client.get("/v1/jobs"), 401, "unauthorized")


def test_a_bearer_header_wins_over_the_cookie_and_needs_no_csrf(
    client: TestClient, store: SqlStore, admin: dict[str, str]
) -> None:
    _, secret = Auth(store).create("sub", Role.SUBMITTER)
    _sign_in(client, secret)
    job = submit(client, admin, name="admins")
    assert client.post(f"/v1/jobs/{job}/cancel", headers=admin).status_code == 200


def test_jobs_page_newest_first_with_total_filters_and_cursor(
    client: TestClient, admin: dict[str, str], store: SqlStore
) -> None:
    ids = [submit(client, admin, name=f"train-{i:03d}") for i in range(120)]
    ids += [submit(client, admin, name=f"Eval_{i}", pool="vision") for i in range(5)]
    r = client.get("/v1/jobs?order=newest&limit=50", headers=admin)
    assert r.headers["x-total-count"] == "125"
    page1 = [j["id"] for j in r.json()]
    assert page1 == ids[::-1][:50]
    r = client.get(f"/v1/jobs?order=newest&limit=50&before={page1[-1]}", headers=admin)
    assert [j["id"] for j in r.json()] == ids[::-1][50:100]
    # oldest-first (the CLI's order) pages the same way
    r = client.get(f"/v1/jobs?limit=10&before={page1[-1]}", headers=admin)
    assert [j["id"] for j in r.json()] == ids[65:75]

    r = client.get("/v1/jobs?name=EVAL_&limit=50", headers=admin)  # any case; _ is literal
    assert [j["name"] for j in r.json()] == [f"Eval_{i}" for i in range(5)]
    assert r.headers["x-total-count"] == "5"
    r = client.get("/v1/jobs?pool=vision&limit=3&order=newest", headers=admin)
    assert [j["pool"] for j in r.json()] == ["vision"] * 3
    assert r.headers["x-total-count"] == "5"
    assert client.get("/v1/jobs?name=%25&limit=5", headers=admin).json() == []

    error = assert_error(client.get("/v1/jobs?before=j-nope", headers=admin), 422)
    assert error["detail"] == {"field": "before"}
    assert_error(client.get("/v1/jobs?order=sideways", headers=admin), 422, "validation_error")


def test_a_submitter_pages_only_its_pools(
    client: TestClient, admin: dict[str, str], store: SqlStore
) -> None:
    theirs = submit(client, admin, name="nlp-job", pool="nlp")
    submit(client, admin, name="vision-job", pool="vision")
    _, secret = Auth(store).create("sub", Role.SUBMITTER, ["vision"])
    sub = bearer(secret)
    r = client.get("/v1/jobs?order=newest", headers=sub)
    assert [j["name"] for j in r.json()] == ["vision-job"]
    assert r.headers["x-total-count"] == "1"
    assert_error(client.get("/v1/jobs?pool=nlp", headers=sub), 403, "forbidden", "nlp")
    assert_error(client.get(f"/v1/jobs?before={theirs}", headers=sub), 422)


@pytest.mark.parametrize("types", ["logs", "", "state,bogus"])
def test_event_types_must_be_known(client: TestClient, admin: dict[str, str], types: str) -> None:
    job = submit(client, admin)
    r = client.get(f"/v1/jobs/{job}/events?format=json&types={types}", headers=admin)
    error = assert_error(r, 422, "validation_error", "types")
    assert error["detail"] == {"field": "types"}


def test_events_json_by_type_and_scrolled_back(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    w = register(client, worker, "box")
    job = submit(client, admin)
    claim(client, worker, w["id"])
    client.post(f"/v1/jobs/{job}/start", json={"attempt": 1}, headers=worker)
    batch = [{"line": f"line {i}"} for i in range(30)]
    batch.insert(10, {"stream": "progress", "line": '{"epoch": 1, "loss": 0.5}'})
    r = client.post(f"/v1/jobs/{job}/output", json={"attempt": 1, "lines": batch}, headers=worker)
    assert r.status_code == 204, r.text
    url = f"/v1/jobs/{job}/events?format=json"

    states = client.get(f"{url}&types=state", headers=admin).json()["events"]
    assert [e["data"]["status"] for e in states] == ["pending", "claimed", "running"]
    progress = client.get(f"{url}&types=progress", headers=admin).json()["events"]
    assert [e["data"]["record"] for e in progress] == [{"epoch": 1, "loss": 0.5}]
    # the log's tail, then the page before it: what the dashboard's scroll-back reads
    tail = client.get(f"{url}&types=log&before=9007199254740991&limit=8", headers=admin).json()
    assert [e["data"]["line"] for e in tail["events"]] == [f"line {i}" for i in range(22, 30)]
    first = tail["events"][0]["seq"]
    back = client.get(f"{url}&types=log&before={first}&limit=100", headers=admin).json()
    assert [e["data"]["line"] for e in back["events"]] == [f"line {i}" for i in range(22)]
    mixed = client.get(f"{url}&types=state,progress", headers=admin).json()["events"]
    assert [e["type"] for e in mixed] == ["state", "state", "state", "progress"]
