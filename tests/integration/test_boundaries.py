"""Where issue 10's new powers stop: pool-scoped operators and their manifests, jobs aimed
at a worker, polls of a worker, labels a pool's tokens fix, a stop that ends its attempt.
Each test is a hole a review of the change found, closed."""

from __future__ import annotations

import asyncio
import hashlib
import io
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.archive import pack_path
from gpufleet.domain.models import Role
from gpufleet.server.auth import Auth
from gpufleet.store import SqlStore
from tests.integration.helpers import (
    TESTCLIENT_ON_HTTPX,
    asgi,
    assert_error,
    bearer,
    claim,
    job_body,
    on_loop,
    register,
    submit,
    until,
    worker_body,
)

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX


def _token(store: SqlStore, name: str, role: Role, *pools: str, **kw: Any) -> dict[str, str]:
    return bearer(Auth(store).create(name, role, list(pools), **kw)[1])


def _plan(pool: str, priority: int = 0, **job: Any) -> dict[str, Any]:
    body = job_body("train", manifest="lab", pool=pool, priority=priority, **job)
    return {"name": "lab", "jobs": [body]}


# ---- a pool's operator, and its manifests -----------------------------------------------


def test_a_pool_operator_cannot_rewrite_another_pools_jobs_by_applying_its_manifest(
    client: TestClient, store: SqlStore
) -> None:
    op_a = _token(store, "op-a", Role.OPERATOR, "a")
    op_b = _token(store, "op-b", Role.OPERATOR, "b")
    job_id = client.post("/v1/manifests", json=_plan("b"), headers=op_b).json()["created"][0]
    refused = client.post("/v1/manifests", json=_plan("a", priority=99), headers=op_a)
    assert_error(refused, 403, "forbidden", "another name")
    moved = store.get_job(job_id)
    assert moved is not None and (moved.pool, moved.priority) == ("b", 0)
    # Under another name its plan applies, and `absent` never names another pool's jobs.
    mine = client.post("/v1/manifests", json={"name": "lab-a", "jobs": []}, headers=op_a)
    assert mine.status_code == 200 and mine.json()["absent"] == []


def test_a_pool_operator_cannot_read_another_pools_package_through_a_manifest(
    client: TestClient, store: SqlStore, tmp_path: Path
) -> None:
    op_a = _token(store, "op-a", Role.OPERATOR, "a")
    sub_b = _token(store, "sub-b", Role.SUBMITTER, "b")
    (tmp_path / "weights.txt").write_text("pool b's model")
    packed = io.BytesIO()
    pack_path(tmp_path, packed)
    raw = packed.getvalue()
    sha = hashlib.sha256(raw).hexdigest()
    put = client.put(f"/v1/blobs/{sha}", content=raw, headers=sub_b)
    assert put.status_code in (200, 201), put.text
    plan = _plan("a", inputs=[{"kind": "blob", "ref": sha}])
    assert_error(
        client.post("/v1/manifests", json=plan, headers=op_a), 422, None, "not on the server"
    )
    assert_error(client.get(f"/v1/blobs/{sha}", headers=op_a), 404)


def test_a_pool_operator_replaces_only_its_own_workers_host_policies(
    client: TestClient, store: SqlStore, admin: dict[str, str]
) -> None:
    op_a = _token(store, "op-a", Role.OPERATOR, "a")
    register(client, _token(store, "wb", Role.WORKER, "b"), "box-b", pool="b")
    register(client, _token(store, "wa", Role.WORKER, "a"), "box-a", pool="a")
    hosts = [{"name": "box-b", "deny_jobs": ["train"]}, {"name": "box-a", "priority": 3}]
    first = client.post("/v1/manifests", json={"name": "lab", "hosts": hosts}, headers=admin)
    assert first.status_code == 200, first.text
    assert {h.name for h in store.hosts()} == {"box-a", "box-b"}
    again = client.post("/v1/manifests", json={"name": "lab", "hosts": []}, headers=op_a)
    assert again.status_code == 200, again.text
    assert {h.name for h in store.hosts()} == {"box-b"}  # box-a's went; pool b's stays


def test_a_manifest_job_aimed_at_another_pools_worker_is_refused(
    client: TestClient, store: SqlStore, admin: dict[str, str]
) -> None:
    register(client, _token(store, "wb", Role.WORKER, "b"), "box-b", pool="b")
    plan = _plan("a", requirements={"worker": "box-b"})
    assert_error(client.post("/v1/manifests", json=plan, headers=admin), 422, None, "box-b")


# ---- jobs aimed at a worker ---------------------------------------------------------------


