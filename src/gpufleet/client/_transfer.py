"""Moving blob bytes: hash, upload only what the server lacks, resume, verify downloads.

Uploads above :data:`SESSION_OVER` bytes go through a resumable session: one streamed
PATCH carries the rest of the file, and after a broken connection the client asks the
server where it stands and sends from there. A file whose hash the caller does not know
is sent at once, hashed meanwhile by a thread reading ahead; the server names the blob by
what it received and the client checks that name against its own hash. Once the hash is
known, a server that turns out to have the blob already stops the sending.

Downloads write to ``NAME.partial`` next to the target (hashing as they write), resume
with ``Range``, verify the SHA-256 and only then rename.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx

from gpufleet import archive
from gpufleet.client._api import raise_for, unreachable
from gpufleet.client._direct import FAILURES, Answer, Direct
from gpufleet.errors import (
    Conflict,
    Forbidden,
    GpufleetError,
    HashMismatch,
    NotFound,
    ServerUnavailable,
    Unauthorized,
    ValidationFailed,
)
from gpufleet.streams import CHUNK, Fanout, file_hasher, file_sha256
from gpufleet.wire import UploadCreate, UploadOut

SESSION_OVER = 32 << 20
# The hashing thread of an upload sent while hashed yields to the sending (and, on one
# machine, to the server): it runs on a core nothing else wants.
HASH_NICENESS = 19


RETRIES = 5
# A body's request may wait on the server's disk (or its hashing the part of an upload an
# earlier process received): reading and writing get minutes, connecting does not.
TRANSFER_TIMEOUT = {"timeout": httpx.Timeout(30.0, read=300.0, write=300.0).as_dict()}
# How long a transfer keeps trying without progress: longer than the server takes to free
# a session whose client went quiet (its idle timeout, 30 s) or to restart.
PATIENCE = 60.0
Progress = Callable[[int], None]
BY_STATUS: dict[int, type[GpufleetError]] = {401: Unauthorized, 403: Forbidden}


def _quiet(_: int) -> None:
    return None


@dataclass(frozen=True)
class Sent:
    """What an upload did: the blob id, its size, and the body bytes that crossed."""

    sha256: str
    size: int
    sent: int


class _Retry:
    """When to give up: after RETRIES failures in a row that also span PATIENCE seconds,
    counted from the last progress (a long transfer may break many times and still go on)."""

    def __init__(self) -> None:
        self.failures = 0
        self.since = time.monotonic()
        self.mark = -1

    def failed(self, exc: GpufleetError) -> None:
        """Sleep before the next try, or raise ``exc`` when patience ran out."""
        self.failures += 1
        if self.failures > RETRIES and time.monotonic() - self.since > PATIENCE:
            raise exc
        time.sleep(min(0.2 * 2**self.failures, 5.0))

    def progress(self, position: int) -> None:
        if position > self.mark:
            self.mark, self.failures, self.since = position, 0, time.monotonic()


def _body(
    f: BinaryIO, counter: list[int], progress: Progress, ahead: _Ahead | None = None
) -> Iterator[bytes]:
    while chunk := f.read(CHUNK):
        if ahead is not None and ahead.server_has:
            raise _ServerHasIt
        counter[0] += len(chunk)
        progress(len(chunk))
        yield chunk


class _ServerHasIt(Exception):
    """Raised inside an upload's body: the hash came in and the server has that blob."""


