"""Blob policy: content-addressed storage, verified single-request uploads, archive checks.

Resumable uploads live in :mod:`gpufleet.server.uploads`; the checks both follow (size,
hash, the row that makes a blob) in :mod:`gpufleet.server.blobrules`; moving a body to
disk (write and hash at once, flat memory) in :mod:`gpufleet.server.pump`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool

from gpufleet import archive
from gpufleet.errors import NotFound, UnsafeArchive
from gpufleet.server.blobrules import BlobRules, BlobSettings
from gpufleet.server.pump import pump
from gpufleet.server.uploads import SESSION_TTL, UploadSessions
from gpufleet.store import DataStore
from gpufleet.store.blobbytes import BlobBytes
from gpufleet.store.rows_read import BlobRow

# BlobSettings is built with the service, so callers take both from here.
__all__ = ["BlobService", "BlobSettings"]


class BlobService(BlobRules):
    """Blobs, their upload sessions (:attr:`uploads`) and archive checks, over the blob
    files and their rows."""

    def __init__(
        self,
        store: DataStore,
        storage: BlobBytes,
        settings: BlobSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(store, storage, settings, clock)
        self.uploads = UploadSessions(self, clock)

    def startup(self) -> int:
        """Drop expired sessions and what a crash left behind."""
        live = self.store.upload_ids(self.clock() - SESSION_TTL)
        return self.storage.clean(live, self.clock())

    def get(self, sha256: str) -> BlobRow | None:
        return self.store.get_blob(sha256)

    def listed(self, limit: int, pools: Sequence[str] | None) -> list[BlobRow]:
        """The newest blobs (those ``pools`` may read; None: every blob)."""
        return self.store.list_blobs(limit, pools)

    def readable(self, sha256: str, pools: Sequence[str] | None) -> bool:
        """Whether ``pools`` (None: every pool) may read the blob."""
        return pools is None or self.store.blob_readable(sha256, pools)

    def grant(self, grants: Iterable[tuple[str, str]]) -> None:
        """Let each (sha256, pool) pool read that blob."""
        self.store.grant_blobs(grants)

    def require(self, sha256: str) -> int:
        size = self.has(sha256)
        if size is None:
            raise NotFound(f"no blob {sha256}", detail={"blob": sha256})
        return size

    async def put(self, sha256: str, body: AsyncIterator[bytes], prove: bool = False) -> bool:
        """Store a streamed body as blob ``sha256``; False if it was already there. With
        ``prove``, a blob already there is still read and checked: the caller may not read
        it yet, and sending bytes that hash to it is what earns that."""
        if await run_in_threadpool(self.has, sha256) is not None:
            if prove:
                hasher = hashlib.sha256()
                limit, idle = self.settings.max_size, self.settings.idle_timeout
                await pump(body, [hasher.update], limit, idle)
                self.verify(sha256, hasher.hexdigest())
            return False
        writer, hasher = self.storage.writer(sha256), hashlib.sha256()
        try:
            limit, idle = self.settings.max_size, self.settings.idle_timeout
            await pump(body, [writer.write, hasher.update], limit, idle)
            self.verify(sha256, hasher.hexdigest())
            await run_in_threadpool(writer.commit, sha256)
            await run_in_threadpool(self.record, sha256, writer.size)
        finally:
            await run_in_threadpool(writer.close)
        return True

    # ---- archives ---------------------------------------------------------------------

    def content(self, sha256: str, most: int) -> bytes | None:
        """Blob ``sha256``'s bytes when the server holds it and it is at most ``most``
        bytes long (an environment's file, read to check what it asks for), else None."""
        row = self.store.get_blob(sha256)
        if row is None or row.size > most or not self.storage.exists(sha256):
            return None
        with self.storage.reader(sha256) as f:
            return bytes(f.read(most + 1))

    def scan(self, sha256: str) -> dict[str, Any]:
        """Check blob ``sha256`` as a gpufleet archive (every unpacking rule, nothing
        written) once; the verdict is kept. Raises UnsafeArchive for a bad one."""
        row = self.store.get_blob(sha256)
        if row is None or not self.storage.exists(sha256):
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
            with self.storage.reader(sha256) as f:
                packed = archive.scan(f, self.settings.limits, compressed_size=size)
        except UnsafeArchive as exc:
            return {"error": exc.message}
        files = [{"path": e.path, "size": e.size} for e in packed.entries if e.kind == "file"]
        return {"files": packed.files, "bytes": packed.bytes, "list": files[:1000]}
