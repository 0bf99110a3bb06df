"""Resumable uploads: a session is a file under the data dir plus its row in the store.

A PATCH appends at the session's current size (its committed offset) while holding an
exclusive ``flock`` on the file, so two requests, in this process or in another replica
sharing the data dir, never write one session at once. A broken connection, a client that
stops sending (the idle timeout) or a server going down keeps what arrived; the client
asks for the offset and resumes from there. Only a body that is too large or a failed
write goes back to the offset the request started at. The last byte verifies the whole
file's SHA-256 and its size before the blob is stored. Sessions expire after a day.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from gpufleet.errors import Conflict, HashMismatch, NotFound
from gpufleet.server.pump import pump
from gpufleet.store.blobfiles import BlobWriter, Busy, is_locked, new_upload_id
from gpufleet.streams import file_hasher
from gpufleet.wire import UploadOut

if TYPE_CHECKING:
    from gpufleet.server.blobs import BlobService

SESSION_TTL = 24 * 3600.0


class UploadSessions:
    def __init__(self, blobs: BlobService, clock: Callable[[], float] = time.time) -> None:
        self.blobs = blobs
        self.store = blobs.store
        self.files = blobs.files
        self.clock = clock
        # The hash of each session's bytes so far, so a resume need not read them again.
        self._hashers: dict[str, tuple[int, hashlib._Hash]] = {}

    def create(self, sha256: str, size: int, readable: bool = True) -> UploadOut:
        """A new session; or, when the server has the blob and the caller may read it,
        the answer that it is complete. A caller who may not read it sends the bytes."""
        self.blobs.check_size(size)
        if readable and self.blobs.has(sha256) is not None:
            return UploadOut(id=None, sha256=sha256, size=size, offset=size, complete=True)
        upload_id = new_upload_id()
        self.files.session(upload_id).touch()
        self.store.create_upload(upload_id, sha256, size, self.clock())
        return UploadOut(id=upload_id, sha256=sha256, size=size, offset=0, complete=False)

    def session(self, upload_id: str) -> tuple[str, int, int]:
        """(sha256, size, bytes so far) of an open session; NotFound when it finished, or
        when nothing happened to it for a day (it expired)."""
        found = self.store.get_upload(upload_id)
        try:
            st = self.files.session(upload_id).stat()
        except FileNotFoundError:  # finished (or aborted) a moment ago
            raise _no_session(upload_id) from None
        if found is None or max(found[2], st.st_mtime) < self._expiry():
            raise _no_session(upload_id)
        return found[0], found[1], st.st_size

    def _expiry(self) -> float:
        return self.clock() - SESSION_TTL

    def state(self, upload_id: str) -> UploadOut:
        sha256, size, offset = self.session(upload_id)
        try:
            receiving = is_locked(self.files.session(upload_id))
        except FileNotFoundError:
            raise _no_session(upload_id) from None
        return UploadOut(
            id=upload_id,
            sha256=sha256,
            size=size,
            offset=offset,
            complete=False,
            receiving=receiving,
        )

    async def append(
        self,
        upload_id: str,
        offset: int,
        body: AsyncIterator[bytes],
        *,
        declared: int | None = None,
    ) -> UploadOut:
        """Append the bytes of one PATCH at ``offset`` (which must be the committed one).
        A ``declared`` length (Content-Length) past the session's end is refused before
        any byte is read."""
        sha256, size, _ = await run_in_threadpool(self.session, upload_id)
        if offset > size:
            raise Conflict(
                f"offset {offset} is past the end of upload {upload_id} ({size} bytes)",
                detail={"size": size},
            )
        self.blobs.check_length(declared, size - offset)
        writer = _open_locked(self.files.session(upload_id), upload_id)
        try:
            have = writer.size
            if offset != have:
                raise Conflict(
                    f"upload {upload_id} is at offset {have}, not {offset}; resume from {have}",
                    detail={"offset": have},
                )
            hasher = await run_in_threadpool(self._hasher, upload_id, writer, have)
            await self._receive(upload_id, writer, hasher, size, body)
            if writer.size < size:
                return UploadOut(
                    id=upload_id, sha256=sha256, size=size, offset=writer.size, complete=False
                )
            return await run_in_threadpool(self._complete, upload_id, sha256, writer, hasher)
        finally:
            writer.close()

    async def _receive(
        self,
        upload_id: str,
        writer: BlobWriter,
        hasher: hashlib._Hash,
        size: int,
        body: AsyncIterator[bytes],
    ) -> None:
        have = writer.size
        try:
            with contextlib.suppress(ClientDisconnect):  # keep what arrived: that is the point
                await pump(body, [writer.write, hasher.update], size - have, self._idle)
            await run_in_threadpool(writer.sync)
        except Exception:  # too large, disk full: back to where this request started
            with contextlib.suppress(OSError):
                writer.truncate(have)  # here, not in a thread: the file closes right after
            raise
        # Cancelled (the server stopping): what was written stays, and the next PATCH hashes
        # it from the file.
        self._hashers[upload_id] = (writer.size, hasher)

    @property
    def _idle(self) -> float:
        return self.blobs.settings.idle_timeout

    def _hasher(self, upload_id: str, writer: BlobWriter, have: int) -> hashlib._Hash:
        # Taken out: it goes back only once this request's bytes and hash agree.
        cached = self._hashers.pop(upload_id, None)
        if cached is not None and cached[0] == have:
            return cached[1]
        # A restart, or another replica took the earlier bytes: hash what is there.
        return file_hasher(writer.path, have)

    def _complete(
        self, upload_id: str, sha256: str, writer: BlobWriter, hasher: hashlib._Hash
    ) -> UploadOut:
        """Verify the whole file (size and hash) and store it as the blob; the session
        ends either way, and a bad one keeps nothing."""
        size = writer.size
        try:
            on_disk = writer.on_disk()
            if on_disk != size:  # only this request could write it; say so if not
                raise HashMismatch(
                    f"upload {upload_id} holds {on_disk} bytes on disk, not the {size} "
                    "received; nothing was kept, start again",
                    detail={"expected": size, "got": on_disk},
                )
            self.blobs.verify(sha256, hasher.hexdigest())
            self.blobs.commit(writer.path, sha256, size)
        finally:
            self._drop(upload_id, writer)
        return UploadOut(id=upload_id, sha256=sha256, size=size, offset=size, complete=True)

    def abort(self, upload_id: str) -> None:
        self.session(upload_id)
        writer = _open_locked(self.files.session(upload_id), upload_id)
        try:
            self._drop(upload_id, writer)
        finally:
            writer.close()

    def _drop(self, upload_id: str, writer: BlobWriter) -> None:
        writer.path.unlink(missing_ok=True)
        self.store.delete_upload(upload_id)
        self._hashers.pop(upload_id, None)

    def expire(self) -> int:
        """Remove sessions nothing happened to for a day and nobody is writing; how many."""
        removed = 0
        for upload_id in self.store.old_uploads(self._expiry()):
            path = self.files.session(upload_id)
            touched = _modified(path)
            if touched is not None and touched >= self._expiry():
                continue  # old, but still receiving bytes
            try:
                writer = _open_locked(path, upload_id)
            except NotFound:
                self.store.delete_upload(upload_id)
                continue
            except Conflict:
                continue
            try:
                self._drop(upload_id, writer)
                removed += 1
            finally:
                writer.close()
        return removed


def _modified(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def _no_session(upload_id: str) -> NotFound:
    return NotFound(
        f"no upload session {upload_id!r} (finished, expired or never created); start a new one",
        detail={"upload": upload_id},
    )


def _open_locked(path: Path, upload_id: str) -> BlobWriter:
    """The session file, opened for appending and locked; 409 while another request
    (here or in another replica) is writing it."""
    try:
        return BlobWriter.locked(path)
    except FileNotFoundError:
        raise _no_session(upload_id) from None
    except Busy:
        raise Conflict(
            f"upload {upload_id} is already receiving bytes (another request is sending "
            "them); ask for its offset again in a moment",
            detail={"upload": upload_id, "busy": True},
        ) from None
