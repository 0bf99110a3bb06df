"""Resumable upload sessions under the faults a real network and a real fleet bring: two
server replicas sharing one data dir, a client that stops sending without hanging up, a
server stopped mid-upload, sessions left unfinished for days."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gpufleet.errors import Conflict, NotFound
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.server.uploads import SESSION_TTL
from gpufleet.store import SqlStore
from gpufleet.store.blobfiles import BlobFiles
from tests.integration.helpers import TESTCLIENT_ON_HTTPX, assert_error

pytestmark = TESTCLIENT_ON_HTTPX

MIB = 1 << 20
DATA = os.urandom(6 * MIB)
SHA = hashlib.sha256(DATA).hexdigest()


def replica(
    store: SqlStore, root: Path, clock: Callable[[], float] | None = None, idle: float = 30.0
) -> BlobService:
    """A server's blob service; two of them over one store and folder are two replicas."""
    settings = BlobSettings(idle_timeout=idle)
    service = BlobService(store, BlobFiles(root), settings, clock=clock or time.time)
    service.startup()
    return service


async def body(data: bytes, then: asyncio.Event | None = None) -> AsyncIterator[bytes]:
    """``data`` in 1 MiB chunks; then, if given, wait for ``then`` (a client gone quiet)."""
    for i in range(0, len(data), MIB):
        yield data[i : i + MIB]
        await asyncio.sleep(0)
    if then is not None:
        await then.wait()


def new_session(service: BlobService, tmp_path: Path) -> tuple[str, Path]:
    """A session for DATA: its id and its file."""
    up = service.uploads.create(SHA, len(DATA))
    assert up.id is not None
    return up.id, tmp_path / "blobs" / "uploads" / up.id


async def finish(service: BlobService, upload_id: str, offset: int) -> None:
    """Send the rest of DATA from ``offset``; the upload completes."""
    done = await service.uploads.append(upload_id, offset, body(DATA[offset:]))
    assert done.complete


