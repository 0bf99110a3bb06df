"""The blob API: content addressing, verification, dedup, resumable sessions, ranges,
size limits and a full disk; nothing half-written is ever kept or recorded."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI

from gpufleet.server import QueueSettings, create_app
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.store import SqlStore
from gpufleet.store.blobfiles import BlobFiles
from tests.integration.helpers import TESTCLIENT_ON_HTTPX, assert_error

pytestmark = TESTCLIENT_ON_HTTPX

DATA = os.urandom(300_000)
SHA = hashlib.sha256(DATA).hexdigest()


def leftovers(tmp_path: Path) -> list[Path]:
    """Files under the blob dir other than complete objects."""
    root = tmp_path / "blobs"
    return [p for p in root.rglob("*") if p.is_file() and "objects" not in p.parts]


def objects(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "blobs" / "objects").rglob("*") if p.is_file()]


def test_put_then_head_then_get_and_second_put_sends_nothing_new(client, admin, tmp_path) -> None:
    assert client.head(f"/v1/blobs/{SHA}", headers=admin).status_code == 404
    r = client.put(f"/v1/blobs/{SHA}", content=DATA, headers=admin)
    assert r.status_code == 201, r.text
    assert r.json()["size"] == len(DATA)
    head = client.head(f"/v1/blobs/{SHA}", headers=admin)
    assert head.status_code == 200 and head.headers["content-length"] == str(len(DATA))
    got = client.get(f"/v1/blobs/{SHA}", headers=admin)
    assert got.status_code == 200 and got.content == DATA
    again = client.put(f"/v1/blobs/{SHA}", content=DATA, headers=admin)
    assert again.status_code == 200  # already there: not stored twice
    assert len(objects(tmp_path)) == 1
    listed = client.get("/v1/blobs", headers=admin).json()
    assert [b["sha256"] for b in listed] == [SHA]


def test_hash_mismatch_is_refused_and_nothing_is_kept(client, admin, tmp_path) -> None:
    wrong = hashlib.sha256(b"something else").hexdigest()
    r = client.put(f"/v1/blobs/{wrong}", content=DATA, headers=admin)
    assert_error(r, 422, "hash_mismatch", SHA, "nothing was kept")
    assert client.head(f"/v1/blobs/{wrong}", headers=admin).status_code == 404
    assert objects(tmp_path) == [] and leftovers(tmp_path) == []


@pytest.mark.parametrize("bad", ["abc", "g" * 64, "A" * 64, "a" * 65])
def test_blob_ids_must_be_64_hex(client, admin, bad) -> None:
    assert_error(client.get(f"/v1/blobs/{bad}", headers=admin), 422, "validation_error")
    assert_error(client.put(f"/v1/blobs/{bad}", content=b"x", headers=admin), 422)


def test_range_download(client, admin) -> None:
    client.put(f"/v1/blobs/{SHA}", content=DATA, headers=admin)
    part = client.get(f"/v1/blobs/{SHA}", headers={**admin, "Range": "bytes=1000-1999"})
    assert part.status_code == 206
    assert part.content == DATA[1000:2000]
    assert part.headers["content-range"] == f"bytes 1000-1999/{len(DATA)}"
    tail = client.get(f"/v1/blobs/{SHA}", headers={**admin, "Range": "bytes=299990-"})
    assert tail.status_code == 206 and tail.content == DATA[299_990:]
    suffix = client.get(f"/v1/blobs/{SHA}", headers={**admin, "Range": "bytes=-10"})
    assert suffix.content == DATA[-10:]
    past = client.get(f"/v1/blobs/{SHA}", headers={**admin, "Range": f"bytes={len(DATA)}-"})
    assert_error(past, 416, "range_not_satisfiable")
    assert_error(
        client.get(f"/v1/blobs/{SHA}", headers={**admin, "Range": "lines=1-2"}), 422, None, "Range"
    )


def test_tokens_are_required_and_workers_may_use_blobs(client, admin, worker) -> None:
    assert_error(client.put(f"/v1/blobs/{SHA}", content=DATA), 401)
    assert client.put(f"/v1/blobs/{SHA}", content=DATA, headers=worker).status_code == 201
    assert client.get(f"/v1/blobs/{SHA}", headers=worker).content == DATA


@pytest.mark.parametrize("blob_settings", [BlobSettings(max_size=100_000)])
def test_size_limit_by_content_length_and_by_bytes(client, admin, tmp_path) -> None:
    r = client.put(f"/v1/blobs/{SHA}", content=DATA, headers=admin)
    assert_error(r, 413, "too_large", "100000")

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused once the limit is passed
        for i in range(0, len(DATA), 50_000):
            yield DATA[i : i + 50_000]

    r = client.put(f"/v1/blobs/{SHA}", content=chunks(), headers=admin)
    assert_error(r, 413, "too_large")
    assert objects(tmp_path) == [] and leftovers(tmp_path) == []
    big = client.post("/v1/uploads", json={"sha256": SHA, "size": 200_000}, headers=admin)
    assert_error(big, 413, "too_large", "--max-blob-size")


def test_resumable_upload_resumes_from_the_committed_offset(client, admin, tmp_path) -> None:
    r = client.post("/v1/uploads", json={"sha256": SHA, "size": len(DATA)}, headers=admin)
    assert r.status_code == 201, r.text
    up = r.json()
    assert up["offset"] == 0 and not up["complete"]
    url = f"/v1/uploads/{up['id']}"
    first = client.patch(url, content=DATA[:120_000], headers={**admin, "Upload-Offset": "0"})
    assert first.json()["offset"] == 120_000
    # a client that lost track is told where the upload stands
    stale = client.patch(url, content=DATA[:10], headers={**admin, "Upload-Offset": "0"})
    error = assert_error(stale, 409, "conflict", "120000")
    assert error["detail"] == {"offset": 120_000}
    assert client.get(url, headers=admin).json()["offset"] == 120_000
    rest = client.patch(url, content=DATA[120_000:], headers={**admin, "Upload-Offset": "120000"})
    assert rest.json()["complete"] is True
    assert client.get(f"/v1/blobs/{SHA}", headers=admin).content == DATA
    assert_error(client.get(url, headers=admin), 404)  # the session is gone
    assert leftovers(tmp_path) == []
    # the server has it now: a new session says so and needs no bytes
    again = client.post("/v1/uploads", json={"sha256": SHA, "size": len(DATA)}, headers=admin)
    assert again.status_code == 200 and again.json()["complete"] is True


def test_a_session_opened_without_its_hash_is_named_by_what_arrived(
    client, admin, tmp_path
) -> None:
    r = client.post("/v1/uploads", json={"size": len(DATA)}, headers=admin)
    assert r.status_code == 201, r.text
    up = r.json()
    assert up["sha256"] is None and up["offset"] == 0 and not up["complete"]
    url = f"/v1/uploads/{up['id']}"
    first = client.patch(url, content=DATA[:120_000], headers={**admin, "Upload-Offset": "0"})
    assert first.json() | {"receiving": False} == up | {"offset": 120_000}
    assert client.get(url, headers=admin).json()["sha256"] is None  # not named until the end
    rest = client.patch(url, content=DATA[120_000:], headers={**admin, "Upload-Offset": "120000"})
    assert rest.status_code == 200, rest.text
    assert rest.json()["complete"] is True and rest.json()["sha256"] == SHA
    assert client.get(f"/v1/blobs/{SHA}", headers=admin).content == DATA
    assert leftovers(tmp_path) == [] and [p.name for p in objects(tmp_path)] == [SHA]
    # the same bytes again, unnamed: the session ends on the blob already there
    again = client.post("/v1/uploads", json={"size": len(DATA)}, headers=admin).json()
    done = client.patch(
        f"/v1/uploads/{again['id']}", content=DATA, headers={**admin, "Upload-Offset": "0"}
    )
    assert done.json()["sha256"] == SHA and [p.name for p in objects(tmp_path)] == [SHA]
    assert leftovers(tmp_path) == []


def test_a_session_whose_bytes_do_not_match_keeps_nothing(client, admin, tmp_path) -> None:
    up = client.post("/v1/uploads", json={"sha256": SHA, "size": 10}, headers=admin).json()
    r = client.patch(
        f"/v1/uploads/{up['id']}", content=b"0123456789", headers={**admin, "Upload-Offset": "0"}
    )
    assert_error(r, 422, "hash_mismatch")
    assert client.head(f"/v1/blobs/{SHA}", headers=admin).status_code == 404
    assert objects(tmp_path) == [] and leftovers(tmp_path) == []


def test_more_bytes_than_declared_are_refused(client, admin) -> None:
    up = client.post("/v1/uploads", json={"sha256": SHA, "size": 10}, headers=admin).json()
    r = client.patch(
        f"/v1/uploads/{up['id']}", content=DATA[:20], headers={**admin, "Upload-Offset": "0"}
    )
    assert_error(r, 413, "too_large")
    assert client.get(f"/v1/uploads/{up['id']}", headers=admin).json()["offset"] == 0


def test_leftovers_of_a_crash_are_removed_at_start(store: SqlStore, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    files = BlobFiles(tmp_path / "blobs")
    files.clean(set(), time.time())  # creates the folders, as a first start would
    (files.tmp / "put-deadbeef").write_bytes(b"half a blob")
    orphan = files.sessions / ("u-" + "0" * 24)
    orphan.write_bytes(b"a session nobody recorded")
    an_hour_ago = time.time() - 3700
    for old in (files.tmp / "put-deadbeef", orphan):
        os.utime(old, (an_hour_ago, an_hour_ago))
    # another replica sharing the data dir is writing these right now: they stay
    (files.tmp / "put-cafe").write_bytes(b"being written")
    young = files.sessions / ("u-" + "1" * 24)
    young.write_bytes(b"just created, its row not yet written")
    app = create_app(store, QueueSettings(), BlobService(store, files, BlobSettings()))
    with TestClient(app):
        pass
    assert sorted(p.name for p in files.tmp.iterdir()) == ["put-cafe"]
    assert not orphan.exists() and young.exists()


def _mount_tmpfs(where: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


@pytest.fixture
def full_disk_app(store: SqlStore, tmp_path: Path) -> Iterator[FastAPI]:
    disk = tmp_path / "small"
    if not _mount_tmpfs(disk, "1m"):
        pytest.skip("needs root and a mountable tmpfs to fill a disk for real")
    try:
        yield create_app(
            store, QueueSettings(), BlobService(store, BlobFiles(disk / "blobs"), BlobSettings())
        )
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_answers_507_and_keeps_no_partial_blob(
    full_disk_app: FastAPI, admin: dict[str, str], tmp_path: Path
) -> None:
    from fastapi.testclient import TestClient

    big = os.urandom(3 << 20)
    sha = hashlib.sha256(big).hexdigest()
    with TestClient(full_disk_app, raise_server_exceptions=False) as c:
        r = c.put(f"/v1/blobs/{sha}", content=big, headers=admin)
        assert_error(r, 507, "insufficient_storage", "disk is full")
        assert c.head(f"/v1/blobs/{sha}", headers=admin).status_code == 404
        root = tmp_path / "small" / "blobs"
        assert [p for p in root.rglob("*") if p.is_file()] == []
        # the disk has room again for a small blob: the server goes on working
        ok = c.put(f"/v1/blobs/{SHA}", content=DATA, headers=admin)
        assert ok.status_code == 201


def test_a_blob_corrupted_on_disk_is_never_served_whole(
    client, admin, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """The server hashes a blob as it serves it and holds back its last part until the
    hash agrees: a corrupted blob's download ends short (a browser's fails too), and the
    log names the blob."""
    data = os.urandom(3 << 20)  # several parts of 1 MiB
    sha = hashlib.sha256(data).hexdigest()
    assert client.put(f"/v1/blobs/{sha}", content=data, headers=admin).status_code == 201
    (path,) = objects(tmp_path)
    path.chmod(0o644)
    with path.open("r+b") as f:
        f.seek(len(data) // 2)
        f.write(b"\x00" * 16)
    caplog.set_level("ERROR", "gpufleet.server")
    got = client.get(f"/v1/blobs/{sha}", headers=admin)
    assert len(got.content) < len(data)  # cut off before its end
    assert any(sha in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)
    # a range that covers it all is the whole blob, checked alike
    whole = client.get(f"/v1/blobs/{sha}", headers={**admin, "Range": "bytes=0-"})
    assert len(whole.content) < len(data)
    # the route logged why; no traceback is added to it
    assert not any(r.exc_info for r in caplog.records if r.name == "gpufleet.server")


def test_an_upload_session_belongs_to_the_token_that_opened_it(
    client, admin, store: SqlStore
) -> None:
    """Another token that learns a session's id can neither read its state, append to
    it, finish it nor abort it: to it the session does not exist."""
    from gpufleet.domain.models import Role
    from gpufleet.server.auth import Auth
    from tests.integration.helpers import bearer

    owner = bearer(Auth(store).create("alice", Role.SUBMITTER)[1])
    other = bearer(Auth(store).create("mallory", Role.SUBMITTER)[1])
    up = client.post("/v1/uploads", json={"sha256": SHA, "size": len(DATA)}, headers=owner)
    assert up.status_code == 201, up.text
    url = f"/v1/uploads/{up.json()['id']}"
    assert_error(client.get(url, headers=other), 404, "not_found")
    r = client.patch(url, content=DATA, headers={**other, "Upload-Offset": "0"})
    assert_error(r, 404, "not_found")
    assert_error(client.delete(url, headers=other), 404, "not_found")
    assert client.get(url, headers=owner).json()["offset"] == 0  # untouched
    r = client.patch(url, content=DATA, headers={**owner, "Upload-Offset": "0"})
    assert r.status_code == 200 and r.json()["complete"], r.text
