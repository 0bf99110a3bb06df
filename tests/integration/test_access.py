"""Who may do what: every role against every route that matters, object by object.

One fleet is built per test: pools ``a`` and ``b``; workers ``wa1`` and ``wa2`` in pool a,
each enrolled with its own worker token, and ``wb`` in pool b; a job of pool a that
``wa1`` holds (attempt 1), a pending job in each pool. Each row of ``TABLE`` makes one
call as one caller and names the status it must get; a refused call must also leave the
database exactly as it was (the audit log aside: it records refusals on purpose).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy

from gpufleet.archive import pack_path
from gpufleet.domain.models import Role
from gpufleet.server.auth import Auth
from gpufleet.store import SqlStore
from tests.integration.helpers import (
    TESTCLIENT_ON_HTTPX,
    assert_error,
    bearer,
    job_body,
    worker_body,
)

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX


@dataclass
class World:
    client: TestClient
    store: SqlStore
    secrets: dict[str, str]
    ids: dict[str, str]
    db: Path

    def call(self, who: str, method: str, path: str, body: Any = None) -> Any:
        return self.client.request(
            method, path.format(**self.ids), json=body, headers=bearer(self.secrets[who])
        )

    def snapshot(self, every: bool = False) -> dict[str, list[tuple[Any, ...]]]:
        """Every table but the audit log (``every``: with it), row by row."""
        skip = () if every else ("audit", "alembic_version")
        engine = self.store.engine
        tables = [t for t in sqlalchemy.inspect(engine).get_table_names() if t not in skip]
        with engine.connect() as conn:
            return {
                t: sorted(map(tuple, conn.execute(sqlalchemy.text(f"SELECT * FROM {t}"))), key=repr)
                for t in tables
            }

    def sql(self, statement: str, **params: Any) -> None:
        with self.store.engine.begin() as conn:
            conn.execute(sqlalchemy.text(statement), params)


@pytest.fixture
def world(client: TestClient, store: SqlStore, tmp_path: Path) -> World:
    auth = Auth(store)
    secrets = {
        "admin": auth.create("admin", Role.ADMIN)[1],
        "operator": auth.create("ops", Role.OPERATOR)[1],
        "op_a": auth.create("lab-a", Role.OPERATOR, ["a"])[1],
        "sub_a": auth.create("alice", Role.SUBMITTER, ["a"])[1],
        "sub_a2": auth.create("carol", Role.SUBMITTER, ["a"])[1],
        "sub_b": auth.create("bob", Role.SUBMITTER, ["b"])[1],
        "worker_a1": auth.create("box-1", Role.WORKER, ["a"])[1],
        "worker_a2": auth.create("box-2", Role.WORKER, ["a"])[1],
        "worker_b": auth.create("box-3", Role.WORKER, ["b"])[1],
    }
    w = World(client, store, secrets, {}, tmp_path / "db.sqlite")
    for name, token in (("wa1", "worker_a1"), ("wa2", "worker_a2"), ("wb", "worker_b")):
        r = w.call(token, "POST", "/v1/workers", worker_body(name))
        assert r.status_code == 201, r.text
        w.ids[name] = r.json()["id"]
    r = w.call("sub_a", "POST", "/v1/jobs", job_body("held"))
    w.ids["held"] = r.json()["job"]["id"]
    r = w.call("worker_a1", "POST", "/v1/workers/{wa1}/claim", {"cpu_slots": 1, "wait": 0})
    assert r.status_code == 200 and r.json()["job_id"] == w.ids["held"], r.text
    w.ids["pending_a"] = w.call("sub_a", "POST", "/v1/jobs", job_body("pa")).json()["job"]["id"]
    w.ids["pending_b"] = w.call("sub_b", "POST", "/v1/jobs", job_body("pb")).json()["job"]["id"]
    return w


LEASE = {"attempt": 1}
FINISH = {"attempt": 1, "exit_code": 0}
BEAT = {"leases": [{"job_id": "{held}", "attempt": 1}]}
PLAN = {"name": "m", "jobs": [job_body("m1", manifest="m")]}

# (caller, method, path, body, status). Paths and string bodies are formatted with ids.
TABLE: list[tuple[str, str, str, Any, int]] = [
    # A worker acts only as its own workers, on its own leases.
    ("worker_a2", "POST", "/v1/workers/{wa1}/heartbeat", BEAT, 403),
    ("worker_a2", "POST", "/v1/workers/{wa1}/claim", {"cpu_slots": 1, "wait": 0}, 403),
    ("worker_a2", "POST", "/v1/jobs/{held}/start", LEASE, 403),
    ("worker_a2", "POST", "/v1/jobs/{held}/finish", FINISH, 403),
    ("worker_a2", "POST", "/v1/jobs/{held}/finish", {"attempt": 1, "exit_code": 1}, 403),
    ("worker_a2", "POST", "/v1/jobs/{held}/release", {**LEASE, "reason": "x"}, 403),
    ("worker_a2", "POST", "/v1/jobs/{held}/output", {**LEASE, "lines": []}, 403),
    ("worker_a2", "POST", "/v1/jobs/{held}/artifact", {**LEASE, "sha256": "0" * 64}, 403),
    ("worker_b", "POST", "/v1/jobs/{held}/finish", FINISH, 404),
    # a snapshot: only the lease's holder records one, and only of blobs it may read
    ("worker_a2", "POST", "/v1/jobs/{held}/checkpoints", {**LEASE, "files": []}, 403),
    ("worker_b", "POST", "/v1/jobs/{held}/checkpoints", {**LEASE, "files": []}, 404),
    ("worker_a1", "GET", "/v1/jobs/{held}/checkpoints", None, 403),
    ("sub_a", "GET", "/v1/jobs/{pending_b}/checkpoints", None, 404),
    ("sub_a2", "POST", "/v1/jobs/{pending_a}/pause", None, 403),
    ("sub_a2", "POST", "/v1/jobs/{pending_a}/resume", None, 403),
    ("sub_a", "POST", "/v1/jobs/{pending_b}/pause", None, 404),
    ("worker_a1", "POST", "/v1/jobs/{pending_a}/pause", None, 403),
    ("worker_b", "POST", "/v1/workers/{wa1}/heartbeat", BEAT, 404),
    ("worker_b", "POST", "/v1/workers/{wa1}/claim", {"cpu_slots": 1, "wait": 0}, 404),
    ("worker_a2", "POST", "/v1/workers", worker_body("wa1"), 403),
    ("worker_b", "POST", "/v1/workers", worker_body("wb2", pool="a"), 403),
    ("worker_a1", "POST", "/v1/jobs/{held}/finish", {"attempt": 2, "exit_code": 0}, 409),
    ("worker_a1", "POST", "/v1/workers/{wa1}/heartbeat", BEAT, 200),
    ("worker_a1", "POST", "/v1/jobs/{held}/start", LEASE, 204),
    # A worker token runs work; it does not steer the queue or read it.
    ("worker_a1", "POST", "/v1/jobs/{pending_a}/cancel", None, 403),
    ("worker_a1", "POST", "/v1/jobs/{pending_a}/requeue", None, 403),
    ("worker_a1", "POST", "/v1/manifests", PLAN, 403),
    ("worker_a1", "POST", "/v1/jobs", job_body("x"), 403),
    ("worker_a1", "GET", "/v1/jobs", None, 403),
    ("worker_a1", "GET", "/v1/workers", None, 403),
    ("worker_a1", "POST", "/v1/workers/{wa2}/drain", None, 403),
    ("worker_a1", "POST", "/v1/tokens", {"name": "x", "role": "admin"}, 403),
    ("worker_a1", "GET", "/v1/audit", None, 403),
    ("worker_a1", "GET", "/v1/usage", None, 403),
    # A submitter sees and steers its pools only; another pool's objects do not exist.
    ("sub_a", "GET", "/v1/jobs/{pending_b}", None, 404),
    ("sub_a", "POST", "/v1/jobs/{pending_b}/cancel", None, 404),
    ("sub_a", "POST", "/v1/jobs/{pending_b}/requeue", None, 404),
    ("sub_a", "GET", "/v1/jobs/{pending_b}/logs", None, 404),
    ("sub_a", "GET", "/v1/jobs/{pending_b}/why", None, 404),
    ("sub_a", "GET", "/v1/jobs/{pending_b}/artifact", None, 404),
    ("sub_a", "GET", "/v1/workers/{wb}", None, 404),
    ("sub_a", "POST", "/v1/jobs", job_body("x", pool="b"), 403),
    ("sub_b", "POST", "/v1/jobs", job_body("x", inputs=[{"kind": "job", "ref": "held"}]), 422),
    ("sub_b", "POST", "/v1/jobs", job_body("x", inputs=[{"kind": "job", "ref": "{held}"}]), 422),
    ("sub_a", "POST", "/v1/workers/select", {"spec": job_body("x", pool="b")}, 403),
    ("sub_a", "POST", "/v1/jobs/{pending_a}/cancel", None, 200),
    ("sub_a", "GET", "/v1/jobs/{pending_a}", None, 200),
    ("sub_a", "POST", "/v1/jobs", job_body("x"), 201),
    ("sub_a", "POST", "/v1/manifests", PLAN, 403),
    ("sub_a", "POST", "/v1/workers/{wa1}/drain", None, 403),
    ("sub_a", "POST", "/v1/workers", worker_body("sneaky"), 403),
    ("sub_a", "POST", "/v1/workers/{wa1}/heartbeat", BEAT, 403),
    ("sub_a", "POST", "/v1/jobs/{held}/finish", FINISH, 403),
    ("sub_a", "GET", "/v1/tokens", None, 403),
    ("sub_a", "POST", "/v1/tokens/{admin_id}/rotate", None, 403),
    ("sub_a", "DELETE", "/v1/tokens/{admin_id}", None, 403),
    ("sub_a", "GET", "/v1/audit", None, 403),
    ("sub_a", "GET", "/v1/usage", None, 200),
    ("sub_a", "GET", "/v1/usage?pool=b", None, 404),
    # An operator steers every pool but manages no tokens.
    ("operator", "POST", "/v1/jobs/{pending_b}/cancel", None, 200),
    ("operator", "POST", "/v1/manifests", PLAN, 200),
    ("operator", "POST", "/v1/workers/{wb}/drain", None, 200),
    ("operator", "GET", "/v1/audit", None, 200),
    ("operator", "POST", "/v1/tokens", {"name": "x", "role": "operator"}, 403),
    ("operator", "GET", "/v1/tokens", None, 403),
    ("operator", "POST", "/v1/workers/{wa1}/heartbeat", BEAT, 403),
    ("operator", "DELETE", "/v1/workers/{wa1}", None, 409),  # online: drain it first
    # A submitter steers only the jobs it submitted, though it sees its pools' others.
    ("sub_a2", "GET", "/v1/jobs/{pending_a}", None, 200),
    ("sub_a2", "POST", "/v1/jobs/{pending_a}/cancel", None, 403),
    ("sub_a2", "POST", "/v1/jobs/{pending_a}/requeue", None, 403),
    ("sub_a2", "POST", "/v1/jobs/{pending_a}/stop", None, 403),
    ("sub_a", "POST", "/v1/jobs/{pending_a}/stop", None, 409),  # pending: nothing to stop
    ("sub_a", "POST", "/v1/jobs/{pending_b}/stop", None, 404),
    ("worker_a1", "POST", "/v1/jobs/{held}/stop", None, 403),
    ("admin", "POST", "/v1/jobs/{held}/stop", {"grace": -1}, 422),
    ("admin", "POST", "/v1/jobs/{held}/stop", {"grace": 5}, 200),
    ("sub_a", "DELETE", "/v1/workers/{wa1}", None, 403),
    # An operator of pool a steers pool a; pool b's objects and the audit log are not its.
    ("op_a", "POST", "/v1/jobs/{pending_a}/cancel", None, 200),
    ("op_a", "POST", "/v1/jobs/{pending_b}/cancel", None, 404),
    ("op_a", "POST", "/v1/workers/{wa2}/drain", None, 200),
    ("op_a", "POST", "/v1/workers/{wb}/drain", None, 404),
    ("op_a", "DELETE", "/v1/workers/{wb}", None, 404),
    ("op_a", "POST", "/v1/manifests", PLAN, 200),
    (
        "op_a",
        "POST",
        "/v1/manifests",
        {**PLAN, "jobs": [job_body("m1", manifest="m", pool="b")]},
        403,
    ),
    ("op_a", "POST", "/v1/manifests", {**PLAN, "hosts": [{"name": "wb"}]}, 403),
    ("op_a", "GET", "/v1/audit", None, 403),
    ("op_a", "POST", "/v1/tokens", {"name": "x", "role": "worker"}, 403),
    # A worker says it stops for itself only.
    ("worker_a2", "POST", "/v1/workers/{wa1}/leave", {"reason": "x"}, 403),
    ("worker_b", "POST", "/v1/workers/{wa1}/leave", {"reason": "x"}, 404),
    ("worker_a1", "DELETE", "/v1/workers/{wa1}", None, 403),
    # Read-only and unknown fields are refused, not ignored.
    ("admin", "POST", "/v1/jobs", job_body("x", status="succeeded"), 422),
    ("admin", "POST", "/v1/jobs", job_body("x", attempts=0), 422),
    ("admin", "POST", "/v1/jobs", job_body("x", worker_id="{wa1}"), 422),
    ("admin", "POST", "/v1/workers", worker_body("w9", status="idle"), 422),
    ("worker_a1", "POST", "/v1/jobs/{held}/finish", {**FINISH, "status": "succeeded"}, 422),
    ("admin", "POST", "/v1/tokens", {"name": "x", "role": "worker", "hash": "0" * 64}, 422),
    ("admin", "POST", "/v1/tokens", {"name": "x", "role": "worker", "pools": ["a", "b"]}, 422),
    ("admin", "POST", "/v1/tokens", {"name": "x", "role": "admin", "pools": ["a"]}, 422),
    ("admin", "POST", "/v1/tokens", {"name": "x", "role": "submitter", "labels": {"t": "n"}}, 422),
    ("admin", "POST", "/v1/jobs", job_body("x", requirements={"cpu_only": True, "gpus": 1}), 422),
    ("admin", "POST", "/v1/jobs", job_body("x", hyper_style="snake"), 422),
    ("admin", "POST", "/v1/tokens", {"name": "x", "role": "submitter", "pools": ["a b"]}, 422),
    # Webhooks: a submitter sets its own and a job's of its own; a pool's is an operator's.
    ("worker_a1", "POST", "/v1/webhooks", {"url": "https://example.org/h"}, 403),
    ("worker_a1", "GET", "/v1/webhooks", None, 403),
    ("sub_a", "POST", "/v1/webhooks", {"url": "https://example.org/h", "pool": "a"}, 403),
    ("sub_a2", "POST", "/v1/webhooks", {"url": "https://example.org/h", "job": "{held}"}, 403),
    ("sub_b", "POST", "/v1/webhooks", {"url": "https://example.org/h", "job": "{held}"}, 404),
    ("op_a", "POST", "/v1/webhooks", {"url": "https://example.org/h", "pool": "b"}, 403),
    ("sub_a", "POST", "/v1/webhooks", {"url": "http://169.254.169.254/"}, 422),
    ("sub_a", "POST", "/v1/webhooks", {"url": "https://example.org/h", "secret": "short"}, 422),
    ("sub_a", "DELETE", "/v1/webhooks/h-0000", None, 404),
    ("sub_a", "GET", "/v1/webhooks", None, 200),
    ("op_a", "POST", "/v1/webhooks", {"url": "https://93.184.215.14/h", "pool": "a"}, 201),
    # The admin manages tokens.
    ("admin", "GET", "/v1/tokens", None, 200),
    ("admin", "POST", "/v1/tokens", {"name": "x", "role": "submitter", "pools": ["a"]}, 201),
    ("admin", "POST", "/v1/tokens", {"name": "x", "role": "operator", "pools": ["a"]}, 201),
    ("admin", "POST", "/v1/tokens", {"name": "x", "role": "worker", "labels": {"t": "n"}}, 201),
]


def _fill(value: Any, ids: dict[str, str]) -> Any:
    if isinstance(value, str):
        return value.format(**ids)
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, ids) for v in value]
    return value


@pytest.mark.parametrize(
    ("who", "method", "path", "body", "status"),
    TABLE,
    ids=[f"{who}-{m}-{p}-{s}" for who, m, p, _, s in TABLE],
)
def test_role_and_object_access(
    world: World, who: str, method: str, path: str, body: Any, status: int
) -> None:
    world.ids["admin_id"] = Auth(world.store).check(f"Bearer {world.secrets['admin']}").id
    before = world.snapshot()
    r = world.call(who, method, path, _fill(body, world.ids))
    assert r.status_code == status, (r.status_code, r.text)
    if status >= 400:
        assert_error(r, status)
        assert world.snapshot() == before, "a refused call changed the database"


def test_a_submitter_lists_only_its_pools(world: World) -> None:
    jobs = world.call("sub_a", "GET", "/v1/jobs").json()
    assert {j["id"] for j in jobs} == {world.ids["held"], world.ids["pending_a"]}
    workers = world.call("sub_a", "GET", "/v1/workers").json()
    assert {w["name"] for w in workers} == {"wa1", "wa2"}
    assert world.call("sub_a", "GET", "/v1/workers?pool=b").json() == []
    status = world.call("sub_a", "GET", "/v1/status").json()
    assert sum(status["jobs"].values()) == 2
    assert sum(status["workers"].values()) == 2
    why = world.call("sub_a", "GET", "/v1/jobs/{pending_a}/why").json()
    assert {w["name"] for w in why["workers"]} == {"wa1", "wa2"}
    everything = world.call("operator", "GET", "/v1/jobs").json()
    assert len(everything) == 3


def test_a_submitter_sees_only_the_host_declarations_of_its_pools_workers(world: World) -> None:
    hosts = [{"name": "wa1", "declared": {"cuda": False}}, {"name": "wb", "priority": 2}]
    plan = {"name": "lab", "hosts": hosts, "file": "plans/lab.toml"}
    assert world.call("operator", "POST", "/v1/manifests", plan).status_code == 200
    mine = world.call("sub_a", "GET", "/v1/hosts").json()
    assert [(h["name"], h["narrows"], h["file"]) for h in mine] == [
        ("wa1", ["cuda=false"], "plans/lab.toml")
    ]
    assert mine[0]["applied_by"] == "ops" and mine[0]["manifest"] == "lab"
    every = world.call("admin", "GET", "/v1/hosts").json()
    assert [h["name"] for h in every] == ["wa1", "wb"] and every[1]["narrows"] == []
    assert world.call("worker_a1", "GET", "/v1/hosts").status_code == 403
    # nor does its registration's answer tell a worker where its declaration came from
    again = world.call("worker_a1", "POST", "/v1/workers", worker_body("wa1")).json()
    assert again["host"] is None and again["gpus_offered"] is not None


def test_a_submit_without_a_pool_goes_to_the_tokens_pool(world: World) -> None:
    r = world.call("sub_b", "POST", "/v1/jobs", job_body("mine"))
    assert r.status_code == 201, r.text
    assert world.store.get_job(r.json()["job"]["id"]).pool == "b"  # type: ignore[union-attr]


def test_a_rotated_token_fails_at_once_and_the_new_one_works(world: World) -> None:
    tokens = {t["name"]: t for t in world.call("admin", "GET", "/v1/tokens").json()}
    alice = tokens["alice"]
    assert world.call("sub_a", "GET", "/v1/jobs").status_code == 200  # cached by the server
    r = world.call("admin", "POST", f"/v1/tokens/{alice['id']}/rotate")
    assert r.status_code == 200, r.text
    fresh = r.json()
    assert fresh["id"] == alice["id"] and fresh["pools"] == ["a"]
    assert fresh["token"] != world.secrets["sub_a"] and fresh["hint"] != alice["hint"]
    assert_error(world.call("sub_a", "GET", "/v1/jobs"), 401, "unauthorized")
    world.secrets["sub_a"] = fresh["token"]
    assert world.call("sub_a", "GET", "/v1/jobs").status_code == 200


def test_a_revoked_worker_token_fails_at_once_and_its_jobs_are_requeued(world: World) -> None:
    beat = _fill(BEAT, world.ids)
    assert world.call("worker_a1", "POST", "/v1/workers/{wa1}/heartbeat", beat).status_code == 200
    box1 = next(t for t in world.call("admin", "GET", "/v1/tokens").json() if t["name"] == "box-1")
    assert world.call("admin", "DELETE", f"/v1/tokens/{box1['id']}").status_code == 200
    r = world.call("worker_a1", "POST", "/v1/workers/{wa1}/heartbeat", beat)
    assert_error(r, 401, "unauthorized", "revoked")
    job = world.call("admin", "GET", "/v1/jobs/{held}").json()
    assert job["status"] == "pending" and job["attempts"] == 0
    assert job["history"][-1]["outcome"] == "released"
    worker = world.call("admin", "GET", "/v1/workers/{wa1}").json()
    assert worker["status"] == "offline"
    # The other worker of the pool takes the job.
    r = world.call("worker_a2", "POST", "/v1/workers/{wa2}/claim", {"cpu_slots": 1, "wait": 0})
    assert r.status_code == 200 and r.json()["job_id"] == world.ids["held"]


def test_a_token_works_until_it_expires(
    client: TestClient, store: SqlStore, admin: dict[str, str]
) -> None:
    body = {"name": "week", "role": "operator", "expires_days": 7}
    made = client.post("/v1/tokens", json=body, headers=admin).json()
    assert made["expires_at"] is not None
    assert client.get("/v1/jobs", headers=bearer(made["token"])).status_code == 200
    _, secret = Auth(store).create("temp", Role.OPERATOR, expires_at=1.0)  # 1970
    assert_error(client.get("/v1/jobs", headers=bearer(secret)), 401, "unauthorized", "expired")


def test_the_database_holds_no_secret(world: World, tmp_path: Path) -> None:
    r = world.call("admin", "POST", "/v1/tokens", {"name": "n", "role": "worker", "pools": ["a"]})
    world.secrets["new"] = r.json()["token"]
    world.call("admin", "POST", f"/v1/tokens/{r.json()['id']}/rotate")
    everything = repr(world.snapshot(every=True)).encode()  # on either database
    world.store.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("db.sqlite*")) + everything
    assert r.json()["id"].encode() in everything  # the dump has the tokens' rows
    for secret in world.secrets.values():
        assert secret.encode() not in raw
        assert secret[7:].encode() not in raw  # not even the part after the hint


def test_the_audit_log_names_who_did_what_from_where(world: World) -> None:
    world.call("sub_a", "POST", "/v1/jobs/{pending_a}/cancel")
    world.call("sub_a", "POST", "/v1/jobs/{pending_b}/cancel")
    world.call("worker_a1", "POST", "/v1/jobs/{held}/start", LEASE)
    world.call("worker_a1", "POST", "/v1/workers/{wa1}/heartbeat", _fill(BEAT, world.ids))
    rows = world.call("admin", "GET", "/v1/audit").json()
    calls = [
        (a["token_name"], a["method"], a["path"], a["status"], a["target"])
        for a in rows
        if not a["event"]
    ]
    pa, pb, held = world.ids["pending_a"], world.ids["pending_b"], world.ids["held"]
    assert ("alice", "POST", f"/v1/jobs/{pa}/cancel", 200, pa) in calls
    assert ("alice", "POST", f"/v1/jobs/{pb}/cancel", 404, None) in calls  # refused: kept
    assert ("box-1", "POST", f"/v1/jobs/{held}/start", 204, None) in calls
    assert ("box-1", "POST", f"/v1/workers/{world.ids['wa1']}/claim", 200, held) in calls
    assert not any(path.endswith("/heartbeat") for _, _, path, _, _ in calls)
    assert all(a["address"] for a in rows)
    assert {a["role"] for a in rows} >= {"submitter", "worker"}
    later = world.call("admin", "GET", "/v1/audit?since=2999-01-01T00:00:00Z").json()
    assert later == []


def _artifact(world: World) -> tuple[str, bytes]:
    """Worker wa1 uploads and attaches an artifact to the pool-a job it holds."""
    import hashlib
    import io

    src = world.db.parent / "out"
    (src / "outputs").mkdir(parents=True)
    (src / "outputs" / "model.bin").write_bytes(b"pool a's secret weights")
    buf = io.BytesIO()
    pack_path(src, buf)
    body = buf.getvalue()
    sha = hashlib.sha256(body).hexdigest()
    headers = bearer(world.secrets["worker_a1"])
    assert world.client.put(f"/v1/blobs/{sha}", content=body, headers=headers).status_code == 201
    r = world.call("worker_a1", "POST", "/v1/jobs/{held}/artifact", {**LEASE, "sha256": sha})
    assert r.status_code == 204, r.text
    return sha, body


def test_blobs_are_readable_by_their_pools_only(world: World) -> None:
    sha, body = _artifact(world)
    for who in ("sub_a", "operator"):
        assert world.call(who, "GET", f"/v1/blobs/{sha}").content == body
    assert world.call("sub_a", "GET", "/v1/jobs/{held}/artifact").json()["sha256"] == sha
    for who in ("sub_b", "worker_b"):
        assert_error(world.call(who, "GET", f"/v1/blobs/{sha}"), 404, "not_found")
        assert world.call(who, "HEAD", f"/v1/blobs/{sha}").status_code == 404
        assert sha not in world.call(who, "GET", "/v1/blobs").text
    # Claiming it by hash alone gets nothing: an upload session asks for the bytes, and a
    # job cannot use it as a package.
    r = world.call("sub_b", "POST", "/v1/uploads", {"sha256": sha, "size": len(body)})
    assert r.status_code == 201 and r.json()["complete"] is False, r.text
    spec = job_body("steal", inputs=[{"kind": "blob", "ref": sha}])
    assert_error(world.call("sub_b", "POST", "/v1/jobs", spec), 422, None, "not on the server")
    # Wrong bytes are refused and earn nothing; the right bytes prove possession.
    wrong = world.client.put(
        f"/v1/blobs/{sha}", content=body + b"x", headers=bearer(world.secrets["sub_b"])
    )
    assert_error(wrong, 422)
    assert world.call("sub_b", "HEAD", f"/v1/blobs/{sha}").status_code == 404
    right = world.client.put(
        f"/v1/blobs/{sha}", content=body, headers=bearer(world.secrets["sub_b"])
    )
    assert right.status_code == 200, right.text
    assert world.call("sub_b", "GET", f"/v1/blobs/{sha}").content == body


def test_a_worker_cannot_attach_a_blob_its_pool_cannot_read(world: World) -> None:
    sha, _ = _artifact(world)
    r = world.call("worker_b", "POST", "/v1/workers/{wb}/claim", {"cpu_slots": 1, "wait": 0})
    assert r.status_code == 200, r.text
    lease = r.json()
    r = world.call(
        "worker_b",
        "POST",
        f"/v1/jobs/{lease['job_id']}/artifact",
        {"attempt": lease["attempt"], "sha256": sha},
    )
    assert_error(r, 404, "not_found")


def test_a_submit_warning_names_no_worker_of_another_pool(world: World) -> None:
    r = world.call("sub_b", "POST", "/v1/jobs", job_body("gpu", requirements={"gpu_count": 1}))
    assert r.status_code == 201, r.text
    warning = r.json()["warning"]
    assert "wb" in warning and "wa1" not in warning and "wa2" not in warning


def test_a_legacy_token_without_pools_is_confined_to_default(world: World) -> None:
    auth = Auth(world.store)
    row, secret = auth.create("old", Role.SUBMITTER, ["a"])
    world.sql("UPDATE tokens SET pool = NULL WHERE id = :id", id=row.id)  # as before pools
    world.secrets["old"] = secret
    assert_error(world.call("old", "GET", "/v1/jobs/{pending_a}"), 404)
    assert world.call("old", "GET", "/v1/whoami").json()["role"] == "submitter"
    assert world.call("old", "POST", "/v1/jobs", job_body("x", pool="a")).status_code == 403


def test_a_worker_from_before_tokens_owned_workers_is_bound_to_the_first_of_its_pool(
    world: World,
) -> None:
    world.sql("UPDATE workers SET token_id = NULL WHERE name = 'wa1'")
    world.client.app.state.gpufleet.services.fleet.forget(world.ids["wa1"])  # type: ignore[attr-defined]
    beat = _fill(BEAT, world.ids)
    # Another pool cannot take it, by heartbeat or by registering its name.
    assert world.call("worker_b", "POST", "/v1/workers/{wa1}/heartbeat", beat).status_code == 404
    r = world.call("worker_b", "POST", "/v1/workers", worker_body("wa1", running=beat["leases"]))
    assert_error(r, 403, "forbidden", "pool")
    # Its own token gets it back, and keeps its lease.
    r = world.call("worker_a1", "POST", "/v1/workers/{wa1}/heartbeat", beat)
    assert r.status_code == 200 and r.json()["orders"][0]["order"] == "continue", r.text
    assert world.call("worker_a2", "POST", "/v1/workers/{wa1}/heartbeat", beat).status_code == 403


def test_a_revoked_workers_name_can_be_enrolled_again(world: World) -> None:
    tokens = {t["name"]: t for t in world.call("admin", "GET", "/v1/tokens").json()}
    world.call("admin", "DELETE", f"/v1/tokens/{tokens['box-1']['id']}")
    r = world.call("worker_a2", "POST", "/v1/workers", worker_body("wa1"))
    assert r.status_code == 201, r.text
    assert r.json()["id"] == world.ids["wa1"]


def test_refused_worker_calls_are_in_the_audit_log(world: World) -> None:
    beat = _fill(BEAT, world.ids)
    world.call("worker_a2", "POST", "/v1/workers/{wa1}/heartbeat", beat)
    world.call("worker_a1", "POST", "/v1/workers/{wa1}/heartbeat", beat)
    rows = world.call("admin", "GET", "/v1/audit").json()
    beats = [
        (a["token_name"], a["status"])
        for a in rows
        if not a["event"] and a["path"].endswith("/heartbeat")
    ]
    assert beats == [("box-2", 403)]  # the refused one; a good heartbeat is not recorded
    first = world.call("admin", "GET", "/v1/audit?limit=2").json()
    rest = world.call("admin", "GET", f"/v1/audit?after={first[-1]['seq']}").json()
    assert [a["seq"] for a in first + rest] == [a["seq"] for a in rows]


def test_a_read_of_the_audit_log_waits_for_records_already_being_written(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log's reader flushes first; a batch the timer took a moment before is still
    being written then, and the reader must see it too (a refused call just made)."""
    import asyncio
    import threading

    from gpufleet.server.audit import AuditWriter

    writer = AuditWriter(store)
    slow = threading.Event()
    real = store.insert_audit

    def insert(rows: list[dict[str, Any]]) -> None:
        slow.wait(10)  # the disk is slow this once
        real(rows)

    monkeypatch.setattr(store, "insert_audit", insert)
    record = {
        "at": 1.0,
        "token_id": None,
        "token_name": None,
        "role": None,
        "address": "127.0.0.1",
        "method": "POST",
        "path": "/v1/workers/w/heartbeat",
        "status": 403,
        "target": None,
    }

    async def run() -> list[int]:
        writer.bind(asyncio.get_running_loop())
        writer.add(record)
        first = asyncio.create_task(writer.flush())  # the timer's flush took the record
        await asyncio.sleep(0.05)
        reader = asyncio.create_task(writer.flush())  # then GET /v1/audit flushes
        await asyncio.sleep(0.2)
        waited = not reader.done()
        slow.set()
        await asyncio.gather(first, reader)
        assert waited, "the reader's flush returned while the record was being written"
        return [row.status for row in store.audit(0.0, 10)]

    assert asyncio.run(run()) == [403]