async def until(check: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_two_replicas_never_write_one_session_at_once(store: SqlStore, tmp_path: Path) -> None:
    a, b = replica(store, tmp_path / "blobs"), replica(store, tmp_path / "blobs")
    upload_id, session = new_session(a, tmp_path)

    async def run() -> None:
        release = asyncio.Event()
        first = asyncio.create_task(a.uploads.append(upload_id, 0, body(DATA[: 2 * MIB], release)))
        await until(lambda: session.stat().st_size == 2 * MIB, "replica A to write")
        # the client gave up on A and resumes on B while A still holds the session
        with pytest.raises(Conflict, match="already receiving"):
            await b.uploads.append(upload_id, 2 * MIB, body(DATA[2 * MIB :]))
        with pytest.raises(Conflict, match="already receiving"):
            b.uploads.abort(upload_id)
        assert b.uploads.state(upload_id).receiving  # so a client waits instead of sending
        release.set()
        assert (await first).offset == 2 * MIB
        assert not b.uploads.state(upload_id).receiving
        await finish(b, upload_id, 2 * MIB)

    asyncio.run(run())
    assert (tmp_path / "blobs" / "objects" / SHA[:2] / SHA).read_bytes() == DATA
    assert a.has(SHA) == len(DATA)


def test_a_status_read_at_the_instant_a_patch_starts_does_not_refuse_it(
    store: SqlStore, tmp_path: Path
) -> None:
    """A client polling an upload's state (``receiving``) probes the session's lock; a
    PATCH arriving during that probe waits it out instead of answering 409."""
    service = replica(store, tmp_path / "blobs")
    upload_id, session = new_session(service, tmp_path)
    probe = os.open(session, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what the status read holds
    threading.Timer(0.05, os.close, [probe]).start()  # ... for a moment
    asyncio.run(finish(service, upload_id, 0))
    assert service.has(SHA) == len(DATA)


def test_a_status_read_racing_patches_never_makes_them_busy(
    store: SqlStore, tmp_path: Path
) -> None:
    service = replica(store, tmp_path / "blobs")
    upload_id, _ = new_session(service, tmp_path)
    stop = threading.Event()
    reads = 0

    def poll() -> None:
        nonlocal reads
        with contextlib.suppress(NotFound):  # the last PATCH finished the session
            while not stop.is_set() and reads < 100_000:
                service.uploads.state(upload_id)
                reads += 1

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for offset in range(0, len(DATA), 256 << 10):  # 24 PATCHes of 256 KiB
            part = DATA[offset : offset + (256 << 10)]
            asyncio.run(service.uploads.append(upload_id, offset, body(part)))
    finally:
        stop.set()
        poller.join(10)
    assert reads > 0 and service.has(SHA) == len(DATA)


def test_a_client_that_stops_sending_frees_its_session(store: SqlStore, tmp_path: Path) -> None:
    service = replica(store, tmp_path / "blobs", idle=0.5)
    upload_id, _ = new_session(service, tmp_path)

    async def run() -> None:
        never = asyncio.Event()
        stalled = await asyncio.wait_for(
            service.uploads.append(upload_id, 0, body(DATA[: 3 * MIB], never)), 10
        )
        assert stalled.offset == 3 * MIB and not stalled.complete
        await finish(service, upload_id, 3 * MIB)

    asyncio.run(run())
    assert service.has(SHA) == len(DATA)


def test_a_server_stopped_mid_upload_keeps_what_arrived(store: SqlStore, tmp_path: Path) -> None:
    service = replica(store, tmp_path / "blobs")
    upload_id, session = new_session(service, tmp_path)

    async def run() -> int:
        hold = asyncio.Event()
        task = asyncio.create_task(
            service.uploads.append(upload_id, 0, body(DATA[: 4 * MIB], hold))
        )
        await until(lambda: session.stat().st_size == 4 * MIB, "the first bytes")
        task.cancel()  # what uvicorn does to requests still running when it stops
        with pytest.raises(asyncio.CancelledError):
            await task
        kept = service.uploads.state(upload_id).offset
        await finish(service, upload_id, kept)
        return kept

    assert asyncio.run(run()) == 4 * MIB
    assert service.has(SHA) == len(DATA)


def test_sessions_idle_for_a_day_expire(store: SqlStore, tmp_path: Path) -> None:
    long_ago = time.time() - SESSION_TTL - 3600
    now = [long_ago]
    service = replica(store, tmp_path / "blobs", clock=lambda: now[0])
    # three sessions opened more than a day ago ...
    idle = service.uploads.create(SHA, len(DATA))
    busy = service.uploads.create(hashlib.sha256(b"x" * MIB).hexdigest(), 2 * MIB)
    lately = service.uploads.create(hashlib.sha256(b"x").hexdigest(), 1)
    assert idle.id is not None and busy.id is not None and lately.id is not None
    files = tmp_path / "blobs" / "uploads"
    now[0] = time.time()
    # ... one untouched since, one written to a minute ago, one receiving bytes right now
    os.utime(files / idle.id, (long_ago, long_ago))
    os.utime(files / lately.id, (now[0] - 60, now[0] - 60))
    asyncio.run(service.uploads.append(busy.id, 0, body(b"x" * MIB)))
    with pytest.raises(NotFound, match="expired"):  # refused at once, before the sweep
        service.uploads.state(idle.id)
    assert service.uploads.expire() == 1
    assert not (files / idle.id).exists()
    assert service.uploads.state(busy.id).offset == MIB
    assert service.uploads.state(lately.id).offset == 0


def test_a_slow_disk_is_not_taken_for_a_quiet_client() -> None:
    from gpufleet.server.pump import pump

    written: list[int] = []

    def slow_disk(data: bytes) -> None:
        time.sleep(0.1)  # the server's disk is behind; the client sends without pause
        written.append(len(data))

    async def run() -> int:
        return await pump(body(DATA), [slow_disk], len(DATA), idle=0.05)

    assert asyncio.run(run()) == len(DATA)
    assert sum(written) == len(DATA)


def test_a_put_whose_body_stops_arriving_is_a_408(app, client, admin, tmp_path: Path) -> None:
    import httpx

    from gpufleet.server.blobs import BlobService as Service

    async def stalls() -> AsyncIterator[bytes]:
        yield DATA[:MIB]
        await asyncio.sleep(5)

    async def run() -> httpx.Response:
        blobs: Service = app.state.gpufleet.services.blobs
        object.__setattr__(blobs.settings, "idle_timeout", 0.3)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.put(f"/v1/blobs/{SHA}", content=stalls(), headers=admin)

    r = asyncio.run(asyncio.wait_for(run(), 10))
    assert_error(r, 408, "request_timeout", "stopped arriving")
    assert not list((tmp_path / "blobs" / "tmp").glob("*"))


def test_an_offset_past_the_end_is_a_conflict(client, admin) -> None:
    up = client.post("/v1/uploads", json={"sha256": SHA, "size": 10}, headers=admin).json()
    r = client.patch(
        f"/v1/uploads/{up['id']}", content=b"", headers={**admin, "Upload-Offset": "20"}
    )
    assert_error(r, 409, "conflict", "past the end")
