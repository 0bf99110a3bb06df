"""Job environments through the API: the fleet-wide lock of an unlocked spec (recorded by
the first worker whose build resolved it, read by every other), an environment failure
that fails a job at once, the environment an attempt ran in, and what each worker has
built."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

from gpufleet.domain.environments import EnvSpec, lock_key
from gpufleet.domain.models import Role
from gpufleet.server.auth import Auth
from gpufleet.store import SqlStore
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

ENV = {"with": ["numpy>=2"], "python": "3.12"}
SPEC_KEY = EnvSpec(with_=("numpy>=2",), python="3.12").key()
KEY = lock_key(SPEC_KEY, "3.12", None)
LOCK = b"numpy==2.1.3\n"
LOCK_SHA = hashlib.sha256(LOCK).hexdigest()
BUILD = "c" * 64


def _held(client: TestClient, admin: dict[str, str], worker: dict[str, str], **env: Any) -> Any:
    """A job with an environment, claimed by worker ``box``; its lease."""
    w = register(client, worker, "box")
    submit(client, admin, environment={**ENV, **env})
    return claim(client, worker, w["id"])


def _put(lease: dict[str, Any], **over: Any) -> dict[str, Any]:
    body = {
        "sha256": LOCK_SHA,
        "spec_key": SPEC_KEY,
        "python": "3.12",
        "torch_backend": None,
        "job_id": lease["job_id"],
        "attempt": lease["attempt"],
        "secret": lease["secret"],
        "replace": False,
    }
    return {**body, **over}


def _upload(client: TestClient, headers: dict[str, str], data: bytes = LOCK) -> str:
    sha = hashlib.sha256(data).hexdigest()
    r = client.put(f"/v1/blobs/{sha}", content=data, headers=headers)
    assert r.status_code in (200, 201), r.text
    return sha


def test_the_first_build_records_the_lock_and_every_later_one_reads_it(
    client: TestClient, store: SqlStore, admin: dict[str, str], worker: dict[str, str]
) -> None:
    url = f"/v1/environments/locks/{KEY}"
    assert_error(client.get(url, headers=worker), 404, "not_found", "has no lock recorded")
    lease = _held(client, admin, worker)
    _upload(client, worker)
    r = client.put(url, json=_put(lease), headers=worker)
    assert r.status_code == 201, r.text
    first = r.json()
    assert (first["sha256"], first["spec_key"], first["job_id"], first["worker_name"]) == (
        LOCK_SHA,
        SPEC_KEY,
        lease["job_id"],
        "box",
    )
    assert first["replaced_at"] is None
    # a second build that resolved the spec too gets the recorded lock back, and uses it
    other = _upload(client, worker, b"numpy==2.2.0\n")
    again = client.put(url, json=_put(lease, sha256=other), headers=worker)
    assert again.status_code == 200, again.text
    assert again.json() == first
    assert client.get(url, headers=worker).json() == first
    assert client.get(url, headers=admin).json() == first
    assert first["pool"] == "default"
    # submitters do not read locks
    submitter = bearer(Auth(store).create("sub", Role.SUBMITTER)[1])
    assert_error(client.get(url, headers=submitter), 403)


def test_a_lock_is_its_pools_and_no_other_pools_worker_reads_or_writes_it(
    client: TestClient, store: SqlStore, admin: dict[str, str], worker: dict[str, str]
) -> None:
    url = f"/v1/environments/locks/{KEY}"
    lease = _held(client, admin, worker)
    _upload(client, worker)
    mine = client.put(url, json=_put(lease), headers=worker).json()
    pool_b = bearer(Auth(store).create("wb", Role.WORKER, ["b"])[1])
    # pool b has no lock of its own, may not read pool default's, nor its blob
    assert_error(client.get(url, headers=pool_b), 404, "not_found", "pool 'b'")
    e = assert_error(client.get(f"{url}?pool=default", headers=pool_b), 403, None, "'default'")
    assert e["detail"]["pool"] == "default"
    assert client.get(f"/v1/blobs/{LOCK_SHA}", headers=pool_b).status_code == 404
    # nor write it: pool default's job is not one it sees, let alone holds
    assert_error(client.put(url, json=_put(lease), headers=pool_b), 404, None, "no job")
    # its own job of the same spec records pool b's lock, which leaves pool default's be
    wb = register(client, pool_b, "box-b")
    submit(client, admin, environment=ENV, pool="b")
    lease_b = claim(client, pool_b, wb["id"])
    theirs = _upload(client, pool_b, b"numpy==2.0.0\n")
    r = client.put(url, json=_put(lease_b, sha256=theirs), headers=pool_b)
    assert r.status_code == 201, r.text
    assert (r.json()["pool"], r.json()["sha256"]) == ("b", theirs)
    assert client.get(url, headers=worker).json() == mine
    assert client.get(url, headers=pool_b).json() == r.json()
    # an admin names the pool (default: "default")
    assert client.get(url, headers=admin).json() == mine
    assert client.get(f"{url}?pool=b", headers=admin).json() == r.json()
    assert_error(client.get(f"{url}?pool=c", headers=admin), 404, None, "pool 'c'")


def _refused(client: TestClient, admin: dict[str, str], env: dict[str, Any]) -> dict[str, Any]:
    """Submit a job with ``env`` (each file's bytes uploaded first); its 422 error."""
    body: dict[str, Any] = {}
    for role, (name, data) in env.items():
        sha = _upload(client, admin, data)
        body[role] = {"name": name, "sha256": sha, "size": len(data)}
    r = client.post("/v1/jobs", json=job_body(environment=body), headers=admin)
    return assert_error(r, 422, "validation_error", "job 'train'")


PYPROJECT = b'[project]\nname = "p"\nversion = "1"\ndependencies = ["gfdemo"]\n'
UV_LOCK = b"""version = 1

[[package]]
name = "gfdemo"
version = "1.0"
source = { git = "https://host/gfdemo?rev=v1#0123abcd" }
"""


def test_an_environment_file_that_reaches_past_the_index_is_refused_naming_the_field(
    client: TestClient, admin: dict[str, str]
) -> None:
    for data, said in [
        (b"numpy\n-r /etc/passwd\n", "line 2: '-r'"),
        (b"--index-url\thttp://x\nnumpy\n", "line 1: '--index-url'"),
        (b"numpy\npkg @ https://x/y.whl\n", "line 2: 'pkg @ https://x/y.whl'"),
        (b"numpy\xff\n", "not UTF-8"),
    ]:
        e = _refused(client, admin, {"requirements": ("requirements.txt", data)})
        assert said in e["message"] and e["detail"]["field"] == "environment.requirements", e
    for extra, said in [
        (b'[[tool.uv.index]]\nname = "x"\nurl = "http://x"\n', "tool.uv.index"),
        (b'[tool.uv.sources]\ngfdemo = { path = "/etc" }\n', "tool.uv.sources"),
    ]:
        e = _refused(client, admin, {"project": ("pyproject.toml", PYPROJECT + extra)})
        assert said in e["message"] and e["detail"]["field"] == "environment.project", e
    e = _refused(
        client, admin, {"project": ("pyproject.toml", PYPROJECT), "lock": ("uv.lock", UV_LOCK)}
    )
    assert "package 'gfdemo': source git" in e["message"], e
    assert e["detail"]["field"] == "environment.lock", e
    # what asks for registry packages only is taken
    good = UV_LOCK.replace(b'git = "https://host/gfdemo?rev=v1#0123abcd"', b'registry = "x"')
    body = {}
    for role, name, data in (("project", "pyproject.toml", PYPROJECT), ("lock", "uv.lock", good)):
        body[role] = {"name": name, "sha256": _upload(client, admin, data), "size": len(data)}
    r = client.post("/v1/jobs", json=job_body(environment=body), headers=admin)
    assert r.status_code == 201, r.text


def test_an_upgrade_replaces_the_lock_and_the_audit_log_says_so(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    key = lock_key(EnvSpec(with_=("numpy>=2",), python="3.12", upgrade=True).key(), "3.12", None)
    assert key == KEY  # upgrade is not part of the key: it resolves the same spec afresh
    lease = _held(client, admin, worker, upgrade=True)
    _upload(client, worker)
    url = f"/v1/environments/locks/{KEY}"
    assert client.put(url, json=_put(lease), headers=worker).status_code == 201
    newer = _upload(client, worker, b"numpy==2.3.1\n")
    r = client.put(url, json=_put(lease, sha256=newer, replace=True), headers=worker)
    assert r.status_code == 200, r.text
    assert r.json()["sha256"] == newer and r.json()["replaced_at"] is not None
    assert client.get(url, headers=worker).json()["sha256"] == newer
    events = [(a["event"], a["target"]) for a in client.get("/v1/audit", headers=admin).json()]
    assert ("environment.lock_replaced", KEY) in events, events


def test_a_lock_is_recorded_only_by_the_holder_of_a_job_with_that_spec(
    client: TestClient, store: SqlStore, admin: dict[str, str], worker: dict[str, str]
) -> None:
    url = f"/v1/environments/locks/{KEY}"
    lease = _held(client, admin, worker)
    assert_error(client.put(url, json=_put(lease), headers=worker), 404, None, "sha256")
    _upload(client, worker)
    assert_error(client.put(url, json=_put(lease, secret="x" * 40), headers=worker), 403)
    stranger = bearer(Auth(store).create("other", Role.WORKER)[1])
    assert_error(client.put(url, json=_put(lease), headers=stranger), 403)
    assert_error(client.put(url, json=_put(lease), headers=admin), 403)
    stale = _put(lease, attempt=lease["attempt"] + 1)
    assert_error(client.put(url, json=stale, headers=worker), 409, None, "stale lease")
    wrong = {
        "spec_key": ("f" * 64, "spec_key"),
        "python": ("3.11", "key"),
        "replace": (True, "replace"),
    }
    for name, (value, field) in wrong.items():
        e = assert_error(client.put(url, json=_put(lease, **{name: value}), headers=worker), 422)
        assert e["detail"]["field"] == field, e
    assert_error(client.put(url, json=_put(lease, python="3.x"), headers=worker), 422)
    assert_error(client.put(url, json=_put(lease, extra=1), headers=worker), 422)
    for bad in ("nope", "A" * 64, "a" * 63):
        where = f"/v1/environments/locks/{bad}"
        assert_error(client.put(where, json=_put(lease), headers=worker), 422)
        assert_error(client.get(where, headers=worker), 422)
    assert client.put(url, json=_put(lease), headers=worker).status_code == 201


def test_a_job_without_an_environment_has_no_lock_to_record(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    w = register(client, worker, "box")
    submit(client, admin)
    lease = claim(client, worker, w["id"])
    _upload(client, worker)
    r = client.put(f"/v1/environments/locks/{KEY}", json=_put(lease), headers=worker)
    assert assert_error(r, 422, None, "names no environment")["detail"]["field"] == "job_id"


def test_an_environment_no_worker_can_build_fails_the_job_at_once_saying_why(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    lease = _held(client, admin, worker)
    why = "No solution found: nonexistent-pkg was not found in the package registry"
    body = {"attempt": 1, "error": why, "failure": "environment", "final": True}
    r = client.post(f"/v1/jobs/{lease['job_id']}/finish", json=body, headers=worker)
    assert r.status_code == 200, r.text
    job = r.json()
    assert (job["status"], job["attempts"], job["failure"]) == ("failed", 1, "environment")
    assert why in job["error"] and "cannot be built on any worker" in job["error"]
    shown = client.get(f"/v1/jobs/{lease['job_id']}", headers=admin).json()
    assert shown["failure"] == "environment"
    assert shown["history"][0]["failure"] == "environment"
    stream = client.get(f"/v1/jobs/{lease['job_id']}/events", headers=admin).text
    failed = [
        json.loads(line.removeprefix("data: "))
        for block in stream.split("\n\n")
        if "event: state" in block
        for line in block.splitlines()
        if line.startswith("data: ")
    ][-1]
    assert failed["failure"] == "environment" and failed["event"] == "fail"
    for bad in ({"attempt": 1, "failure": "disk"}, {"attempt": 1, "final": True}):
        finish = f"/v1/jobs/{lease['job_id']}/finish"
        assert_error(client.post(finish, json=bad, headers=worker), 422)


def test_a_batched_finish_report_carries_the_failure_class(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    lease = _held(client, admin, worker)
    report = {
        "kind": "finish",
        "job_id": lease["job_id"],
        "attempt": 1,
        "error": "environment: disk full",
        "failure": "environment",
    }
    r = client.post("/v1/reports", json={"reports": [report]}, headers=worker)
    assert r.status_code == 200, r.text
    [result] = r.json()["results"]
    assert result["status"] == 200, result
    # not final: retried as any failure is
    assert (result["job"]["status"], result["job"]["failure"]) == ("pending", "environment")


def test_a_start_report_keeps_the_environment_and_metrics_count_its_build(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    lease = _held(client, admin, worker)
    env = {
        "key": BUILD,
        "spec_key": SPEC_KEY,
        "python": "3.12.4",
        "built": True,
        "seconds": 12.5,
        "versions": {"numpy": "2.1.3"},
        "torch_backend": None,
    }
    start = {"attempt": 1, "environment": env}
    r = client.post(f"/v1/jobs/{lease['job_id']}/start", json=start, headers=worker)
    assert r.status_code == 204, r.text
    shown = client.get(f"/v1/jobs/{lease['job_id']}", headers=admin).json()
    assert shown["history"][0]["environment"] == env
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(client.get("/metrics", headers=admin).text)
        for s in family.samples
    }
    assert samples[("gpufleet_environment_builds_total", (("result", "built"),))] == 1
    assert samples[("gpufleet_environment_build_seconds_sum", ())] == 12.5
    assert samples[("gpufleet_environment_build_seconds_bucket", (("le", "30.0"),))] == 1
    too_many = {**env, "versions": {f"p{n}": "1" for n in range(2001)}}
    body = {"attempt": 1, "environment": too_many}
    assert_error(client.post(f"/v1/jobs/{lease['job_id']}/start", json=body, headers=worker), 422)


def test_a_heartbeat_lists_the_workers_environments_for_everyone_to_see(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    w = register(client, worker, "box")
    assert w["environments"] == []
    env = {
        "key": BUILD,
        "spec_key": SPEC_KEY,
        "python": "3.12.4",
        "size_bytes": 512 << 20,
        "last_used": 1_700_000_000.0,
        "describe": "--with numpy>=2, --python 3.12",
        "torch_backend": "cu124",
    }
    beat = f"/v1/workers/{w['id']}/heartbeat"
    assert client.post(beat, json={"environments": [env]}, headers=worker).status_code == 200
    assert client.get(f"/v1/workers/{w['id']}", headers=admin).json()["environments"] == [env]
    assert client.post(beat, json={}, headers=worker).status_code == 200  # unchanged
    [listed] = client.get("/v1/workers", headers=admin).json()
    assert listed["environments"] == [env]
    assert_error(client.post(beat, json={"environments": [env] * 501}, headers=worker), 422)
    assert client.post(beat, json={"environments": []}, headers=worker).status_code == 200
    assert client.get(f"/v1/workers/{w['id']}", headers=admin).json()["environments"] == []
