"""Event streams: a job's event log (``GET /v1/jobs/{ref}/events``) and the fleet's
changes (``GET /v1/events``), as Server-Sent Events; a job's log also as JSON pages.

See :mod:`gpufleet.server.events` for how followers share one reader per job.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from gpufleet.errors import Forbidden, ValidationFailed
from gpufleet.server import deps
from gpufleet.server.access import Caller
from gpufleet.server.deps import state
from gpufleet.server.event_ids import MAX_SEQ, EventIds
from gpufleet.server.events import KINDS, record
from gpufleet.store import LogRow
from gpufleet.wire import ERRORS, EventOut, EventsOut

router = APIRouter(prefix="/v1", responses=ERRORS, tags=["events"])
Reader = Annotated[Caller, Depends(deps.reader)]
SSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "events, or a JSON page"}
}
# No proxy buffering, no caching: a follower sees each batch as it is sent.
STREAM_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


async def _held(
    request: Request, stream: Callable[[asyncio.Event], AsyncGenerator[bytes, None]]
) -> AsyncIterator[bytes]:
    """``stream``, for as long as the caller's token (or dashboard session) lets it in:
    a revoke, a rotate or a sign-out, on any server, ends it within a second."""
    with state(request).holds.hold(deps.credential(request)) as hold:
        async with contextlib.aclosing(stream(hold.ended)) as chunks:
            async for chunk in chunks:
                yield chunk


def _resume_point(after: int | None, last_event_id: str | None, ids: EventIds) -> int:
    """Where a follower starts: after ``Last-Event-ID`` (a reconnecting EventSource sends
    it), else after ``?after=``, else from the first record (ids as the caller sees them)."""
    if last_event_id is None or not last_event_id.strip():
        return ids.show(after or 0)
    text = last_event_id.strip()
    if not text.isdigit() or int(text) > MAX_SEQ:
        raise ValidationFailed(
            f"header Last-Event-ID: {last_event_id[:40]!r} is not an event id "
            "(a whole number from 0, as sent in an event's id: line)",
            detail={"field": "header.Last-Event-ID"},
        )
    return ids.show(int(text))


def _event(row: LogRow, ids: EventIds) -> EventOut:
    """A record of a page, numbered as ``ids`` show it."""
    seq = ids.hide(row.seq)
    data = {**record(row), "seq": seq}
    return EventOut(seq=seq, type=KINDS.get(row.stream, "log"), data=data)


STREAMS = {"state": ("state",), "progress": ("progress",), "log": ("stdout", "stderr")}


def _streams(types: str | None) -> list[str] | None:
    """The stored streams behind ``?types=`` (None: every one)."""
    if types is None:
        return None
    wanted = [t.strip() for t in types.split(",") if t.strip()]
    bad = [t for t in wanted if t not in STREAMS]
    if bad or not wanted:
        raise ValidationFailed(
            f"types: {(bad or [types])[0][:40]!r} is not an event type; "
            f"expected a comma-separated list of {', '.join(STREAMS)}",
            detail={"field": "types"},
        )
    return [s for t in wanted for s in STREAMS[t]]


@router.get("/jobs/{ref}/events", response_model=EventsOut, responses=SSE)
async def job_events(
    ref: str,
    request: Request,
    caller: Reader,
    after: Annotated[int | None, Query(ge=0, le=MAX_SEQ)] = None,
    format: Annotated[Literal["sse", "json"], Query()] = "sse",
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    types: Annotated[
        str | None, Query(max_length=100, description="JSON only: comma-separated event types")
    ] = None,
    before: Annotated[
        int | None, Query(ge=1, le=MAX_SEQ, description="JSON only: the last page before this")
    ] = None,
    last_event_id: Annotated[str | None, Header(max_length=100)] = None,
) -> Response | EventsOut:
    """A job's event log: its status changes (``state``), progress records (``progress``)
    and output lines (``log``), numbered by one sequence (opaque numbers, in no order, to
    a caller confined to some pools), from after ``Last-Event-ID`` or ``?after=``. As
    Server-Sent Events (each with ``id: <seq>``), until the job has ended and every record
    is sent, with a ping comment every 15 s while idle; or, with ``?format=json``, one page
    of at most ``limit`` records and a few MiB of lines, where the next begins and whether
    there is ``more``: of the ``types`` named (default: all), and with ``before``, the
    last page before that record (to scroll back)."""
    st = state(request)
    ids = deps.event_ids(request, caller)
    start = _resume_point(after, last_event_id, ids)
    streams = _streams(types)
    job = await run_in_threadpool(st.services.reads.job, ref, caller.pools)
    if format == "json":
        page = await run_in_threadpool(
            st.services.reads.logs,
            job.id,
            start,
            limit,
            streams,
            None if before is None else ids.show(before),
        )
        return EventsOut(
            job_id=job.id,
            status=job.status.value,
            events=[_event(r, ids) for r in page.rows],
            next=ids.hide(page.rows[-1].seq if page.rows else start),
            more=page.more,
        )
    stream = _held(
        request, lambda ended: st.hub.follow(job.id, job.status.value, start, ended, ids)
    )
    return EventSourceResponse(stream, ping=st.hub.ping, headers=STREAM_HEADERS)


@router.get("/events", responses=SSE)
async def fleet_events(
    request: Request,
    caller: Reader,
    pool: Annotated[str | None, Query(max_length=200)] = None,
) -> Response:
    """The fleet's changes from now on, as Server-Sent Events: every job's status change
    (``job``, with its ``job_id``, ``pool`` and the state record) and every worker's change
    of status, drain or GPU use (``worker``: read the worker again). A submitter sees its
    pools only; ``?pool=`` narrows to one. The first event (``hello``) says it is open."""
    st = state(request)
    pools = caller.pools
    if pool is not None:
        if pools is not None and pool not in pools:
            raise Forbidden(
                f"pool {pool!r} is not one of this token's pools ({', '.join(pools)})",
                detail={"pool": pool},
            )
        pools = (pool,)
    ids = deps.event_ids(request, caller)
    stream = _held(request, lambda ended: st.hub.fleet_events(pools, ended, ids))
    return EventSourceResponse(stream, ping=st.hub.ping, headers=STREAM_HEADERS)
