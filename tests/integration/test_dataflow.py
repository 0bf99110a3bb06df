"""Inputs and artifacts through the API: package blobs are checked at submit, artifacts
at attach, and ``job:`` inputs hold a job until its dependency succeeded."""

from __future__ import annotations

import hashlib
import io
import tarfile

import zstandard

from gpufleet.archive import pack_path
from tests.integration.helpers import (
    TESTCLIENT_ON_HTTPX,
    assert_error,
    claim,
    job_body,
    register,
    submit,
)

pytestmark = TESTCLIENT_ON_HTTPX


def put(client, headers, data: bytes) -> str:
    sha = hashlib.sha256(data).hexdigest()
    assert client.put(f"/v1/blobs/{sha}", content=data, headers=headers).status_code in (200, 201)
    return sha


def good_archive(tmp_path) -> bytes:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "model.txt").write_text("weights")
    buf = io.BytesIO()
    pack_path(tmp_path / "pkg", buf)
    return buf.getvalue()


def evil_archive() -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    return zstandard.ZstdCompressor().compress(raw.getvalue())


def finish(client, headers, lease, exit_code: int = 0) -> None:
    body = {"attempt": lease["attempt"], "exit_code": exit_code}
    r = client.post(f"/v1/jobs/{lease['job_id']}/finish", json=body, headers=headers)
    assert r.status_code == 200, r.text


def test_a_package_must_be_on_the_server_and_be_a_safe_archive(client, admin) -> None:
    missing = {"kind": "blob", "ref": "a" * 64}
    r = client.post("/v1/jobs", json=job_body(inputs=[missing]), headers=admin)
    assert_error(r, 422, "validation_error", "inputs[0]", "not on the server")
    evil = put(client, admin, evil_archive())
    r = client.post(
        "/v1/jobs", json=job_body(inputs=[{"kind": "blob", "ref": evil}]), headers=admin
    )
    assert_error(r, 422, "unsafe_archive", "inputs[0]", "..")
    assert client.get("/v1/jobs", headers=admin).json() == [], "nothing was queued"


def test_artifacts_are_checked_attached_and_passed_to_the_job_that_waits(
    client, admin, worker, tmp_path
) -> None:
    train = submit(client, admin, name="train")
    infer = submit(
        client, admin, name="infer", inputs=[{"kind": "job", "ref": "train", "dest": "m"}]
    )
    shown = client.get(f"/v1/jobs/{infer}", headers=admin).json()
    assert shown["waiting"] == 1 and shown["spec"]["inputs"][0]["ref"] == train
    w = register(client, worker, "w1", cpu_slots=2)["id"]
    lease = claim(client, worker, w)
    assert lease["job_id"] == train, "the waiting job is not claimable"
    empty = client.post(f"/v1/workers/{w}/claim", json={"cpu_slots": 1, "wait": 0}, headers=worker)
    assert empty.status_code == 204, empty.text
    evil = put(client, worker, evil_archive())
    r = client.post(
        f"/v1/jobs/{train}/artifact", json={"attempt": 1, "sha256": evil}, headers=worker
    )
    assert_error(r, 422, "unsafe_archive")
    sha = put(client, worker, good_archive(tmp_path))
    r = client.post(
        f"/v1/jobs/{train}/artifact", json={"attempt": 1, "sha256": sha}, headers=worker
    )
    assert r.status_code == 204, r.text
    stale = client.post(
        f"/v1/jobs/{train}/artifact", json={"attempt": 2, "sha256": sha}, headers=worker
    )
    assert_error(stale, 409, "conflict")
    finish(client, worker, lease)
    art = client.get(f"/v1/jobs/{train}/artifact", headers=admin).json()
    assert art["sha256"] == sha and art["files"] == [{"path": "model.txt", "size": 7}]
    second = claim(client, worker, w)
    assert second["job_id"] == infer
    assert second["inputs"] == [
        {
            "kind": "job",
            "dest": "m",
            "sha256": sha,
            "size": art["size"],
            "path": None,
            "label": "job:train",
        }
    ]


def test_a_failed_or_cancelled_dependency_fails_the_chain(client, admin, worker) -> None:
    first = submit(client, admin, name="first", max_attempts=1)
    second = submit(client, admin, name="second", inputs=[{"kind": "job", "ref": first}])
    third = submit(client, admin, name="third", inputs=[{"kind": "job", "ref": "second"}])
    w = register(client, worker, "w1")["id"]
    finish(client, worker, claim(client, worker, w), exit_code=1)
    for job_id, dep in ((second, "first"), (third, "second")):
        got = client.get(f"/v1/jobs/{job_id}", headers=admin).json()
        assert got["status"] == "failed", got
        assert f"dependency {dep}" in got["error"]
    r = client.post(f"/v1/jobs/{second}/requeue", headers=admin)
    assert_error(r, 409, "conflict", "requeue that job first")
    # cancelling a job fails the jobs that wait for it, too
    solo = submit(client, admin, name="solo")
    after = submit(client, admin, name="after", inputs=[{"kind": "job", "ref": solo}])
    client.post(f"/v1/jobs/{solo}/cancel", headers=admin)
    got = client.get(f"/v1/jobs/{after}", headers=admin).json()
    assert got["status"] == "failed" and "cancelled" in got["error"]


def test_a_manifest_whose_jobs_wait_for_each_other_is_refused(client, admin) -> None:
    plan = {
        "name": "loop",
        "jobs": [
            job_body("a", manifest="loop", inputs=[{"kind": "job", "ref": "b"}]),
            job_body("b", manifest="loop", inputs=[{"kind": "job", "ref": "a"}]),
        ],
    }
    r = client.post("/v1/manifests", json=plan, headers=admin)
    assert_error(r, 422, "validation_error", "a -> b -> a")
    assert client.get("/v1/jobs", headers=admin).json() == []


def test_unknown_and_ambiguous_dependencies_are_named(client, admin) -> None:
    r = client.post(
        "/v1/jobs", json=job_body(inputs=[{"kind": "job", "ref": "ghost"}]), headers=admin
    )
    assert_error(r, 422, "validation_error", "inputs[0]", "no job 'ghost'")
    submit(client, admin, name="twin")
    submit(client, admin, name="twin")
    r = client.post(
        "/v1/jobs", json=job_body(inputs=[{"kind": "job", "ref": "twin"}]), headers=admin
    )
    assert_error(r, 422, "validation_error", "several jobs are named 'twin'")
