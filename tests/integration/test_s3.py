"""Blobs on an object store (``--blob-store s3://BUCKET/PREFIX``) against a real
S3-protocol server on loopback (moto's server mode): verified single-request uploads,
resumable sessions that another server takes over, ``Range`` downloads, and nothing kept
(no object, no unfinished multipart upload) from bytes that do not hash to their id."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from starlette.requests import ClientDisconnect

from gpufleet.domain.models import Role
from gpufleet.errors import HashMismatch, StorageUnusable
from gpufleet.server import QueueSettings, create_app
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.server.serve import open_blob_bytes
from gpufleet.server.uploads import SESSION_TTL
from gpufleet.store import SqlStore
from gpufleet.store.s3blobs import MIN_PART, S3Blobs, part_size
from tests.integration.helpers import TESTCLIENT_ON_HTTPX, assert_error, bearer
from tests.s3server import S3Server

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX

MIB = 1 << 20
DATA = os.urandom(20 * MIB)  # two whole 8 MiB parts and a short last one
SHA = hashlib.sha256(DATA).hexdigest()
PREFIX = "lab/blobs"
NO_DIR = Path("/nonexistent/no-data-dir")  # an object store needs none


@pytest.fixture
def bucket(s3: S3Server) -> str:
    return s3.bucket()


def server(
    store: SqlStore,
    s3: S3Server,
    bucket: str,
    clock: Callable[[], float] = time.time,
) -> BlobService:
    """One server's blob service on the shared bucket (its own process memory: no data dir
    and no hashes shared with another)."""
    storage = open_blob_bytes(f"s3://{bucket}/{PREFIX}", NO_DIR, s3.endpoint)
    service = BlobService(store, storage, BlobSettings(), clock=clock)
    service.startup()
    return service


async def body(data: bytes, cut: bool = False) -> AsyncIterator[bytes]:
    """``data`` in 1 MiB chunks; with ``cut``, the connection breaks after them."""
    for i in range(0, len(data), MIB):
        yield data[i : i + MIB]
        await asyncio.sleep(0)
    if cut:
        raise ClientDisconnect


def stored(service: BlobService, sha256: str) -> bytes:
    with service.storage.reader(sha256) as f:
        return f.read()


def test_part_size_stays_within_s3s_limits() -> None:
    assert part_size(0) == part_size(20 * MIB) == MIN_PART == 8 * MIB
    big = 200 << 30  # 200 GiB: 8 MiB parts would be 25,600 of them
    step = part_size(big)
    assert step % MIB == 0 and -(-big // step) <= 10_000 and step >= MIN_PART


def test_a_session_cut_on_one_server_is_finished_on_another(
    store: SqlStore, s3: S3Server, bucket: str
) -> None:
    a, b = server(store, s3, bucket), server(store, s3, bucket)
    up = a.uploads.create(SHA, len(DATA))
    assert up.id is not None

    # A takes 11 MiB, then the connection breaks: one whole part, 3 MiB kept as the tail.
    cut = asyncio.run(a.uploads.append(up.id, 0, body(DATA[: 11 * MIB], cut=True)))
    assert (cut.offset, cut.complete) == (11 * MIB, False)
    assert f"{PREFIX}/uploads/{up.id}/tail-{8 * MIB}" in s3.keys(bucket)
    assert a.has(SHA) is None and s3.keys(bucket, f"{PREFIX}/objects/") == []

    # The client goes on through B, which never saw a byte of it (no hash to go on from).
    where = b.uploads.state(up.id)
    assert (where.offset, where.receiving) == (11 * MIB, False)
    done = asyncio.run(b.uploads.append(up.id, where.offset, body(DATA[11 * MIB :])))
    assert done.complete

    assert a.has(SHA) == len(DATA) == b.has(SHA)
    assert stored(a, SHA) == DATA
    # nothing of the session is left: no tail, no record, no unfinished upload
    assert s3.keys(bucket) == [f"{PREFIX}/objects/{SHA[:2]}/{SHA}"]
    assert s3.unfinished(bucket) == []


def test_a_session_on_one_server_completes_without_a_copy_or_a_read_back(
    store: SqlStore, s3: S3Server, bucket: str
) -> None:
    a = server(store, s3, bucket)
    up = a.uploads.create(SHA, len(DATA))
    assert up.id is not None
    first = asyncio.run(a.uploads.append(up.id, 0, body(DATA[: 5 * MIB], cut=True)))
    assert first.offset == 5 * MIB  # all of it in the tail: no whole part yet
    done = asyncio.run(a.uploads.append(up.id, first.offset, body(DATA[5 * MIB :])))
    assert done.complete and stored(a, SHA) == DATA
    assert s3.unfinished(bucket) == [] and s3.keys(bucket, f"{PREFIX}/uploads/") == []


@pytest.mark.parametrize("taken_over", [False, True], ids=["same-server", "taken-over"])
def test_bytes_that_do_not_hash_to_the_id_leave_nothing(
    store: SqlStore, s3: S3Server, bucket: str, taken_over: bool
) -> None:
    a = server(store, s3, bucket)
    b = server(store, s3, bucket) if taken_over else a
    wrong = bytearray(DATA)
    wrong[-1] ^= 1
    up = a.uploads.create(SHA, len(DATA))
    assert up.id is not None
    half = asyncio.run(a.uploads.append(up.id, 0, body(bytes(wrong[: 9 * MIB]), cut=True)))
    with pytest.raises(HashMismatch, match="nothing was kept"):
        asyncio.run(b.uploads.append(up.id, half.offset, body(bytes(wrong[half.offset :]))))
    assert s3.keys(bucket) == [] and s3.unfinished(bucket) == []
    assert a.has(SHA) is None and store.get_upload(up.id) is None


@pytest.mark.parametrize("over", ["part", "tail"])
def test_bytes_written_over_by_another_request_are_never_stored(
    store: SqlStore, s3: S3Server, bucket: str, over: str
) -> None:
    """Sessions on an object store take no lock. A request elsewhere that writes other
    bytes over a part or the tail this server stored (and hashed) is caught: the server
    no longer trusts its hash, reads the upload back, and keeps nothing."""
    a = server(store, s3, bucket)
    up = a.uploads.create(SHA, len(DATA))
    assert up.id is not None
    first = asyncio.run(a.uploads.append(up.id, 0, body(DATA[: 9 * MIB], cut=True)))
    record = f"{PREFIX}/uploads/{up.id}/"
    if over == "part":
        mpu = s3.client.get_object(Bucket=bucket, Key=record + "mpu")["Body"].read().decode()
        s3.client.upload_part(
            Bucket=bucket,
            Key=f"{PREFIX}/objects/{SHA[:2]}/{SHA}",
            UploadId=mpu,
            PartNumber=1,
            Body=os.urandom(8 * MIB),
        )
    else:
        s3.client.put_object(Bucket=bucket, Key=record + f"tail-{8 * MIB}", Body=os.urandom(MIB))
    with pytest.raises(HashMismatch, match="nothing was kept"):
        asyncio.run(a.uploads.append(up.id, first.offset, body(DATA[first.offset :])))
    assert s3.keys(bucket) == [] and s3.unfinished(bucket) == []
    assert a.has(SHA) is None


def test_aborted_and_expired_sessions_leave_nothing(
    store: SqlStore, s3: S3Server, bucket: str
) -> None:
    now = [time.time()]
    a = server(store, s3, bucket, clock=lambda: now[0])
    aborted, old = a.uploads.create(SHA, len(DATA)), a.uploads.create(SHA, len(DATA))
    assert aborted.id is not None and old.id is not None
    for up_id in (aborted.id, old.id):
        asyncio.run(a.uploads.append(up_id, 0, body(DATA[: 9 * MIB], cut=True)))
    a.uploads.abort(aborted.id)
    assert not [k for k in s3.keys(bucket) if aborted.id in k]
    now[0] += SESSION_TTL + 60  # a day and more with nothing sent: the session expires
    assert a.uploads.expire() == 1
    assert s3.keys(bucket) == [] and s3.unfinished(bucket) == []


def test_a_bucket_that_cannot_be_used_is_named_at_start(s3: S3Server) -> None:
    with pytest.raises(StorageUnusable, match=r"s3://no-such-bucket-here/.*checking the bucket"):
        open_blob_bytes("s3://no-such-bucket-here/x", NO_DIR, s3.endpoint)
    with pytest.raises(Exception, match="s3://BUCKET"):
        S3Blobs.from_url("s3://?x=1", s3.endpoint)


@pytest.fixture
def http(store: SqlStore, s3: S3Server, bucket: str) -> Iterator[tuple[TestClient, dict[str, str]]]:
    from fastapi.testclient import TestClient

    app = create_app(store, QueueSettings(), server(store, s3, bucket))
    headers = bearer(Auth(store).create("admin", Role.ADMIN)[1])
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, headers


def test_put_head_and_ranged_get_through_the_api(
    http: tuple[TestClient, dict[str, str]], s3: S3Server, bucket: str
) -> None:
    client, admin = http
    small = b"a small blob"
    small_sha = hashlib.sha256(small).hexdigest()
    for data, sha in ((small, small_sha), (DATA, SHA)):  # one PUT; a multipart upload
        put = client.put(f"/v1/blobs/{sha}", content=data, headers=admin)
        assert put.status_code == 201, put.text
        head = client.head(f"/v1/blobs/{sha}", headers=admin)
        assert head.headers["content-length"] == str(len(data))
        got = client.get(f"/v1/blobs/{sha}", headers=admin)
        assert got.status_code == 200 and got.content == data

    part = client.get(
        f"/v1/blobs/{SHA}", headers={**admin, "Range": f"bytes={9 * MIB}-{10 * MIB - 1}"}
    )
    assert part.status_code == 206 and part.content == DATA[9 * MIB : 10 * MIB]
    assert part.headers["content-range"] == f"bytes {9 * MIB}-{10 * MIB - 1}/{len(DATA)}"
    suffix = client.get(f"/v1/blobs/{SHA}", headers={**admin, "Range": "bytes=-100"})
    assert suffix.status_code == 206 and suffix.content == DATA[-100:]
    outside = client.get(f"/v1/blobs/{SHA}", headers={**admin, "Range": f"bytes={len(DATA)}-"})
    assert_error(outside, 416, "range_not_satisfiable")

    wrong = client.put(f"/v1/blobs/{'0' * 64}", content=DATA, headers=admin)
    assert_error(wrong, 422, "hash_mismatch")
    assert sorted(s3.keys(bucket)) == sorted(
        f"{PREFIX}/objects/{s[:2]}/{s}" for s in (small_sha, SHA)
    )
    assert s3.unfinished(bucket) == []


def test_an_upload_without_its_hash_is_refused_by_name_and_starts_nothing(
    http: tuple[TestClient, dict[str, str]], s3: S3Server, bucket: str
) -> None:
    """An object store's session writes the blob's own key: the hash is needed up front
    (the SDK then hashes first and opens a named session)."""
    client, admin = http
    r = client.post("/v1/uploads", json={"size": len(DATA)}, headers=admin)
    error = assert_error(r, 422, "validation_error", "sha256")
    assert error["detail"] == {"field": "sha256"} and f"s3://{bucket}" in error["message"]
    assert s3.unfinished(bucket) == [] and s3.keys(bucket) == []


def test_an_object_store_that_fails_answers_503_and_keeps_nothing(
    http: tuple[TestClient, dict[str, str]], s3: S3Server, bucket: str
) -> None:
    client, admin = http
    s3.client.delete_bucket(Bucket=bucket)  # the operator removed it under the server
    put = client.put(f"/v1/blobs/{SHA}", content=DATA, headers=admin)
    assert bucket in assert_error(put, 503, "storage_unusable")["message"]
    assert client.head(f"/v1/blobs/{SHA}", headers=admin).status_code == 404


def test_a_blob_removed_from_the_store_under_the_server_answers_503(
    http: tuple[TestClient, dict[str, str]], s3: S3Server, bucket: str
) -> None:
    client, admin = http
    data = b"soon gone"
    sha = hashlib.sha256(data).hexdigest()
    assert client.put(f"/v1/blobs/{sha}", content=data, headers=admin).status_code == 201
    s3.client.delete_object(Bucket=bucket, Key=f"{PREFIX}/objects/{sha[:2]}/{sha}")
    got = client.get(f"/v1/blobs/{sha}", headers=admin)
    assert "it is not there" in assert_error(got, 503, "storage_unusable")["message"]
