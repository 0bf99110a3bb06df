"""Sharing: each user's use of the pools the caller may read (``gpufleet usage``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from gpufleet.errors import NotFound
from gpufleet.server import deps
from gpufleet.server.access import Caller
from gpufleet.server.deps import state
from gpufleet.server.sharing import UserUse
from gpufleet.wire import ERRORS, UsageOut, UsageRow

router = APIRouter(prefix="/v1", responses=ERRORS, tags=["sharing"])
Reader = Annotated[Caller, Depends(deps.reader)]
HOUR = 3600.0


def _row(u: UserUse) -> UsageRow:
    return UsageRow(
        owner=u.owner,
        pool=u.pool,
        gpu_hours=round(u.gpu_seconds / HOUR, 4),
        cpu_hours=round(u.cpu_seconds / HOUR, 4),
        weight=u.weight,
        share=round(u.share, 4),
        used_share=round(u.used_share, 4),
        standing=round(u.used_share / u.share, 3) if u.share else 0.0,
        gpus_now=u.gpus_now,
        cpu_slots_now=u.cpu_now,
        jobs_now=u.jobs_now,
    )


@router.get("/usage", response_model=UsageOut)
def usage(
    request: Request,
    caller: Reader,
    window_hours: Annotated[
        float, Query(gt=0, le=24 * 366, description="the window GPU-hours are summed over")
    ] = 168.0,
    pool: Annotated[
        str | None, Query(max_length=200, description="one pool (default: every pool you read)")
    ] = None,
) -> UsageOut:
    """Per user and pool: GPU-hours and CPU-slot-hours over the window, weight, share by
    weight, part of the decayed usage, standing, and what its jobs hold now."""
    services = state(request).services
    if pool is not None and not caller.sees(pool):
        raise NotFound(f"no pool {pool!r}", detail={"pool": pool})
    rows = services.fair.report(window_hours * HOUR, pool)
    rules = services.sharing.current()
    return UsageOut(
        window_hours=window_hours,
        fair_share=rules.fair_share,
        half_life_hours=rules.half_life / HOUR,
        rows=[_row(u) for u in rows if caller.sees(u.pool)],
    )