def _blob(world: World, who: str, body: bytes) -> dict[str, Any]:
    import hashlib

    sha = hashlib.sha256(body).hexdigest()
    put = world.client.put(f"/v1/blobs/{sha}", content=body, headers=bearer(world.secrets[who]))
    assert put.status_code == 201, put.text
    return {"sha256": sha, "size": len(body)}


def test_a_snapshot_cannot_hand_another_pools_blob_to_the_job(world: World) -> None:
    theirs = _blob(world, "sub_b", b"pool b's weights")
    files = [{"path": "last.pt", **theirs}]
    r = world.call("worker_a1", "POST", "/v1/jobs/{held}/checkpoints", {**LEASE, "files": files})
    assert_error(r, 422, None, "not on the server")
    assert world.call("sub_a", "HEAD", f"/v1/blobs/{theirs['sha256']}").status_code == 404
    assert world.call("sub_a", "GET", "/v1/jobs/{held}/checkpoints").json() == []


@pytest.mark.parametrize(
    "paths",
    [["a", "a/b"], ["a/b", "a"], ["."], ["a/../b"], ["/etc/passwd"], ["../x"], ["a", "a"]],
)
def test_a_snapshot_whose_paths_cannot_all_be_restored_is_refused(
    world: World, paths: list[str]
) -> None:
    # "a" a file and "a/b" a file in folder "a": no folder holds both, and a restore of it
    # would fail every later attempt
    mine = _blob(world, "worker_a1", b"state")
    files = [{"path": p, **mine} for p in paths]
    r = world.call("worker_a1", "POST", "/v1/jobs/{held}/checkpoints", {**LEASE, "files": files})
    assert_error(r, 422)
    assert world.call("sub_a", "GET", "/v1/jobs/{held}/checkpoints").json() == []


