"""Blobs: ``HEAD`` (do you have it?), streaming ``PUT`` verified by hash, resumable upload
sessions, and ``GET`` with ``Range``. Blob ids are SHA-256 hex digests."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.requests import ClientDisconnect

from gpufleet.domain.models import Role
from gpufleet.errors import (
    GpufleetError,
    NotFound,
    RequestTimeout,
    ValidationFailed,
)
from gpufleet.server import deps, views
from gpufleet.server.access import Caller
from gpufleet.server.asgi import AnswerCut
from gpufleet.server.blobs import BlobService
from gpufleet.server.deps import state
from gpufleet.server.pump import Stalled
from gpufleet.server.uploads import UploadSessions
from gpufleet.wire import ERRORS, BlobOut, UploadCreate, UploadOut

log = logging.getLogger("gpufleet.server")
router = APIRouter(
    prefix="/v1",
    tags=["blobs"],
    responses={
        **ERRORS,
        413: {"model": ERRORS[422]["model"], "description": "over the blob size limit"},
        507: {"model": ERRORS[422]["model"], "description": "the server's disk is full"},
    },
)
User = Annotated[Caller, Depends(deps.blob_user)]
BlobId = Annotated[
    str, Path(pattern=r"^[0-9a-f]{64}$", description="the blob's SHA-256 (64 hex digits)")
]
UploadId = Annotated[str, Path(pattern=r"^u-[0-9a-f]{24}$")]
OCTETS: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _blobs(request: Request) -> BlobService:
    return state(request).services.blobs


def _uploads(request: Request) -> UploadSessions:
    return state(request).services.blobs.uploads


def _declared(request: Request) -> int | None:
    raw = request.headers.get("content-length")
    return int(raw) if raw is not None and raw.isdigit() else None


def _readable(request: Request, caller: Caller, sha256: str) -> bool:
    """Whether the caller may read the blob: admins and operators of every pool read
    every blob; other callers those their pools uploaded or use (see ``blob_pools``)."""
    pools = caller.pools
    return _blobs(request).readable(sha256, pools)


def _grant(request: Request, caller: Caller, sha256: str) -> None:
    if caller.pools is not None:
        _blobs(request).grant((sha256, p) for p in caller.pools)


def _no_blob(sha256: str) -> NotFound:
    return NotFound(f"no blob {sha256}", detail={"blob": sha256})


@router.head("/blobs/{sha256}", responses={200: {"description": "the server has it"}})
async def has_blob(sha256: BlobId, request: Request, caller: User) -> Response:
    """200 with Content-Length when the server holds the blob and the caller may read it,
    404 when not."""
    size = await run_in_threadpool(_blobs(request).has, sha256)
    if size is None or not await run_in_threadpool(_readable, request, caller, sha256):
        raise _no_blob(sha256)
    return Response(status_code=200, headers={"Content-Length": str(size), "ETag": f'"{sha256}"'})


@router.get(
    "/blobs/{sha256}",
    response_class=FileResponse,
    responses={206: {"description": "the requested range"}, 416: ERRORS[422]},
)
async def get_blob(sha256: BlobId, request: Request, caller: User) -> Response:
    """The blob's bytes; a single ``Range: bytes=A-B`` gives 206 with that part."""
    blobs = _blobs(request)
    size = await run_in_threadpool(blobs.require, sha256)
    if not await run_in_threadpool(_readable, request, caller, sha256):
        raise _no_blob(sha256)
    wanted = _check_range(request.headers.get("range"), size)
    headers = {
        "ETag": f'"{sha256}"',
        "Cache-Control": "private, max-age=31536000, immutable",
        "Accept-Ranges": "bytes",
    }
    start, end, status = 0, size - 1, 200
    whole = wanted is None or wanted == (0, size - 1)  # checked against its name as it goes
    if wanted is not None:
        start, end, status = *wanted, 206
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        path = blobs.storage.local_path(sha256)
        if path is not None and not whole:  # a part, from the file (the client checks it)
            response = FileResponse(path, media_type="application/octet-stream", headers=headers)
            response.chunk_size = 1 << 20
            return response
    headers["Content-Length"] = str(end - start + 1)
    chunks = await run_in_threadpool(blobs.storage.chunks, sha256, start, end)
    if whole:
        chunks = verified(chunks, sha256)
    return StreamingResponse(
        iterate_in_threadpool(chunks),
        status_code=status,
        media_type="application/octet-stream",
        headers=headers,
    )


class CorruptBlob(AnswerCut):
    """A blob's bytes on the server's storage no longer hash to its name."""


def verified(chunks: Iterator[bytes], sha256: str) -> Iterator[bytes]:
    """``chunks``, each held back until the next is read, and the last only once the hash
    of them all is the blob's name: a blob corrupted on the server's storage is never sent
    whole, so a browser's download fails too (not only the CLI's and the worker's, which
    check it themselves). The mismatch is logged, naming the blob."""
    hasher = hashlib.sha256()
    held: bytes | None = None
    for chunk in chunks:
        hasher.update(chunk)
        if held is not None:
            yield held
        held = chunk
    if hasher.hexdigest() != sha256:
        log.error(
            "blob %s is corrupt on the server's storage (its bytes hash to %s): its download "
            "was cut off; restore it from a backup, or remove it and send it again",
            sha256,
            hasher.hexdigest(),
        )
        raise CorruptBlob(sha256)
    if held is not None:
        yield held


