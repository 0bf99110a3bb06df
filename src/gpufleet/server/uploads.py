"""Resumable uploads: a session is its row in the store plus its bytes, held by the blob
storage (:class:`gpufleet.store.blobbytes.SessionBytes`): a file under the data dir, or a
multipart upload in an object store.

A PATCH appends at the session's current size (its committed offset). On disk it holds an
exclusive ``flock`` on the file, so two requests, in this process or in another replica
sharing the data dir, never write one session at once; an object store's parts are placed
by offset, so two requests resending the same bytes write the same parts. A broken
connection, a client that
stops sending (the idle timeout) or a server going down keeps what arrived; the client
asks for the offset and resumes from there. Only a body that is too large or a failed
write goes back to the offset the request started at. The last byte verifies the whole
file's SHA-256 and its size before the blob is stored. Sessions expire after a day.

A session opened without the SHA-256 (so that the client hashes while it sends, instead
of reading the file twice) is named at its last byte by the hash of what arrived, where
the storage allows it (on disk: the session's file is renamed to it). The client checks
that name against its own hash of what it sent.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from gpufleet.errors import Conflict, NotFound, ValidationFailed
from gpufleet.server.blobrules import BlobRules
from gpufleet.server.pump import pump
from gpufleet.store.blobbytes import Appender, Busy
from gpufleet.store.blobfiles import new_upload_id
from gpufleet.wire import UploadOut

SESSION_TTL = 24 * 3600.0


class UploadSessions:
    def __init__(self, blobs: BlobRules, clock: Callable[[], float] = time.time) -> None:
        self.blobs = blobs
        self.store = blobs.store
        self.storage = blobs.storage
        self.clock = clock
        # The hash of each session's bytes so far, so a resume need not read them again,
        # with the storage's proof that they are still the bytes hashed.
        self._hashers: dict[str, tuple[int, hashlib._Hash, object | None]] = {}

    def create(
        self, sha256: str | None, size: int, readable: bool = True, owner: str | None = None
    ) -> UploadOut:
        """A new session, belonging to the token ``owner``; or, when the server has the
        blob and the caller may read it, the answer that it is complete. A caller who may
        not read it sends the bytes. ``sha256`` None: the blob is named at the end (422
        where the storage cannot)."""
        self.blobs.check_size(size)
        if sha256 is None and not self.storage.names_at_end:
            raise ValidationFailed(
                f"this server keeps blobs in {self.storage.where}, which needs an upload's "
                "sha256 when it starts; send the blob's SHA-256",
                detail={"field": "sha256"},
            )
        if sha256 is not None and readable and self.blobs.has(sha256) is not None:
            return UploadOut(id=None, sha256=sha256, size=size, offset=size, complete=True)
        upload_id = new_upload_id()
        self.storage.start(upload_id, sha256, size)
        self.store.create_upload(upload_id, sha256, size, self.clock(), owner)
        return UploadOut(id=upload_id, sha256=sha256, size=size, offset=0, complete=False)

    def check_owner(self, upload_id: str, token_id: str, admin: bool = False) -> None:
        """NotFound, as for a session that does not exist, unless the token that opened
        the session is ``token_id`` (or the caller is an admin): a session's id, seen in a
        log or over a shoulder, lets no one else append to it, finish or abort it."""
        owner = self.store.upload_owner(upload_id)
        if owner is not None and owner != token_id and not admin:
            raise _no_session(upload_id)

    def session(self, upload_id: str) -> tuple[str | None, int, int]:
        """(sha256, size, bytes so far) of an open session; NotFound when it finished, or
        when nothing happened to it for a day (it expired)."""
        found = self.store.get_upload(upload_id)
        if found is None:
            raise _no_session(upload_id)
        sha256, size, created = found
        try:
            kept, touched = self.storage.kept(upload_id, sha256, size)
        except FileNotFoundError:  # finished (or aborted) a moment ago
            raise _no_session(upload_id) from None
        if max(created, touched) < self._expiry():
            raise _no_session(upload_id)
        return sha256, size, kept

    def _expiry(self) -> float:
        return self.clock() - SESSION_TTL

    def state(self, upload_id: str) -> UploadOut:
        sha256, size, offset = self.session(upload_id)
        try:
            receiving = self.storage.receiving(upload_id, sha256)
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
        found = await run_in_threadpool(self.store.get_upload, upload_id)
        if found is None:
            raise _no_session(upload_id)
        sha256, size, created = found
        if offset > size:
            raise Conflict(
                f"offset {offset} is past the end of upload {upload_id} ({size} bytes)",
                detail={"size": size},
            )
        self.blobs.check_length(declared, size - offset)
        # Taken out: it goes back only once this request's bytes and hash agree.
        cached = self._hashers.pop(upload_id, None)
        proof = cached[2] if cached else None
        writer = await run_in_threadpool(self._hold, upload_id, sha256, size, proof)
        try:
            if max(created, writer.touched) < self._expiry():
                raise _no_session(upload_id)
            have = writer.size
            if offset != have:
                raise Conflict(
                    f"upload {upload_id} is at offset {have}, not {offset}; resume from {have}",
                    detail={"offset": have},
                )
            hasher = await run_in_threadpool(self._hasher, cached, writer, have)
            await self._receive(upload_id, writer, hasher, size, body)
            if writer.size < size:
                return UploadOut(
                    id=upload_id, sha256=sha256, size=size, offset=writer.size, complete=False
                )
            return await run_in_threadpool(self._complete, upload_id, sha256, writer, hasher)
        finally:
            writer.close()

    def _hold(
        self, upload_id: str, sha256: str | None, size: int, proof: object | None
    ) -> Appender:
        """The session's bytes, held for this request; 409 while another request (here or
        in another replica) writes or finishes them."""
        try:
            return self.storage.appender(upload_id, sha256, size, proof)
        except FileNotFoundError:
            raise _no_session(upload_id) from None
        except Busy:
            raise _busy(upload_id) from None

    async def _receive(
        self,
        upload_id: str,
        writer: Appender,
        hasher: hashlib._Hash | None,
        size: int,
        body: AsyncIterator[bytes],
    ) -> None:
        have = writer.size
        sinks = [writer.write] if hasher is None else [writer.write, hasher.update]
        try:
            with contextlib.suppress(ClientDisconnect):  # keep what arrived: that is the point
                await pump(body, sinks, size - have, self._idle)
            await run_in_threadpool(writer.sync)
        except Exception:  # too large, disk full: back to where this request started
            with contextlib.suppress(OSError):
                writer.revert(have)  # here, not in a thread: the writer closes right after
            raise
        # Cancelled (the server stopping): what was written stays, and the next PATCH hashes
        # it again where it can.
        if hasher is not None:
            self._hashers[upload_id] = (writer.size, hasher, writer.proof)

    @property
    def _idle(self) -> float:
        return self.blobs.settings.idle_timeout

    @staticmethod
    def _hasher(
        cached: tuple[int, hashlib._Hash, object | None] | None, writer: Appender, have: int
    ) -> hashlib._Hash | None:
        """The hash of the session's bytes so far: this server's, kept from the request
        before, while the storage vouches they are unchanged; else read back (a restart,
        or another replica took the earlier bytes); None when they cannot be read before
        the end (then they are checked after)."""
        if cached is not None and cached[0] == have and writer.trusted:
            return cached[1]
        return writer.rehash()

    def _complete(
        self, upload_id: str, sha256: str | None, writer: Appender, hasher: hashlib._Hash | None
    ) -> UploadOut:
        """Verify the whole upload (size and hash) and store it as the blob, named by its
        hash when the session had no name; the session ends either way, and a bad one
        keeps nothing."""
        size = writer.size
        try:
            got = writer.seal(hasher)
            if sha256 is None:
                sha256 = got
            self.blobs.verify(sha256, got)
            writer.promote(sha256)
            self.blobs.record(sha256, size)
        finally:
            writer.discard()
            self._forget(upload_id)
        return UploadOut(id=upload_id, sha256=sha256, size=size, offset=size, complete=True)

    def _forget(self, upload_id: str) -> None:
        self.store.delete_upload(upload_id)
        self._hashers.pop(upload_id, None)

    def abort(self, upload_id: str) -> None:
        sha256, _, _ = self.session(upload_id)
        self._drop(upload_id, sha256)

    def _drop(self, upload_id: str, sha256: str | None) -> None:
        try:
            self.storage.drop(upload_id, sha256)
        except FileNotFoundError:
            pass  # its bytes are gone already: forget the row too
        except Busy:
            raise _busy(upload_id) from None
        self._forget(upload_id)

    def expire(self) -> int:
        """Remove sessions nothing happened to for a day and nobody is writing; how many."""
        removed = 0
        for upload_id in self.store.old_uploads(self._expiry()):
            found = self.store.get_upload(upload_id)
            if found is None:
                continue
            sha256, size, _ = found
            try:
                _, touched = self.storage.kept(upload_id, sha256, size)
            except FileNotFoundError:
                touched = None
            if touched is not None and touched >= self._expiry():
                continue  # old, but still receiving bytes
            try:
                self._drop(upload_id, sha256)
            except Conflict:
                continue
            removed += 1
        return removed


def _no_session(upload_id: str) -> NotFound:
    return NotFound(
        f"no upload session {upload_id!r} (finished, expired or never created); start a new one",
        detail={"upload": upload_id},
    )


def _busy(upload_id: str) -> Conflict:
    return Conflict(
        f"upload {upload_id} is already receiving bytes (another request is sending "
        "them); ask for its offset again in a moment",
        detail={"upload": upload_id, "busy": True},
    )
