"""Blob policy: verified streaming uploads, resumable sessions, archive scans.

Bodies are never held whole: chunks are gathered into 1 MiB buffers and handed to two
threads, one writing and one hashing, while the loop receives the next buffer, so memory
stays flat and the disk, the hash and the network all work at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from gpufleet import archive
from gpufleet.errors import (
    Conflict,
    HashMismatch,
    NotFound,
    TooLarge,
    UnsafeArchive,
)
from gpufleet.store import SqlStore
from gpufleet.store.blobfiles import BlobFiles, BlobWriter, new_upload_id
from gpufleet.streams import Fanout, Sink, file_hasher
from gpufleet.wire import UploadOut

BUFFER = 1 << 20
SESSION_TTL = 24 * 3600.0


@dataclass(frozen=True)
class BlobSettings:
    max_size: int = 64 << 30
    limits: archive.Limits = field(default_factory=archive.Limits)


async def pump(chunks: AsyncIterator[bytes], sinks: Sequence[Sink], limit: int) -> int:
    """Feed ``chunks`` to every sink in 1 MiB buffers, each sink in a thread of its own
    (writing and hashing overlap each other and the next receive). Raises TooLarge as soon
    as more than ``limit`` bytes arrive. Whatever the outcome, every buffer handed over has
    reached every sink when this returns, so the file and the hash agree."""
    parts: list[bytes] = []
    gathered = total = 0
    fan: Fanout | None = None
    try:
        async for chunk in chunks:
            total += len(chunk)
            if total > limit:
                raise TooLarge(f"the body is larger than the limit of {limit} bytes")
            parts.append(chunk)
            gathered += len(chunk)
            if gathered >= BUFFER:
                fan = fan or Fanout(sinks)
                while not fan.has_room():
                    await _finished(fan.oldest())
                fan.submit(b"".join(parts))
                parts, gathered = [], 0
        if fan is not None:
            await _settled(fan)
            fan.wait()  # raises a sink's error
        if parts:  # the tail (or a whole small body): one hop to a thread
            data = b"".join(parts)
            await run_in_threadpool(lambda: [sink(data) for sink in sinks])
    finally:
        if fan is not None:  # never leave a write running behind an abort
            await _settled(fan)
            fan.close()
    return total


async def _settled(fan: Fanout) -> None:
    """Wait, without blocking the loop, until the sinks have taken every buffer."""
    while futures := fan.oldest():
        await _finished(futures)
        with contextlib.suppress(Exception):  # kept by the fanout for fan.wait() to raise
            fan.has_room()


async def _finished(futures: list[Future[object]]) -> None:
    wrapped = [asyncio.wrap_future(f) for f in futures]
    await asyncio.wait(wrapped)
    for w in wrapped:
        w.exception()  # seen here so asyncio does not log it; the fanout raises it


class BlobService:
    """Uploads, sessions and archive checks over the blob files and their rows."""

    def __init__(
        self,
        store: SqlStore,
        files: BlobFiles,
        settings: BlobSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.files = files
        self.settings = settings
        self.clock = clock
        # In-memory hash state of sessions, to avoid re-reading a file on every PATCH.
        self._hashers: dict[str, tuple[int, hashlib._Hash]] = {}
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def startup(self) -> int:
        """Drop expired sessions and everything a crash left behind."""
        live = self.store.upload_ids(self.clock() - SESSION_TTL)
        return self.files.clean(live)

    def has(self, sha256: str) -> int | None:
        """The blob's size if the server holds it complete, else None."""
        row = self.store.get_blob(sha256)
        if row is None or not self.files.exists(sha256):
            return None
        return row.size

    def require(self, sha256: str) -> int:
        size = self.has(sha256)
        if size is None:
            raise NotFound(f"no blob {sha256}", detail={"blob": sha256})
        return size

    def check_size(self, size: int) -> None:
        if size > self.settings.max_size:
            raise TooLarge(
                f"{size} bytes is over the server's blob size limit of "
                f"{self.settings.max_size} bytes (gpufleet server --max-blob-size)",
                detail={"size": size, "limit": self.settings.max_size},
            )

    # ---- one-request upload -----------------------------------------------------------

    async def put(self, sha256: str, body: AsyncIterator[bytes]) -> bool:
        """Store a streamed body as blob ``sha256``; False if it was already there."""
        if self.has(sha256) is not None:
            return False
        temp = self.files.temp()
        writer, hasher = BlobWriter(temp), hashlib.sha256()
        try:
            await pump(body, [writer.write, hasher.update], self.settings.max_size)
            await run_in_threadpool(writer.sync)
            writer.close()
            self._verify(sha256, hasher.hexdigest())
            await run_in_threadpool(self._commit, temp, sha256, writer.size)
        finally:
            writer.close()
            temp.unlink(missing_ok=True)
        return True

    def _verify(self, sha256: str, got: str) -> None:
        if got != sha256:
            raise HashMismatch(
                f"the bytes sent hash to {got}, not {sha256}; nothing was kept",
                detail={"expected": sha256, "got": got},
            )

    def _commit(self, written: Path, sha256: str, size: int) -> None:
        self.files.commit(written, sha256)
        self.store.record_blob(sha256, size, self.clock())

    # ---- resumable sessions -----------------------------------------------------------

    def create_upload(self, sha256: str, size: int) -> UploadOut:
        self.check_size(size)
        if self.has(sha256) is not None:
            return UploadOut(id=None, sha256=sha256, size=size, offset=size, complete=True)
        upload_id = new_upload_id()
        self.files.session(upload_id).touch()
        self.store.create_upload(upload_id, sha256, size, self.clock())
        return UploadOut(id=upload_id, sha256=sha256, size=size, offset=0, complete=False)

    def session(self, upload_id: str) -> tuple[str, int]:
        found = self.store.get_upload(upload_id)
        path = self.files.session(upload_id)
        if found is None or not path.exists():
            raise NotFound(
                f"no upload session {upload_id!r} (finished, expired or never created); "
                "start a new one",
                detail={"upload": upload_id},
            )
        return found[0], found[1]

    def upload_state(self, upload_id: str) -> UploadOut:
        sha256, size = self.session(upload_id)
        offset = self.files.session(upload_id).stat().st_size
        return UploadOut(id=upload_id, sha256=sha256, size=size, offset=offset, complete=False)

    async def append(self, upload_id: str, offset: int, body: AsyncIterator[bytes]) -> UploadOut:
        """Append the bytes of one PATCH at ``offset``. A broken connection keeps (and
        fsyncs) what arrived; the client asks for the offset and resumes from there."""
        sha256, size = self.session(upload_id)
        with self._lock:
            if upload_id in self._busy:
                raise Conflict(f"upload {upload_id} is already receiving bytes")
            self._busy.add(upload_id)
        try:
            return await self._append(upload_id, sha256, size, offset, body)
        finally:
            with self._lock:
                self._busy.discard(upload_id)

    async def _append(
        self, upload_id: str, sha256: str, size: int, offset: int, body: AsyncIterator[bytes]
    ) -> UploadOut:
        path = self.files.session(upload_id)
        have = path.stat().st_size
        if offset != have:
            raise Conflict(
                f"upload {upload_id} is at offset {have}, not {offset}; resume from {have}",
                detail={"offset": have},
            )
        hasher = await run_in_threadpool(self._hasher, upload_id, path, have)
        writer = BlobWriter(path, append=True)
        try:
            with contextlib.suppress(ClientDisconnect):  # keep what arrived: that is the point
                await pump(body, [writer.write, hasher.update], size - have)
            await run_in_threadpool(writer.sync)
        except BaseException:  # too large, disk full: back to the last committed offset
            self._hashers.pop(upload_id, None)
            with contextlib.suppress(Exception):
                await run_in_threadpool(writer.truncate, have)
            raise
        finally:
            writer.close()
        self._hashers[upload_id] = (writer.size, hasher)
        if writer.size < size:
            return UploadOut(
                id=upload_id, sha256=sha256, size=size, offset=writer.size, complete=False
            )
        return await run_in_threadpool(self._complete, upload_id, sha256, size, hasher.hexdigest())

    def _hasher(self, upload_id: str, path: Path, have: int) -> hashlib._Hash:
        cached = self._hashers.get(upload_id)
        if cached is not None and cached[0] == have:
            return cached[1]
        # A restart, or another replica took the earlier bytes: hash what is there.
        return file_hasher(path, have)

    def _complete(self, upload_id: str, sha256: str, size: int, got: str) -> UploadOut:
        path = self.files.session(upload_id)
        self._hashers.pop(upload_id, None)
        try:
            self._verify(sha256, got)
            self._commit(path, sha256, size)
        finally:
            path.unlink(missing_ok=True)
            self.store.delete_upload(upload_id)
        return UploadOut(id=upload_id, sha256=sha256, size=size, offset=size, complete=True)

    def abort(self, upload_id: str) -> None:
        self.session(upload_id)
        self.files.session(upload_id).unlink(missing_ok=True)
        self.store.delete_upload(upload_id)
        self._hashers.pop(upload_id, None)

    # ---- archives ---------------------------------------------------------------------

    def scan(self, sha256: str) -> dict[str, Any]:
        """Check blob ``sha256`` as a gpufleet archive (every unpacking rule, nothing
        written) once; the verdict is kept. Raises UnsafeArchive for a bad one."""
        row = self.store.get_blob(sha256)
        if row is None or not self.files.exists(sha256):
            raise NotFound(f"no blob {sha256}; upload it first", detail={"blob": sha256})
        summary = json.loads(row.archive) if row.archive else None
        if summary is None:
            summary = self._scan_file(sha256, row.size)
            self.store.set_blob_archive(sha256, summary)
        if "error" in summary:
            raise UnsafeArchive(f"blob {sha256}: {summary['error']}", detail={"blob": sha256})
        return dict(summary)

    def _scan_file(self, sha256: str, size: int) -> dict[str, Any]:
        try:
            with open(self.files.path(sha256), "rb") as f:
                packed = archive.scan(f, self.settings.limits, compressed_size=size)
        except UnsafeArchive as exc:
            return {"error": exc.message}
        files = [{"path": e.path, "size": e.size} for e in packed.entries if e.kind == "file"]
        return {"files": packed.files, "bytes": packed.bytes, "list": files[:1000]}
