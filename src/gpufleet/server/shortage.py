"""Answers for a server short of disk (507) or of another resource of its database (503
with ``Retry-After``): never a 500 with a traceback. The failure is logged in one line,
and the store's :class:`~gpufleet.store.space.SpaceWatch` is told, so ``/v1/health``
says ``degraded`` until a write commits again."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import JSONResponse

from gpufleet.errors import GpufleetError, InsufficientStorage, ServerUnavailable
from gpufleet.server.deps import state
from gpufleet.server.responses import error_response
from gpufleet.store.space import Shortage, shortage

log = logging.getLogger("gpufleet.server")
RETRY_AFTER = 30  # seconds: space is freed by a person, or by the retention sweep


def shortage_error(found: Shortage) -> GpufleetError:
    """What a client is told of a shortage: what ran out, that nothing was kept, what
    to do."""
    if found.disk:
        return InsufficientStorage(
            f"the server's disk is full ({found.why}); nothing of this call was kept. "
            "The server's operator must free space; retry later",
            detail={"retry_after": RETRY_AFTER},
        )
    return ServerUnavailable(
        f"the server's database is short of resources ({found.why}); retry later",
        detail={"retry_after": RETRY_AFTER},
    )


def noted(request: Request, exc: BaseException) -> GpufleetError | None:
    """If ``exc`` is a shortage: log it in one line, mark the store full if it was space,
    and say what to answer (None: another failure)."""
    found = shortage(exc)
    if found is None:
        return None
    rid = getattr(request.state, "request_id", "-")
    if found.disk:
        state(request).services.store.space.full(found.why)
    log.warning("%s %s (request %s): %s", request.method, request.url.path, rid, found.why)
    return shortage_error(found)


async def on_shortage(request: Request, exc: Exception) -> JSONResponse:
    """The handler of database and file errors: a shortage is answered; anything else
    goes on up as it would have (a 500, logged with its traceback)."""
    err = noted(request, exc)
    if err is None:
        raise exc
    headers = {"Retry-After": str(RETRY_AFTER)}
    return error_response(err.status, err.code, err.message, err.detail, headers)