@pytest.mark.parametrize(
    "body",
    [
        {"attempt": 1, "files": None},
        {"attempt": 1, "files": "a"},
        {"attempt": 1, "files": [{"path": "a"}]},
        {"attempt": 1, "files": [{"path": "a", "sha256": "x", "size": 1}]},
        {"attempt": 1, "files": [{"path": "a", "sha256": "0" * 64, "size": -1}]},
        {"attempt": 1, "files": [{"path": "a", "sha256": "0" * 64, "size": 2**60}]},
        {"attempt": 1, "files": [{"path": "a\x00b", "sha256": "0" * 64, "size": 1}]},
        {"attempt": 1, "files": [], "progress": {"loss": 1}},
        {"attempt": 1, "files": [], "progress": {"epoch": 2**60}},
        {"attempt": 1, "files": [], "progress": {"epoch": "x"}},
        {"attempt": 0, "files": []},
        {"attempt": 2**40, "files": []},
        [],
        "x",
    ],
)
def test_a_malformed_snapshot_is_a_4xx(world: World, body: Any) -> None:
    r = world.call("worker_a1", "POST", "/v1/jobs/{held}/checkpoints", body)
    assert 400 <= r.status_code < 500, r.text
    lone = '{"attempt": 1, "files": [{"path": "\\ud800", "sha256": "%s", "size": 1}]}' % ("0" * 64)
    r = world.client.post(
        "/v1/jobs/{held}/checkpoints".format(**world.ids),
        content=lone,
        headers={**bearer(world.secrets["worker_a1"]), "content-type": "application/json"},
    )
    assert 400 <= r.status_code < 500, r.text
    assert world.call("sub_a", "GET", "/v1/jobs/{held}/checkpoints").json() == []
