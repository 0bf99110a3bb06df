"""Moving blob bytes: hash, upload only what the server lacks, resume, verify downloads.

Uploads above :data:`SESSION_OVER` bytes go through a resumable session: one streamed
PATCH carries the rest of the file, and after a broken connection the client asks the
server where it stands and sends from there. Downloads write to ``NAME.partial`` next to
the target, resume with ``Range``, verify the SHA-256 and only then rename.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx

from gpufleet.client._api import raise_for, unreachable
from gpufleet.errors import (
    Conflict,
    Forbidden,
    GpufleetError,
    HashMismatch,
    ServerUnavailable,
    Unauthorized,
)
from gpufleet.wire import UploadCreate, UploadOut

CHUNK = 1 << 20
SESSION_OVER = 32 << 20
RETRIES = 5
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


def sha256_file(path: Path, progress: Progress = _quiet) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            progress(len(chunk))
    return h.hexdigest()


def _body(f: BinaryIO, counter: list[int], progress: Progress) -> Iterator[bytes]:
    while chunk := f.read(CHUNK):
        counter[0] += len(chunk)
        progress(len(chunk))
        yield chunk


class Transfers:
    """Blob transfers over a blocking httpx client (the SDK's and the CLI's)."""

    def __init__(self, http: httpx.Client, server: str) -> None:
        self.http = http
        self.server = server

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
        """Upload ``path`` unless the server has it already (then no body is sent)."""
        size = path.stat().st_size
        sha256 = sha256 or sha256_file(path)
        if self.has(sha256) is not None:
            return Sent(sha256, size, 0)
        if size <= SESSION_OVER:
            return Sent(sha256, size, self._put_once(path, sha256, size, progress))
        return Sent(sha256, size, self._put_session(path, sha256, size, progress))

    def _put_once(self, path: Path, sha256: str, size: int, progress: Progress) -> int:
        counter = [0]
        with open(path, "rb") as f:
            request = self.http.build_request(
                "PUT",
                f"/v1/blobs/{sha256}",
                content=_body(f, counter, progress),
                headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
            )
            self._send(request).close()
        return counter[0]

    def _put_session(self, path: Path, sha256: str, size: int, progress: Progress) -> int:
        body = UploadCreate(sha256=sha256, size=size).model_dump(mode="json")
        resp = self._send(self.http.build_request("POST", "/v1/uploads", json=body))
        state = UploadOut.model_validate_json(resp.content)
        sent, failures = 0, 0
        while not state.complete:
            try:
                state, moved = self._patch(path, state, progress)
                sent += moved
            except (ServerUnavailable, Conflict) as exc:
                failures += 1
                if failures > RETRIES or state.id is None:
                    raise
                time.sleep(min(0.2 * 2**failures, 5.0))
                state = self._state(state.id, exc)
        return sent

    def _state(self, upload_id: str, cause: GpufleetError) -> UploadOut:
        try:
            resp = self._send(self.http.build_request("GET", f"/v1/uploads/{upload_id}"))
        except ServerUnavailable:
            raise cause from None
        return UploadOut.model_validate_json(resp.content)

    def _patch(self, path: Path, state: UploadOut, progress: Progress) -> tuple[UploadOut, int]:
        assert state.id is not None
        counter = [0]
        with open(path, "rb") as f:
            f.seek(state.offset)
            request = self.http.build_request(
                "PATCH",
                f"/v1/uploads/{state.id}",
                content=_body(f, counter, progress),
                headers={
                    "Upload-Offset": str(state.offset),
                    "Content-Length": str(state.size - state.offset),
                    "Content-Type": "application/offset+octet-stream",
                },
            )
            resp = self._send(request)
        return UploadOut.model_validate_json(resp.content), counter[0]

    def get(self, sha256: str, dest: Path, progress: Progress = _quiet) -> int:
        """Download blob ``sha256`` to ``dest`` (verified, then renamed into place),
        resuming a ``dest.partial`` left by an earlier try. Returns bytes received."""
        partial = dest.with_name(dest.name + ".partial")
        received, failures = 0, 0
        while True:
            try:
                received += self._get_into(sha256, partial, progress)
                break
            except ServerUnavailable:
                failures += 1
                if failures > RETRIES:
                    raise
                time.sleep(min(0.2 * 2**failures, 5.0))
        got = sha256_file(partial)
        if got != sha256:
            partial.unlink(missing_ok=True)
            raise HashMismatch(f"downloaded bytes hash to {got}, not {sha256}; try again")
        os.replace(partial, dest)
        return received

    def _get_into(self, sha256: str, partial: Path, progress: Progress) -> int:
        have = partial.stat().st_size if partial.exists() else 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        request = self.http.build_request("GET", f"/v1/blobs/{sha256}", headers=headers)
        try:
            resp = self._send(request, stream=True)
        except GpufleetError as exc:
            if exc.status != 416:
                raise
            return 0  # the partial file is already complete
        received = 0
        try:
            mode = "ab" if resp.status_code == 206 else "wb"
            if have and mode == "ab":
                progress(have)
            with open(partial, mode) as f:
                for chunk in resp.iter_bytes(CHUNK):
                    f.write(chunk)
                    received += len(chunk)
                    progress(len(chunk))
        except httpx.TransportError as exc:
            raise unreachable(self.server, exc) from exc
        finally:
            resp.close()
        return received