def _yield_cpu() -> None:
    """Make the calling thread run only when a core is idle (Linux's SCHED_IDLE; else the
    lowest priority), where the system allows: a thread is a task there."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, tid, HASH_NICENESS)


class _Ahead:
    """A file's SHA-256, computed while the file is sent by a thread at low priority (it
    uses a spare core, not the sender's); then whether the server has that blob already
    (the rest need not be sent). It is a shortcut, not the check: the server names the
    blob by the bytes it received, and the file's stat data before and after the sending
    tell whether those were the file's."""

    def __init__(self, path: Path, has: Callable[[str], int | None]) -> None:
        self.path = path
        self.before = archive.fingerprint(path)
        self.sha256: str | None = None
        self.server_has = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(has,), name="hash", daemon=True)
        self._thread.start()

    def _run(self, has: Callable[[str], int | None]) -> None:
        _yield_cpu()
        try:
            digest = file_hasher(self.path, stop=self._stop)
        except OSError:
            return  # the sending says what is wrong with the file
        if self._stop.is_set():
            return
        self.sha256 = digest.hexdigest()
        with contextlib.suppress(GpufleetError):  # only a shortcut: the upload goes on
            self.server_has = has(self.sha256) is not None

    def wait(self) -> str | None:
        """The hash, once done (None if the file could not be read)."""
        self._thread.join()
        return self.sha256

    def finish(self) -> str | None:
        """Stop hashing; the hash if it was done."""
        self._stop.set()
        self._thread.join()
        return self.sha256

    def check(self, got: str) -> None:
        """The server named the blob ``got``: raise unless those were the file's bytes."""
        mine = self.finish()
        if (mine is not None and mine != got) or archive.fingerprint(self.path) != self.before:
            raise HashMismatch(
                f"{self.path} changed while it was sent (the server received bytes hashing "
                f"to {got}); send it again once it is written",
                detail={"got": got, "file": str(self.path)},
            )