def _check_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The (first, last) byte a ``Range`` header asks for, None without one; bad ranges are
    answered in the API's error shape (Starlette would answer plain text)."""
    if header is None:
        return None
    m = _RANGE.match(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        raise ValidationFailed(
            f"unsupported Range header {header!r}; send one range, bytes=START-[END]",
            detail={"header": "Range"},
        )
    start = int(m.group(1)) if m.group(1) else None
    end = int(m.group(2)) if m.group(2) else None
    if (
        (start is not None and start >= size)
        or (start is not None and end is not None and end < start)
        or (start is None and end == 0)
    ):
        err = GpufleetError(
            f"range {header!r} is outside the blob ({size} bytes)", detail={"size": size}
        )
        err.code, err.status = "range_not_satisfiable", 416
        raise err
    if start is None:  # the last END bytes
        return max(0, size - (end or 0)), size - 1
    return start, size - 1 if end is None else min(end, size - 1)


@router.put(
    "/blobs/{sha256}",
    response_model=BlobOut,
    status_code=201,
    openapi_extra=OCTETS,
    responses={200: {"model": BlobOut, "description": "the server already had it"}},
)
async def put_blob(
    sha256: BlobId, request: Request, response: Response, caller: User
) -> Response | BlobOut:
    """Upload a blob in one streamed request. The bytes must hash to ``sha256`` (else 422
    and nothing is kept); a body over the size limit is refused with 413 as soon as its
    Content-Length, or its bytes, say so. The caller's pools may read it afterwards."""
    blobs = _blobs(request)
    blobs.check_length(_declared(request), blobs.settings.max_size)
    readable = await run_in_threadpool(_readable, request, caller, sha256)
    try:
        created = await blobs.put(sha256, request.stream(), prove=not readable)
    except Stalled:
        raise RequestTimeout(
            f"the body stopped arriving for {blobs.settings.idle_timeout:g} s; nothing was "
            "kept, send it again",
            detail={"blob": sha256},
        ) from None
    except ClientDisconnect:
        return Response(status_code=400)  # the client is gone; nobody reads this
    if not created:
        response.status_code = 200
    await run_in_threadpool(_grant, request, caller, sha256)
    row = await run_in_threadpool(blobs.get, sha256)
    assert row is not None
    return views.blob_out(row)


@router.get("/blobs", response_model=list[BlobOut])
def list_blobs(
    request: Request, caller: User, limit: Annotated[int, Query(ge=1, le=100_000)] = 1000
) -> list[BlobOut]:
    """The newest blobs first (a submitter or worker: those its pools may read)."""
    return [views.blob_out(b) for b in _blobs(request).listed(limit, caller.pools)]


@router.post(
    "/uploads",
    response_model=UploadOut,
    status_code=201,
    responses={200: {"model": UploadOut, "description": "the server already has the blob"}},
)
def create_upload(
    body: UploadCreate, request: Request, response: Response, caller: User
) -> UploadOut:
    """Open a resumable upload for a large blob; send its bytes with PATCH. When the server
    already has the blob (and the caller may read it) the answer says ``complete`` and
    nothing needs sending. Without ``sha256`` the client may hash while it sends: the
    answer to the last byte names the blob by the hash of what the server received."""
    readable = body.sha256 is not None and _readable(request, caller, body.sha256)
    out = _uploads(request).create(body.sha256, body.size, readable, owner=caller.id)
    if out.complete:
        response.status_code = 200
    return out


@router.get("/uploads/{upload_id}", response_model=UploadOut)
def upload_state(upload_id: UploadId, request: Request, caller: User) -> UploadOut:
    """Where an upload stands: resume by sending from ``offset``."""
    _own(request, caller, upload_id)
    return _uploads(request).state(upload_id)


def _own(request: Request, caller: Caller, upload_id: str) -> None:
    """An upload session is its opener's alone (an admin's too)."""
    _uploads(request).check_owner(upload_id, caller.id, caller.role == Role.ADMIN)


@router.patch("/uploads/{upload_id}", response_model=UploadOut, openapi_extra=OCTETS)
async def append_upload(
    upload_id: UploadId,
    request: Request,
    caller: User,
    upload_offset: Annotated[int, Header(ge=0, le=2**50, description="where these bytes go")],
) -> UploadOut:
    """Append bytes at ``Upload-Offset``, which must be the session's offset (else 409
    with the right one). A broken connection keeps what arrived; the last byte verifies
    the whole blob's size and hash and stores it. 409 too while another request sends."""
    uploads = _uploads(request)
    await run_in_threadpool(_own, request, caller, upload_id)
    try:
        out = await uploads.append(
            upload_id, upload_offset, request.stream(), declared=_declared(request)
        )
        if out.complete:
            assert out.sha256 is not None  # a complete upload is named
            await run_in_threadpool(_grant, request, caller, out.sha256)
        return out
    except ClientDisconnect:
        return await run_in_threadpool(uploads.state, upload_id)


@router.delete("/uploads/{upload_id}", status_code=204)
def abort_upload(upload_id: UploadId, request: Request, caller: User) -> None:
    """Drop an unfinished upload and its bytes (409 while a request is sending them)."""
    _own(request, caller, upload_id)
    _uploads(request).abort(upload_id)
