"""Answers for a server short of disk (507) or of another resource of its database (503
with ``Retry-After``): never a 500 with a traceback. The failure is logged in one line,
and the store's :class:`~gpufleet.store.space.SpaceWatch` is told, so ``/v1/health``
says ``degraded`` until a write commits again."""

from __future__ import annotations

import logging

from fastapi import Request

from gpufleet.errors import GpufleetError, InsufficientStorage, ServerUnavailable
from gpufleet.store.space import Shortage, SpaceWatch, shortage

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


def noted(request: Request, exc: BaseException, space: SpaceWatch) -> GpufleetError | None:
    """If ``exc`` is a shortage: log it in one line, tell ``space`` (the store's) if it
    was of disk, and say what to answer (None: another failure)."""
    found = shortage(exc)
    if found is None:
        return None
    rid = getattr(request.state, "request_id", "-")
    if found.disk:
        space.full(found.why)
    log.warning("%s %s (request %s): %s", request.method, request.url.path, rid, found.why)
    return shortage_error(found)


def log_failure(exc: BaseException, what: str) -> None:
    """Log a failure of the server's own work (a sweep, the audit log's writes): a
    shortage in one line, as it may repeat every second while the disk is full; anything
    else with its traceback."""
    found = shortage(exc)
    if found is None:
        log.error("%s", what, exc_info=exc)
    else:
        log.warning("%s: %s", what, found.why)