def test_a_worker_claims_the_job_aimed_at_it_before_its_pools_backlog(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    backlog = submit(client, admin, name="backlog", priority=5)
    w = register(client, worker, "box", cpu_slots=2)
    aimed = client.post(
        "/v1/jobs", json=job_body("mine", requirements={"worker": "box"}), headers=admin
    )
    assert aimed.status_code == 201, aimed.text
    assert claim(client, worker, w["id"])["job_id"] == aimed.json()["job"]["id"]
    assert claim(client, worker, w["id"])["job_id"] == backlog


def test_a_job_its_worker_could_never_run_holds_no_slot(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    w = register(client, worker, "box")
    never = job_body("never", requirements={"worker": "box", "labels": {"site": "mars"}})
    r = client.post("/v1/jobs", json=never, headers=admin, params={"queue": True})
    assert r.status_code == 201 and r.json()["warning"], r.text
    assert client.get(f"/v1/workers/{w['id']}", headers=admin).json()["status"] in (
        "connecting",
        "available",
    )
    fits = client.post(
        "/v1/jobs", json=job_body("fits", requirements={"worker": "box"}), headers=admin
    )
    assert fits.status_code == 201, fits.text


def test_removing_a_worker_jobs_wait_for_is_refused_naming_them(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    w = register(client, worker, "box")
    waits = job_body("waits", requirements={"worker": "box", "gpu_count": 1})
    job = client.post("/v1/jobs", json=waits, headers=admin, params={"queue": True}).json()
    client.post(f"/v1/workers/{w['id']}/leave", json={"reason": "gone"}, headers=worker)
    refused = client.delete(f"/v1/workers/{w['id']}", headers=admin)
    assert_error(refused, 409, "conflict", job["job"]["id"], "cancel them")


# ---- polls, labels, stops -------------------------------------------------------------------


def test_another_token_cannot_end_a_workers_open_poll(
    client: TestClient, store: SqlStore, worker: dict[str, str]
) -> None:
    victim = register(client, worker, "victim")["id"]
    stranger = _token(store, "stranger", Role.WORKER, "other")
    url = f"/v1/workers/{victim}/claim"

    async def scenario() -> tuple[int, float, int]:
        async with asgi(client.app) as c:  # type: ignore[arg-type]
            started = time.monotonic()
            open_poll = asyncio.create_task(
                c.post(url, json={"cpu_slots": 1, "wait": 1.5}, headers=worker)
            )
            polls = client.app.state.gpufleet.polls  # type: ignore[attr-defined]
            await until(lambda: len(polls) == 1, "the victim's poll to be open")
            hijack = await c.post(url, json={"cpu_slots": 1, "wait": 0.1}, headers=stranger)
            answer = await open_poll
            return answer.status_code, time.monotonic() - started, hijack.status_code

    status, took, hijack = on_loop(client, scenario)
    assert hijack == 404 and status == 204
    assert took >= 1.4, f"the victim's poll ended after {took:.2f}s, not its 1.5 s wait"


def test_a_label_a_pools_worker_tokens_fix_cannot_be_declared_by_other_workers(
    client: TestClient, store: SqlStore, admin: dict[str, str]
) -> None:
    trusted = _token(store, "nlp", Role.WORKER, "default", labels={"team": "nlp"})
    other = _token(store, "any", Role.WORKER, "default")
    register(client, trusted, "nlp-box")
    faker = client.post(
        "/v1/workers", json=worker_body("fake", labels={"team": "nlp"}), headers=other
    )
    assert_error(faker, 403, "forbidden", "team", "fixed by worker tokens")
    honest = register(client, other, "plain", labels={"site": "lab"})
    assert honest["labels"] == {"site": "lab"}


def test_a_job_asked_to_stop_ends_when_its_worker_hands_it_back(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    w = register(client, worker, "box")
    job = submit(client, admin, max_attempts=3)
    claim(client, worker, w["id"])
    client.post(f"/v1/jobs/{job}/start", json={"attempt": 1}, headers=worker)
    client.post(f"/v1/jobs/{job}/stop", headers=admin)
    client.post(f"/v1/workers/{w['id']}/leave", json={"reason": "drained"}, headers=worker)
    ended = client.get(f"/v1/jobs/{job}", headers=admin).json()
    assert ended["status"] == "failed" and "asked to stop" in ended["error"], ended
    assert ended["history"][0]["outcome"] == "stopped"


def test_a_cancel_leaves_no_stale_stderr_tail(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    w = register(client, worker, "box")
    job = submit(client, admin, max_attempts=3)
    claim(client, worker, w["id"])
    failed = {"attempt": 1, "exit_code": 1, "stderr_tail": ["first attempt's error"]}
    client.post(f"/v1/jobs/{job}/finish", json=failed, headers=worker)
    store_job = client.get(f"/v1/jobs/{job}", headers=admin).json()
    assert store_job["stderr_tail"] == ["first attempt's error"]
    cancelled = client.post(f"/v1/jobs/{job}/cancel", headers=admin).json()
    assert cancelled["error"] == "cancelled" and cancelled["stderr_tail"] == []