class Transfers:
    """Blob transfers over a blocking httpx client (the SDK's and the CLI's)."""

    def __init__(self, http: httpx.Client, server: str, direct: Direct | None = None) -> None:
        self.http = http
        self.server = server
        self.direct = direct  # the fast path for downloads, when usable

    def _send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        try:
            resp = self.http.send(request, stream=stream)
        except httpx.TransportError as exc:
            raise unreachable(self.server, exc) from exc
        if resp.status_code >= 400:
            resp.read()
            raise_for(resp)
        return resp

    def has(self, sha256: str) -> int | None:
        """The blob's size if the server has it, else None."""
        try:
            resp = self.http.send(self.http.build_request("HEAD", f"/v1/blobs/{sha256}"))
        except httpx.TransportError as exc:
            raise unreachable(self.server, exc) from exc
        if resp.status_code == 404:
            return None
        if resp.status_code >= 400:  # a HEAD answer has no body: say what the status means
            raise BY_STATUS.get(resp.status_code, GpufleetError)(
                f"HEAD /v1/blobs/{sha256}: HTTP {resp.status_code}"
            )
        return int(resp.headers.get("content-length", "0"))

    def put(self, path: Path, sha256: str | None = None, progress: Progress = _quiet) -> Sent:
        """Upload ``path`` unless the server has it already (then no body is sent). A
        large file whose ``sha256`` is not given is sent while it is hashed."""
        size = path.stat().st_size
        if sha256 is None and size > SESSION_OVER:
            try:
                state = self._open_session(None, size)
            except ValidationFailed as exc:  # the server's blob store needs the hash first
                if not isinstance(exc.detail, dict) or exc.detail.get("field") != "sha256":
                    raise
            else:
                ahead = _Ahead(path, self.has)
                try:
                    return self._put_session(path, state, progress, ahead)
                finally:
                    ahead.finish()
        sha256 = sha256 or file_sha256(path)
        if self.has(sha256) is not None:
            return Sent(sha256, size, 0)
        if size <= SESSION_OVER:
            return Sent(sha256, size, self._put_once(path, sha256, size, progress))
        return self._put_session(path, self._open_session(sha256, size), progress)

    def _put_once(self, path: Path, sha256: str, size: int, progress: Progress) -> int:
        counter = [0]
        with open(path, "rb") as f:
            request = self.http.build_request(
                "PUT",
                f"/v1/blobs/{sha256}",
                extensions=TRANSFER_TIMEOUT,
                content=_body(f, counter, progress),
                headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
            )
            self._send(request).close()
        return counter[0]

    def _put_session(
        self, path: Path, state: UploadOut, progress: Progress, ahead: _Ahead | None = None
    ) -> Sent:
        """Send the file through a resumable session; after a broken connection ask where
        the server stands and go on from there. Gives up only after RETRIES failures in a
        row that also span PATIENCE seconds without progress. ``ahead``: the session has
        no name yet, and this hashes the file meanwhile."""
        sent, retry = 0, _Retry()
        retry.progress(state.offset)
        while not state.complete:
            if state.receiving:  # a cut request of ours still holds it, until the server notices
                retry.failed(Conflict(f"upload {state.id} is still receiving an earlier request"))
                state = self._where(state, ahead)
                continue
            start, counter = state.offset, [0]
            try:
                state = self._patch(path, state, counter, progress, ahead)
                cut = False
            except _ServerHasIt:
                assert ahead is not None and ahead.sha256 is not None
                self._abandon(state)
                progress(state.size - start - counter[0])
                return Sent(ahead.sha256, state.size, sent + counter[0])
            except (ServerUnavailable, Conflict, NotFound) as exc:
                retry.progress(start + counter[0])  # bytes moved: credit them first
                retry.failed(exc)  # then wait, so the server settles where it stands
                state, cut = self._where(state, ahead), True
            sent += counter[0]
            progress(state.offset - start - counter[0])  # what the server did not keep
            retry.progress(state.offset)
            if not cut and state.offset == start and not state.complete:
                retry.failed(ServerUnavailable(f"the server kept none of the bytes for {state.id}"))
        assert state.sha256 is not None  # a complete upload is named
        if ahead is not None:
            ahead.check(state.sha256)
        return Sent(state.sha256, state.size, sent)

    def _abandon(self, state: UploadOut) -> None:
        """Drop a session the server no longer needs (it has the blob); it may still hold
        the cut request for a moment. Left to expire if it will not go."""
        for _ in range(10):
            try:
                self._send(self.http.build_request("DELETE", f"/v1/uploads/{state.id}"))
                return
            except Conflict:
                time.sleep(0.2)
            except GpufleetError:
                return

    def _open_session(self, sha256: str | None, size: int) -> UploadOut:
        body = UploadCreate(sha256=sha256, size=size).model_dump(mode="json")
        resp = self._send(self.http.build_request("POST", "/v1/uploads", json=body))
        return UploadOut.model_validate_json(resp.content)

    def _where(self, state: UploadOut, ahead: _Ahead | None = None) -> UploadOut:
        """Where the upload stands now. The session may have ended meanwhile: complete
        (the answer to the last PATCH was lost) or expired (start a new one). While the
        server cannot be reached, the same state, to try again."""
        assert state.id is not None
        try:
            try:
                resp = self._send(self.http.build_request("GET", f"/v1/uploads/{state.id}"))
            except NotFound:
                # finished, its answer lost? Then the server has what the file hashes to
                sha256 = state.sha256 or (ahead.wait() if ahead else None)
                if sha256 is not None and self.has(sha256) is not None:
                    done = {"sha256": sha256, "offset": state.size, "complete": True}
                    return state.model_copy(update=done)
                return self._open_session(state.sha256, state.size)
        except ServerUnavailable:
            return state
        return UploadOut.model_validate_json(resp.content)

    def _patch(
        self,
        path: Path,
        state: UploadOut,
        counter: list[int],
        progress: Progress,
        ahead: _Ahead | None = None,
    ) -> UploadOut:
        assert state.id is not None
        with open(path, "rb") as f:
            f.seek(state.offset)
            request = self.http.build_request(
                "PATCH",
                f"/v1/uploads/{state.id}",
                extensions=TRANSFER_TIMEOUT,
                content=_body(f, counter, progress, ahead),
                headers={
                    "Upload-Offset": str(state.offset),
                    "Content-Length": str(state.size - state.offset),
                    "Content-Type": "application/offset+octet-stream",
                },
            )
            resp = self._send(request)
        return UploadOut.model_validate_json(resp.content)

    def get(self, sha256: str, dest: Path, progress: Progress = _quiet) -> int:
        """Download blob ``sha256`` to ``dest`` (verified, then renamed into place),
        resuming a ``dest.partial`` left by an earlier try, and after a broken connection.
        Returns the body bytes received (a resume receives only what was missing)."""
        partial = dest.with_name(dest.name + ".partial")
        received = [0]

        def seen(n: int) -> None:
            received[0] += n
            progress(n)

        retry = _Retry()
        while True:
            try:
                got = self._get_into(sha256, partial, progress, seen)
                break
            except ServerUnavailable as exc:
                retry.progress(received[0])  # credit what arrived before judging the failure
                retry.failed(exc)
        if got != sha256:
            partial.unlink(missing_ok=True)
            raise HashMismatch(
                f"the downloaded bytes hash to {got}, not {sha256}; "
                f"{partial.name} was removed, try again"
            )
        os.replace(partial, dest)
        return received[0]

    def _get_into(self, sha256: str, partial: Path, progress: Progress, seen: Progress) -> str:
        """Fetch what ``partial`` lacks and return the SHA-256 of the whole file. The file
        is written and hashed while the next bytes arrive."""
        have = partial.stat().st_size if partial.exists() else 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        path = f"/v1/blobs/{sha256}"
        try:
            with self._open(path, headers) as (status, length, pour):
                resumed = status == 206
                if resumed:
                    progress(have)
                hasher = file_hasher(partial) if resumed else hashlib.sha256()
                with (
                    open(partial, "ab" if resumed else "wb") as f,
                    Fanout([f.write, hasher.update]) as fan,
                ):
                    got = pour(fan, seen)
                    fan.wait()
        except GpufleetError as exc:
            if exc.status != 416:
                raise
            return file_sha256(partial)  # the partial file was complete
        if length is not None and got != length:
            raise ServerUnavailable(
                f"the connection to {self.server} closed after {got} of {length} bytes"
            )
        return hasher.hexdigest()

    @contextlib.contextmanager
    def _open(self, path: str, headers: dict[str, str]) -> Iterator[tuple[int, int | None, Pour]]:
        """GET ``path``: (status, Content-Length, a function that pours the body into a
        fanout). Direct when it can be (see ``_direct``), through httpx when proxied."""
        if self.direct is not None:
            with self.direct.get(path, headers) as answer:
                yield (
                    answer.status,
                    answer.length,
                    functools.partial(_pour_direct, answer, self.server),
                )
            return
        resp = self._send(self.http.build_request("GET", path, headers=headers), stream=True)
        try:
            length = resp.headers.get("content-length")
            size = int(length) if length and length.isdigit() else None
            yield resp.status_code, size, functools.partial(_pour_httpx, resp, self.server)
        finally:
            resp.close()


