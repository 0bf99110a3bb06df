"""Job environments: a pool's lock of an unlocked environment spec, read by the pool's
workers that build it and recorded by the first one whose build resolved it
(:mod:`gpufleet.server.environments`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response

from gpufleet.server import deps, views
from gpufleet.server.access import Caller
from gpufleet.server.deps import note, state
from gpufleet.wire import ERRORS, EnvLockOut, EnvLockPut

router = APIRouter(prefix="/v1", responses=ERRORS, tags=["environments"])
EnvReader = Annotated[Caller, Depends(deps.env_reader)]
Worker = Annotated[Caller, Depends(deps.worker)]
LockKey = Annotated[
    str,
    Path(
        pattern=r"^[0-9a-f]{64}$",
        description="the lock key (domain.environments.lock_key): 64 hex digits",
    ),
]


@router.get("/environments/locks/{key}", response_model=EnvLockOut)
def get_lock(
    key: LockKey,
    request: Request,
    caller: EnvReader,
    pool: Annotated[
        str | None,
        Query(
            max_length=200,
            description="the pool whose lock to read (locks are per pool); default: the "
            "token's only pool, or 'default'. A worker or a pool-scoped operator reads only "
            "its own pools' (403)",
        ),
    ] = None,
) -> EnvLockOut:
    """The lock a pool recorded for an unlocked environment spec (404: none yet, the
    first build in the pool resolves it). A worker reading it may download its blob from
    then on."""
    return views.env_lock_out(state(request).services.env_locks.get(key, pool, caller))


@router.put(
    "/environments/locks/{key}",
    response_model=EnvLockOut,
    responses={201: {"model": EnvLockOut, "description": "recorded: the first for this key"}},
)
def put_lock(
    key: LockKey, body: EnvLockPut, request: Request, response: Response, caller: Worker
) -> EnvLockOut:
    """Record the lock a worker's build of a job's unlocked environment resolved, as the
    lock of the job's pool (its blob uploaded first; the worker must hold the job's
    lease, so it is of that pool). 201: recorded, the first for
    this key. 200: a lock was recorded before and stands, and is returned: the worker
    installs that one, not its own, so every build of the spec has the same versions.
    With ``replace`` (only for a job whose environment asks for ``upgrade``), the
    recorded lock is replaced (200, ``replaced_at`` set; the audit log says so)."""
    row, created = state(request).services.env_locks.put(key, body, caller)
    note(request, key)
    response.status_code = 201 if created else 200
    return views.env_lock_out(row)