Pour = Callable[[Fanout, Progress], int]


def _pour_direct(answer: Answer, server: str, fan: Fanout, progress: Progress) -> int:
    """Read the body into a ring of reused buffers; a buffer is refilled only once the
    sinks are done with it (the fanout holds at most ``depth`` of them)."""
    ring = itertools.cycle([bytearray(CHUNK) for _ in range(fan.depth + 1)])
    total = 0
    while True:
        fan.room()
        buffer = next(ring)
        try:
            n = answer.readinto(buffer)
        except FAILURES as exc:
            raise unreachable(server, exc) from exc
        if not n:
            return total
        fan.submit(memoryview(buffer)[:n])
        total += n
        progress(n)


def _pour_httpx(resp: httpx.Response, server: str, fan: Fanout, progress: Progress) -> int:
    parts: list[bytes] = []
    gathered = total = 0
    try:
        for chunk in resp.iter_raw():
            parts.append(chunk)
            gathered += len(chunk)
            total += len(chunk)
            progress(len(chunk))
            if gathered >= CHUNK:
                fan.feed(b"".join(parts))
                parts, gathered = [], 0
    except httpx.TransportError as exc:
        raise unreachable(server, exc) from exc
    finally:
        if parts:  # keep what arrived: a resume starts after it
            fan.feed(b"".join(parts))
    return total
